"""MuonAdamW in one process: equal to ``torch.optim.Muon`` + ``torch.optim.AdamW`` bit for bit; the split rule;
errors; state dict round trip."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_par.models import GPTConfig, GPTLightningModule
from lightning_par.optim import MuonAdamW, muon_param_groups, muon_split
from tests.support.user_models import TorchMuonAndAdamW, make_mlp, muon_optimizer


def _train(module: nn.Module, opt, steps: int = 8, seed: int = 1) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        loss = module.loss_fn(module.model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def test_one_process_equals_torch_muon_plus_adamw_bitwise():
    ours, ref = make_mlp("muon"), make_mlp("muon")
    a = _train(ours, muon_optimizer(ours))
    b = _train(ref, TorchMuonAndAdamW(ref))
    assert a == b
    for (n, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), n
    assert a[-1] < a[0]


@pytest.mark.parametrize("nesterov,adjust", [(False, "match_rms_adamw"), (True, "original")])
def test_options_follow_torch(nesterov, adjust):
    torch.manual_seed(0)
    w1, w2 = nn.Parameter(torch.randn(12, 5)), nn.Parameter(torch.randn(12, 5))
    w2.data.copy_(w1.data)
    ours = MuonAdamW([{"params": [w1], "use_muon": True}], lr=0.05, nesterov=nesterov, adjust_lr_fn=adjust,
                     ns_steps=3, momentum=0.9, weight_decay=0.2)
    ref = torch.optim.Muon([w2], lr=0.05, nesterov=nesterov, adjust_lr_fn=adjust, ns_steps=3, momentum=0.9,
                           weight_decay=0.2)
    for k in range(3):
        g = torch.randn(12, 5, generator=torch.Generator().manual_seed(k))
        w1.grad, w2.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert torch.equal(w1, w2)


def test_a_stack_of_expert_matrices_is_orthogonalised_per_matrix():
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(3, 6, 4))
    singles = [nn.Parameter(w.detach()[e].clone()) for e in range(3)]
    ours = MuonAdamW([{"params": [w], "use_muon": True}], lr=0.02)
    ref = torch.optim.Muon(singles, lr=0.02)
    g = torch.randn(3, 6, 4)
    w.grad = g.clone()
    for e in range(3):
        singles[e].grad = g[e].clone()
    ours.step()
    ref.step()
    assert torch.equal(w.detach(), torch.stack([s.detach() for s in singles]))


def test_the_gpt_split_rule():
    config = GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=16, vocab_size=256, num_experts=4, moe_every=2)
    module = GPTLightningModule(config)
    muon, adamw = muon_split(module)
    muon_names, adamw_names = {n for n, _ in muon}, {n for n, _ in adamw}
    assert "model.blocks.0.attn.q_proj.weight" in muon_names and "model.blocks.0.mlp.c_fc.weight" in muon_names
    assert "model.blocks.1.mlp.experts.w1" in muon_names
    for name in ("model.wte.weight", "model.wpe.weight", "model.lm_head.weight", "model.blocks.0.ln_1.weight",
                 "model.blocks.0.attn.q_proj.bias", "model.blocks.1.mlp.router.gate.weight"):
        assert name in adamw_names, name
    # overridable: everything 2-D except the head
    muon, _ = muon_split(module, is_muon=lambda n, p, m: p.dim() >= 2 and "lm_head" not in n)
    assert "model.wte.weight" in {n for n, _ in muon}


def test_hugging_face_head_and_embeddings_go_to_adamw():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, vocab_size=64, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    muon, adamw = muon_split(model)
    muon_names, adamw_names = {n for n, _ in muon}, {n for n, _ in adamw}
    assert "model.layers.0.mlp.gate_proj.weight" in muon_names
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= adamw_names


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="use_muon"):
        MuonAdamW([nn.Parameter(torch.zeros(2, 2))])
    with pytest.raises(ValueError, match="2 or more dimensions"):
        MuonAdamW([{"params": [nn.Parameter(torch.zeros(3))], "use_muon": True}])
    with pytest.raises(ValueError, match="momentum"):
        MuonAdamW(make_mlp("muon"), momentum=-1.0)


def test_state_dict_round_trip_continues_identically():
    a, b = make_mlp("muon"), make_mlp("muon")
    opt_a = muon_optimizer(a)
    _train(a, opt_a, steps=3)
    b.load_state_dict(a.state_dict())
    opt_b = muon_optimizer(b)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # torch shares the tensors otherwise
    assert _train(a, opt_a, steps=3, seed=5) == _train(b, opt_b, steps=3, seed=5)
    assert "momentum_buffer" in opt_b.state[next(iter(b.model[1].fc1.parameters()))]


def test_the_recipe_override_model_optimizer_muon_builds_muon():
    from hydra import compose, initialize_config_dir

    from lightning_par.config.build import build_module
    from lightning_par.config.schema import register_configs
    from tests.config.test_compose import CONF

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=["model=tiny", "model.optimizer=muon", "model.muon_lr=0.01"])
    optimizer = build_module(cfg).configure_optimizers()["optimizer"]
    assert isinstance(optimizer, MuonAdamW)
    assert [g["initial_lr"] for g in optimizer.param_groups if g["use_muon"]] == [0.01]  # warmup scales "lr"
    with pytest.raises(ValueError, match="optimizer='lion'"):
        GPTLightningModule(optimizer="lion")


def test_hugging_face_module_takes_muon():
    pytest.importorskip("transformers")
    from lightning_par.hf import HFCausalLM

    module = HFCausalLM(model_type="llama", config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                        num_attention_heads=2, num_key_value_heads=1, vocab_size=64),
                        optimizer="muon", muon_lr=0.01)
    optimizer = module.configure_optimizers()
    assert isinstance(optimizer, MuonAdamW)
    names = {id(p): n for n, p in module.named_parameters()}
    muon = {names[id(p)] for g in optimizer.param_groups if g["use_muon"] for p in g["params"]}
    assert "model.model.layers.0.self_attn.q_proj.weight" in muon or any("q_proj" in n for n in muon)
    assert not any("embed_tokens" in n or "lm_head" in n or "norm" in n for n in muon)


def test_planner_terms():
    from lightning_par.planner.muon import gpt_muon_matrices, muon_precision, muon_state_bytes, muon_step_cost

    prec = muon_precision("fp32", 0.5)
    assert prec.optimizer_bytes == 6.0 and prec.param_bytes == 4
    assert muon_state_bytes(10, 5, 2) == 4 * 10 + 8 * 5 + 4 * 2
    with pytest.raises(ValueError, match="muon_fraction"):
        muon_precision("fp32", 1.5)
    mats = gpt_muon_matrices(2, 8)
    cost = muon_step_cost(mats, 2)
    whole = sum(m * k for m, k in mats)
    # owners balanced: each rank receives about 6 M (n-1)/n^2 = 1.5 M bytes at n = 2, never the all-gather's 2 M
    assert 1.2 * whole <= cost.received_bytes < 2 * whole
    assert muon_step_cost(mats, 1).received_bytes == 0


def test_planner_muon_fraction_of_the_gpt_and_its_memory():
    from lightning_par.planner import ModelSpec, plan
    from lightning_par.planner.muon import muon_fraction, muon_precision

    config = GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=16, vocab_size=256)
    module = GPTLightningModule(config)
    muon, _ = muon_split(module)
    total = sum(p.numel() for p in module.parameters())
    spec = ModelSpec(num_layers=4, hidden_size=32, num_heads=2, vocab_size=256, seq_len=16)
    assert spec.total_params() == total
    assert muon_fraction(spec) == pytest.approx(sum(p.numel() for _, p in muon) / total)
    # the planner's memory with Muon's K: zero2 at dp 2 holds 8 bytes per parameter of AdamW state / 2
    from lightning_par.planner import Layout, predict

    layout = Layout(dp_size=2, tp_size=1, pp_size=1, dp_mode="zero2", micro_batch_size=1, num_microbatches=1)
    adamw = predict(spec, layout, "a100-80gb", precision="fp32").memory.model_state_bytes
    with_muon = predict(spec, layout, "a100-80gb", precision=muon_precision("fp32", muon_fraction(spec)))
    muon_numel = sum(p.numel() for _, p in muon)
    assert adamw - with_muon.memory.model_state_bytes == pytest.approx(4 * muon_numel / 2, rel=0.02)
