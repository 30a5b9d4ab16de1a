"""The experts' forms (``torch._grouped_mm`` with its CPU backward, padded ``bmm``, the per-expert loop) against each
other and against Hugging Face's own experts, the form chooser, the host reads of a MoE layer, and DeepSeek-V3's
auxiliary-loss-free balancing on one process (bias update, skewed router brought to balance, resume)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_par.expert_parallel.grouped import FORMS, choose_form, expert_ffn
from lightning_par.models.moe import MoE, update_expert_bias


def _segments(num_experts: int, tokens: int, seed: int = 0, empty: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    high = num_experts - (1 if empty is not None else 0)
    routed = torch.randint(0, high, (tokens,), generator=g)
    if empty is not None:
        routed[routed >= empty] += 1  # expert ``empty`` gets no token
    return torch.bincount(routed, minlength=num_experts)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("form", ["bmm", "grouped_mm"])
@pytest.mark.parametrize("num_experts, tokens", [(2, 7), (8, 100), (64, 512)])
def test_grouped_forms_match_the_loop_forward_and_backward(num_experts, tokens, form):
    torch.manual_seed(0)
    d, h = 16, 24
    counts = _segments(num_experts, tokens, empty=1)
    x = torch.randn(tokens, d, requires_grad=True)
    w1 = torch.randn(num_experts, d, h, requires_grad=True)
    w2 = torch.randn(num_experts, h, d, requires_grad=True)
    results = {}
    for name in ("loop", form):
        y = expert_ffn(x, counts, w1, w2, F.gelu, form=name)
        results[name] = (y, *torch.autograd.grad(y.pow(2).sum(), (x, w1, w2)))
    for got, want in zip(results[form], results["loop"]):
        assert _rel(got, want) <= 1e-5
        if form == "grouped_mm":  # on CPU each group's product is the loop's own mm
            assert torch.equal(got, want)
    assert counts[1] == 0 and results[form][2][1].abs().max() == 0  # an expert without tokens gets no gradient


@pytest.mark.parametrize("num_experts, tokens", [(8, 100), (64, 512)])
def test_grouped_mm_on_transformers_layout_matches_the_loop_with_gradients_in_the_stored_layout(num_experts, tokens):
    """Weights stored ``(E, out, in)`` and passed transposed (the Hugging Face experts): the CPU grouped backward
    computes their gradient in the stored layout, equal to the loop's (the parameters then take it without a copy
    into their strides)."""
    if choose_form(torch.zeros(1, 16), (torch.zeros(1, 16, 32),), requested="grouped_mm") != "grouped_mm":
        pytest.skip("torch._grouped_mm does not run on this CPU")
    torch.manual_seed(0)
    d, h = 16, 32
    counts = _segments(num_experts, tokens, empty=1)
    x = torch.randn(tokens, d, requires_grad=True)
    gate_up = torch.randn(num_experts, 2 * h, d, requires_grad=True)
    down = torch.randn(num_experts, d, h, requires_grad=True)

    def swiglu(t: torch.Tensor) -> torch.Tensor:
        return F.silu(t[:, :h]) * t[:, h:]

    results = {}
    for name in ("loop", "grouped_mm"):
        w_in, w_out = gate_up.transpose(1, 2), down.transpose(1, 2)
        y = expert_ffn(x, counts, w_in, w_out, swiglu, form=name)
        results[name] = (y, *torch.autograd.grad(y.pow(2).sum(), (x, w_in, w_out)))
    for got, want in zip(results["grouped_mm"], results["loop"]):
        assert _rel(got, want) <= 1e-6
    # the views' gradients are transposes of contiguous (E, out, in) tensors: the stored weights' own layout
    assert all(g.transpose(1, 2).is_contiguous() for g in results["grouped_mm"][2:])
    assert counts[1] == 0 and results["grouped_mm"][2][1].abs().max() == 0


def test_no_tokens_still_depends_on_the_tokens():
    """Under ep a rank may receive no token: its output must still lead back to the (empty) tokens, so that the
    combine's backward all-to-all runs on every rank."""
    x = torch.zeros(0, 4, requires_grad=True)
    for form in FORMS:
        w1, w2 = torch.randn(3, 4, 8, requires_grad=True), torch.randn(3, 8, 4, requires_grad=True)
        y = expert_ffn(x, torch.zeros(3, dtype=torch.int64), w1, w2, F.gelu, form=form)
        assert y.shape == (0, 4) and y.requires_grad
        # and the experts' weights get a zero gradient, not none: an optimizer skips a parameter without one (AdamW's
        # moments would not move it this step, as they do in one process, where some expert always has tokens)
        y.sum().backward()
        assert w1.grad is not None and w2.grad is not None and not w1.grad.any() and not w2.grad.any()


def test_the_form_is_chosen_by_one_function():
    x, w = torch.randn(10, 8), torch.randn(4, 8, 8)
    # CPU: grouped_mm with its own backward (measured faster than the loop, the loop faster than the padded bmm)
    assert choose_form(x, (w, w)) == "grouped_mm"
    assert choose_form(x, (w, w), rows=[3, 3, 2, 2]) == "grouped_mm"
    assert choose_form(x.bfloat16(), (w.bfloat16(), w.bfloat16()), requested="grouped_mm") == "grouped_mm"
    # where grouped_mm does not run (float64; a width of 6 floats, 24 bytes: not a multiple of 16): the loop, and the
    # bmm when grouped_mm is asked for
    assert choose_form(x.double(), (w.double(), w.double())) == "loop"
    odd = torch.randn(4, 8, 6)
    assert choose_form(x, (odd, odd.transpose(1, 2))) == "loop"
    assert choose_form(x.double(), (w.double(), w.double()), requested="grouped_mm") == "bmm"
    assert choose_form(x, (w, w), requested="bmm") == "bmm"
    meta = x.to("meta")  # the choice off the CPU (an accelerator without grouped_mm's conditions): bmm unless skewed
    assert choose_form(meta, (w, w), rows=[3, 3, 2, 2]) == "bmm"
    assert choose_form(meta, (w, w), rows=[40, 0, 0, 0]) == "loop"  # 4 x 40 padded rows for 40 tokens: skewed
    assert choose_form(x, (w, w), requested="loop") == "loop"
    assert set(FORMS) == {"grouped_mm", "bmm", "loop"}
    with pytest.raises(ValueError, match=r"experts form='fast' is not valid: expected one of \['auto', 'grouped_mm'"):
        choose_form(x, (w, w), requested="fast")


@pytest.mark.parametrize("field, value, words", [
    ("balance", "none", "one of ['aux_loss', 'bias', 'both']"),
    ("bias_update_rate", 0.0, "a finite number > 0"),
    ("experts_form", "cuda", "one of ['auto', 'grouped_mm', 'bmm', 'loop']"),
])
def test_bad_balance_and_form_options_name_field_value_and_valid_values(field, value, words):
    from lightning_par.models import GPTConfig

    with pytest.raises(ValueError, match=f"GPTConfig.moe_{field}={value!r}") as err:
        GPTConfig.from_preset("moe_tiny", **{f"moe_{field}": value})
    assert words in str(err.value)


@pytest.mark.parametrize("gating, shared, capacity", [("softmax", False, None), ("sigmoid", True, 1.0)])
def test_gpt_moe_layer_grouped_forms_match_the_loop(gating, shared, capacity):
    results = {}
    x = torch.randn(3, 12, 16, generator=torch.Generator().manual_seed(1))
    for form in ("loop", "bmm", "grouped_mm"):
        torch.manual_seed(0)
        layer = MoE(16, 32, 8, 2, gating=gating, shared_expert=shared, capacity_factor=capacity, experts_form=form)
        y = layer(x)
        y.pow(2).mean().backward()
        results[form] = [y] + [p.grad for p in layer.parameters()]
    for form in ("bmm", "grouped_mm"):
        for got, want in zip(results[form], results["loop"]):
            assert _rel(got, want) <= 1e-5, form


class _HostReads:
    """Counts reads of tensor values to the host (``tolist``, ``item``, ``int()``/``float()``/``bool()``)."""

    NAMES = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__")

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)

            def wrapped(t, *a, _original=original, **k):
                self.count += 1
                return _original(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, wrapped)


@pytest.mark.parametrize("form, reads", [("bmm", 1), ("loop", 1), ("grouped_mm", 0)])
def test_a_moe_layer_reads_the_host_once(monkeypatch, form, reads):
    torch.manual_seed(0)
    layer = MoE(16, 32, 8, 2, capacity_factor=1.5, experts_form=form, balance="both")
    x = torch.randn(2, 12, 16)
    # the once-per-process probe of whether grouped_mm computes on CPU (functools.cache) reads its 2 x 4 result to the
    # host the first time: done here, so that the count is the layer's own reads whatever ran before in this process
    # (alone on an xdist worker, this test was the first to call it)
    from lightning_par.compat import grouped_mm_runs_on_cpu

    grouped_mm_runs_on_cpu()
    counter = _HostReads(monkeypatch)
    layer(x).sum().backward()
    assert counter.count == reads


# ---------------------------------------------------------------------------------------- Hugging Face experts
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "mixtral", "olmoe", "qwen2_moe"])
def test_hf_experts_grouped_forms_match_the_loop_and_the_models_own_forward(arch):
    pytest.importorskip("transformers")
    from lightning_par.hf import HFCausalLM
    from lightning_par.hf.experts import ContractExperts, expert_modules

    moe = {"qwen3_moe": {"num_experts": 8, "moe_intermediate_size": 32},
           "qwen2_moe": {"num_experts": 8, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
           "mixtral": {"num_local_experts": 8}, "olmoe": {"num_experts": 8},
           "deepseek_v3": {"n_routed_experts": 8, "moe_intermediate_size": 32, "first_k_dense_replace": 0,
                           "n_group": 1, "topk_group": 1, "q_lora_rank": 32, "kv_lora_rank": 16,
                           "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16}}[arch]
    config = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64, "max_position_embeddings": 32,
              "num_experts_per_tok": 2, **moe}
    torch.manual_seed(0)
    network = HFCausalLM(model_type=arch, config=config).model
    (path,) = expert_modules(network)
    experts = network.get_submodule(path)
    own = next(c for c in type(experts).__mro__ if not issubclass(c, ContractExperts)).forward
    own = getattr(own, "__wrapped__", own)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 32, generator=g)
    index = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(40)])
    weights = torch.rand(40, 2, generator=g)
    theirs = own(experts, x, index, weights)
    grads = {}
    for form in FORMS:
        experts.form = form
        assert _rel(experts(x, index, weights), theirs) <= 1e-5, form
        # and the gradients of the (E, out, in) weights, read through transposed views
        grads[form] = torch.autograd.grad(experts(x, index, weights).pow(2).sum(),
                                          (experts.gate_up_proj, experts.down_proj))
    for form in ("bmm", "grouped_mm"):
        for got, want in zip(grads[form], grads["loop"]):
            assert _rel(got, want) <= 1e-5, form


# ---------------------------------------------------------------------------------- auxiliary-loss-free balancing
def _skewed(balance: str, rate: float = 0.003) -> MoE:
    """A tiny MoE whose router sends most tokens to experts 0 and 1 at start (their gate rows point along the
    tokens' common direction). Gate rows ~ N(0, 0.3): scores that vary from token to token, as a trained router's
    do (with the default N(0, 0.02) every token scores the same and a bias moves them all at once)."""
    torch.manual_seed(0)
    layer = MoE(16, 16, 8, 2, gating="sigmoid", balance=balance, bias_update_rate=rate, z_loss_coeff=0.0)
    with torch.no_grad():
        layer.router.gate.weight.normal_(0, 0.3)
        layer.router.gate.weight[:2] += 0.2
    return layer


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """1,024 tokens (2,048 routed copies: the per-step count noise stays near 1.1 max/mean)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(32, 32, 16, generator=g) + 0.5  # a common direction: the skewed rows score higher
    return x, x.flip(-1)


def _imbalance(layer: MoE) -> float:
    counts = layer.last_stats["tokens_per_expert"].float()
    return float(counts.max() / counts.mean())


def _train(layer: MoE, steps: range, optimizer: torch.optim.Optimizer) -> list[float]:
    curve = []
    for step in steps:
        x, target = _batch(step)
        F.mse_loss(layer(x), target).backward()  # no auxiliary loss: balance="bias" drops it
        curve.append(_imbalance(layer))
        optimizer.step()
        optimizer.zero_grad()
        layer.update_expert_bias()
    return curve


def test_bias_update_is_deepseek_v3s_rule_on_selection_only():
    layer = _skewed("bias", rate=0.1)
    x, _ = _batch(0)
    probs_before = layer.router(x)[1]
    layer(x)
    load = layer.routed_load.clone()
    layer.update_expert_bias()
    torch.testing.assert_close(layer.router.expert_bias, 0.1 * torch.sign(load.mean() - load))
    assert layer.routed_load.abs().sum() == 0
    layer.update_expert_bias()  # no tokens since: the bias stays
    torch.testing.assert_close(layer.router.expert_bias, 0.1 * torch.sign(load.mean() - load))
    logits, probs, weights, experts = layer.router(x)
    torch.testing.assert_close(probs, probs_before)  # the scores (and so the gating weights) ignore the bias
    scores = logits.sigmoid()
    chosen = scores.gather(-1, experts)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True))
    assert torch.equal(experts, (scores + layer.router.expert_bias).topk(2).indices)
    assert "router.expert_bias" in layer.state_dict() and "routed_load" not in layer.state_dict()
    assert "router.expert_bias" not in MoE(16, 16, 8, 2).state_dict()  # aux_loss: no buffer, old checkpoints load


def test_bias_balances_a_skewed_router_without_aux_loss_and_resumes_exactly(tmp_path):
    layer = _skewed("bias")
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.05)
    curve = _train(layer, range(200), optimizer)
    assert curve[0] >= 2.5, curve[0]  # skewed at start (measured 2.87)
    assert max(curve[-10:]) <= 1.2, curve[-10:]  # balanced at the end (measured 1.13 at most over the last 10)
    # without the bias, the same training stays skewed
    plain = _skewed("aux_loss")
    plain.aux_loss_coeff = 0.0
    unbalanced = _train(plain, range(200), torch.optim.SGD(plain.parameters(), lr=0.05))
    assert min(unbalanced[-10:]) > 1.5, unbalanced[-10:]
    # resume: 100 steps, save, a fresh layer loads and runs 100 more -> the same bias as 200 uninterrupted steps
    first = _skewed("bias")
    opt = torch.optim.SGD(first.parameters(), lr=0.05)
    _train(first, range(100), opt)
    torch.save({"model": first.state_dict(), "opt": opt.state_dict()}, tmp_path / "moe.pt")
    resumed = _skewed("bias")
    state = torch.load(tmp_path / "moe.pt")
    resumed.load_state_dict(state["model"])
    assert torch.equal(resumed.router.expert_bias, first.router.expert_bias) and first.router.expert_bias.any()
    opt2 = torch.optim.SGD(resumed.parameters(), lr=0.05)
    opt2.load_state_dict(state["opt"])
    _train(resumed, range(100, 200), opt2)
    assert torch.equal(resumed.router.expert_bias, layer.router.expert_bias)


def test_update_expert_bias_stacks_layers_and_skips_those_without_a_bias():
    layers = [_skewed("bias"), _skewed("both"), _skewed("aux_loss")]
    x, _ = _batch(3)
    for m in layers:
        m(x)
    update_expert_bias(layers)
    assert layers[0].router.expert_bias.abs().sum() > 0
    torch.testing.assert_close(layers[0].router.expert_bias, layers[1].router.expert_bias)
    assert layers[2].router.expert_bias is None


# ------------------------------------------------------------------------------------------- dispatch and figures
@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_the_ep_dispatch_reads_the_host_once_and_hands_the_counts_on(monkeypatch, one_rank_group):
    """The dispatch's split sizes and the experts' segment sizes come from one host read per layer; the output is
    the layer's without the dispatch."""
    from lightning_par.expert_parallel.dispatch import ExpertDispatch

    torch.manual_seed(0)
    layer = MoE(16, 32, 8, 2, experts_form="bmm")
    x = torch.randn(2, 12, 16)
    plain = layer(x)
    ExpertDispatch(one_rank_group, 1).attach(layer.experts)
    seen = {}
    layer.experts.register_forward_pre_hook(lambda m, a, k: seen.update(k), with_kwargs=True)
    counter = _HostReads(monkeypatch)
    out = layer(x)
    assert counter.count == 1
    assert seen["host_counts"] == layer.last_stats["tokens_per_expert"].tolist()
    torch.testing.assert_close(out, plain, rtol=1e-6, atol=0)


def test_summary_keeps_each_layers_imbalance_and_the_dropped_total():
    from lightning_par.expert_parallel.metrics import MoEFigures

    torch.manual_seed(0)
    net = torch.nn.Sequential(MoE(16, 16, 4, 2, capacity_factor=0.5), MoE(16, 16, 4, 1))
    figures = MoEFigures(net)
    assert figures.summary() == {}
    steps = []
    for _ in range(2):
        net(torch.randn(2, 8, 16))
        steps.append(figures.step())
    assert {"moe_load_imbalance/0", "moe_load_imbalance/1"} <= set(steps[0])
    assert steps[0]["moe_load_imbalance"] == max(steps[0]["moe_load_imbalance/0"], steps[0]["moe_load_imbalance/1"])
    summary = figures.summary()
    assert summary["moe_steps"] == 2 and summary["moe_dropped_tokens_total"] > 0
    assert summary["moe_dropped_tokens_total"] == sum(s["moe_dropped_tokens"] for s in steps)
    layer0 = summary["moe_load_imbalance_per_layer"]["0"]
    assert layer0["last"] == steps[1]["moe_load_imbalance/0"]
    assert layer0["mean"] == pytest.approx((steps[0]["moe_load_imbalance/0"] + steps[1]["moe_load_imbalance/0"]) / 2)


def test_moe_benchmark_table_states_the_ratios():
    from lightning_par.benchmarks.moe import render

    rows = [{"experts": 64, "tokens": 32, "top_k": 2, "form": "grouped_mm", "grouped_s": 0.05, "bmm_s": 0.12,
             "loop_s": 0.1, "indexed_s": 0.2}]
    table = render(rows, {"dim": 8, "hidden": 16, "tokens": 32, "steps": 2})
    assert "| 64 | 2 | 32 | 1 | grouped_mm | 50.0 | 120.0 | 100.0 | 2.00 | 200.0 | 4.00 |" in table


def test_moe_benchmark_summary_states_where_the_aim_is_reached():
    from lightning_par.benchmarks.moe import summary

    def row(experts, tokens, grouped_s):
        return {"experts": experts, "tokens": tokens, "top_k": 2, "grouped_s": grouped_s, "loop_s": 0.1}

    line = summary([row(64, 128, 0.04), row(64, 4096, 0.08), row(8, 128, 0.01)])
    assert line == ("64 experts, loop / grouped: 2.50 at 4 copies/expert, 1.25 at 128 copies/expert; "
                    "2x reached at 4 copies/expert.")
    assert summary([row(64, 4096, 0.08)]).endswith("2x not reached in this run.")


# ------------------------------------------------------- auxiliary-loss-free balancing of Hugging Face routers
def _hf_skewed(balance: str | None, rate: float = 0.003):
    """A tiny deepseek_v3 (1 MoE layer, 8 experts, top-2, one shared expert) whose router sends most tokens to experts
    0 and 1 at start (as :func:`_skewed`); returns the module and its MoE layer."""
    pytest.importorskip("transformers")
    from lightning_par.hf import HFCausalLM

    torch.manual_seed(0)
    config = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 32, "n_routed_experts": 8,
              "num_experts_per_tok": 2, "moe_intermediate_size": 16, "first_k_dense_replace": 0, "n_group": 1,
              "topk_group": 1, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
              "v_head_dim": 8, "n_shared_experts": 1}
    module = HFCausalLM(model_type="deepseek_v3", config=config, moe_balance=balance, moe_bias_update_rate=rate)
    layer = module.model.model.layers[0].mlp
    with torch.no_grad():
        layer.gate.weight.normal_(0, 0.3)
        layer.gate.weight[:2] += 0.2
    return module, layer


def _hf_train(layer, steps: range, optimizer: torch.optim.Optimizer) -> list[float]:
    """SGD on a regression through the MoE layer alone (no auxiliary loss: transformers adds none without labels);
    after each step the bias update the strategies run. Returns max/mean routed copies per expert of each step."""
    from lightning_par.hf.experts import update_hf_expert_bias

    curve = []
    for step in steps:
        x, target = _batch(step)
        F.mse_loss(layer(x), target).backward()
        _, _, chosen = layer.gate(x)  # the router's choice with the bias of this step
        counts = torch.bincount(chosen.reshape(-1), minlength=8).float()
        curve.append(float(counts.max() / counts.mean()))
        optimizer.step()
        optimizer.zero_grad()
        update_hf_expert_bias([layer.experts])  # a no-op without moe_balance="bias"
    return curve


def test_hf_router_bias_update_is_deepseek_v3s_rule_and_refused_without_a_bias():
    from lightning_par.hf.experts import BIAS_BUFFER

    module, layer = _hf_skewed("bias", rate=0.1)
    x, _ = _batch(0)
    _, weights_before, chosen = layer.gate(x)
    layer(x)
    load = torch.bincount(chosen.reshape(-1), minlength=8).float()
    torch.testing.assert_close(layer.experts.routed_load, load)  # the copies routed by the model's own router
    layer.experts.update_expert_bias()
    torch.testing.assert_close(getattr(layer.gate, BIAS_BUFFER), 0.1 * torch.sign(load.mean() - load))
    assert layer.experts.routed_load.abs().sum() == 0
    layer.experts.update_expert_bias()  # nothing routed since: the bias stays
    torch.testing.assert_close(getattr(layer.gate, BIAS_BUFFER), 0.1 * torch.sign(load.mean() - load))
    layer.eval()
    layer(x)  # evaluation does not count
    assert layer.experts.routed_load.abs().sum() == 0
    state = module.state_dict()
    assert f"model.model.layers.0.mlp.gate.{BIAS_BUFFER}" in state
    assert not any(k.endswith("routed_load") for k in state)
    # without the option the bias is the model's (never moved); a model without a router bias refuses "bias"
    plain, plain_layer = _hf_skewed(None)
    assert getattr(plain_layer.experts, "routed_load", None) is None
    from lightning_par.hf import HFCausalLM

    qwen = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 16}
    with pytest.raises(ValueError, match="moe_balance='bias' is not valid for Qwen3MoeForCausalLM: none of its "
                                         "mixture-of-experts layers has a router with a per-expert "
                                         "e_score_correction_bias"):
        HFCausalLM(model_type="qwen3_moe", config=qwen, moe_balance="bias")
    with pytest.raises(ValueError, match=r"HFCausalLM moe_balance='both' is not valid: expected None or 'bias'"):
        HFCausalLM(model_type="qwen3_moe", config=qwen, moe_balance="both")
    with pytest.raises(ValueError, match=r"HFCausalLM moe_bias_update_rate=0 is not valid: expected a finite number"):
        HFCausalLM(model_type="qwen3_moe", config=qwen, moe_balance="bias", moe_bias_update_rate=0)


def test_hf_router_bias_balances_a_skewed_router_and_resumes_exactly(tmp_path):
    from lightning_par.hf.experts import BIAS_BUFFER

    module, layer = _hf_skewed("bias")
    curve = _hf_train(layer, range(200), torch.optim.SGD(layer.parameters(), lr=0.05))
    assert curve[0] >= 2.5, curve[0]  # skewed at start (measured 2.98)
    assert max(curve[-10:]) <= 1.2, curve[-10:]  # balanced at the end (measured 1.13 at most over the last 10)
    _, plain = _hf_skewed(None)
    unbalanced = _hf_train(plain, range(200), torch.optim.SGD(plain.parameters(), lr=0.05))
    assert min(unbalanced[-10:]) > 1.5, unbalanced[-10:]
    # 100 steps, a save of the module's state (the bias with it), a fresh module loads it and runs 100 more
    first_module, first = _hf_skewed("bias")
    opt = torch.optim.SGD(first.parameters(), lr=0.05)
    _hf_train(first, range(100), opt)
    torch.save({"model": first_module.state_dict(), "opt": opt.state_dict()}, tmp_path / "hf.pt")
    resumed_module, resumed = _hf_skewed("bias")
    state = torch.load(tmp_path / "hf.pt")
    resumed_module.load_state_dict(state["model"])
    assert torch.equal(getattr(resumed.gate, BIAS_BUFFER), getattr(first.gate, BIAS_BUFFER))
    opt2 = torch.optim.SGD(resumed.parameters(), lr=0.05)
    opt2.load_state_dict(state["opt"])
    _hf_train(resumed, range(100, 200), opt2)
    assert torch.equal(getattr(resumed.gate, BIAS_BUFFER), getattr(layer.gate, BIAS_BUFFER))


def test_the_recipe_passes_moe_balance_to_a_hugging_face_model():
    """``model=hf model.moe_balance=bias``: the schema holds the option and the recipe's model gets it."""
    pytest.importorskip("transformers")
    from pathlib import Path

    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from lightning_par.config.schema import register_configs

    register_configs()
    deepseek = {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 1,
                "topk_group": 1, "first_k_dense_replace": 1, "q_lora_rank": 32, "kv_lora_rank": 16,
                "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16}
    overrides = ["model=hf", "model.model_type=deepseek_v3", "model.moe_balance=bias",
                 "model.moe_bias_update_rate=0.01", *(f"+model.config.{k}={v}" for k, v in deepseek.items())]
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[2] / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    module = instantiate(cfg.model)
    experts = module.model.model.layers[1].mlp.experts
    assert module.hparams.moe_balance == "bias" and experts.bias_update_rate == 0.01
    assert experts.routed_load.shape == (4,)


def test_a_compiled_moe_layer_on_cpu_traces_the_loop_and_matches_eager():
    """torch 2.13's fake-tensor rule of ``_grouped_mm`` takes bf16 only, so under ``torch.compile`` the CPU fp32 layer
    traces the loop: it compiles, and matches the eager ``grouped_mm`` form."""
    torch.manual_seed(0)
    layer = MoE(16, 32, 8, 2)
    x = torch.randn(2, 8, 16)
    want = layer(x)
    want.sum().backward()
    grad = layer.experts.w1.grad.clone()
    layer.zero_grad()
    torch._dynamo.reset()
    got = torch.compile(layer, backend="aot_eager")(x)
    got.sum().backward()
    assert _rel(got, want) <= 1e-5 and _rel(layer.experts.w1.grad, grad) <= 1e-5
