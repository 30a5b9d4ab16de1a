"""Unit tests of the GPT model, its config and its Lightning wrapper (single process, CPU, seconds)."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_par.data import ByteCorpusDataModule
from lightning_par.models import GPT, GPT_PRESETS, GPTConfig, GPTLightningModule, lr_lambda


def _tiny(**overrides: object) -> GPTConfig:
    return GPTConfig.from_preset("tiny", **overrides)


@pytest.mark.parametrize("name", sorted(GPT_PRESETS))
@pytest.mark.parametrize("bias", [True, False])
def test_param_count_formula_matches_module(name: str, bias: bool) -> None:
    config = GPTConfig.from_preset(name, bias=bias)
    with torch.device("meta"):
        model = GPT(config)
    assert config.num_params() == model.num_params() == sum(p.numel() for p in model.parameters())
    assert config.num_params(include_embedding=False) == model.num_params(include_embedding=False)
    assert config.num_params() - config.num_params(False) == (config.vocab_size + config.block_size) * config.n_embd


def test_preset_sizes_and_flops() -> None:
    gpt2 = GPTConfig.from_preset("gpt2")
    # 124M in nanoGPT's tied count; the untied lm_head adds vocab * n_embd.
    assert abs(gpt2.num_params() - gpt2.vocab_size * gpt2.n_embd - 124.4e6) < 0.5e6
    n = gpt2.num_params(include_embedding=False)
    assert gpt2.flops_per_token() == 6 * n + 12 * 12 * 768 * 1024
    medium = GPTConfig.from_preset("gpt2-medium")
    assert 350e6 < medium.num_params() - medium.vocab_size * medium.n_embd < 360e6
    assert GPTConfig.from_preset("small") == GPTConfig()


def test_forward_shapes_and_block_size_check() -> None:
    torch.manual_seed(0)
    model = GPT(_tiny())
    logits = model(torch.randint(0, 256, (3, 17)))
    assert logits.shape == (3, 17, 256)
    with pytest.raises(ValueError, match="block_size=32"):
        model(torch.randint(0, 256, (1, 33)))


def test_init_is_deterministic_and_scaled() -> None:
    torch.manual_seed(1)
    a = GPT(_tiny())
    torch.manual_seed(1)
    b = GPT(_tiny())
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    config = GPTConfig(n_layer=8, n_embd=256)
    model = GPT(config)
    std = model.blocks["0"].attn.c_proj.weight.std().item()
    assert std == pytest.approx(0.02 / math.sqrt(2 * config.n_layer), rel=0.05)
    assert torch.all(model.blocks["0"].mlp.c_fc.bias == 0)
    assert model.lm_head is not None and model.wte is not None
    assert model.lm_head.weight.data_ptr() != model.wte.weight.data_ptr()


def test_two_stage_split_matches_whole_model() -> None:
    torch.manual_seed(0)
    whole = GPT(_tiny(n_layer=4)).eval()
    idx = torch.randint(0, 256, (2, 20))
    expected = whole(idx)

    first, second = GPT(_tiny(n_layer=4)).eval(), GPT(_tiny(n_layer=4)).eval()
    first.load_state_dict(whole.state_dict())
    second.load_state_dict(whole.state_dict())
    first.ln_f = None
    first.lm_head = None
    del first.blocks["2"], first.blocks["3"]
    second.wte = None
    second.wpe = None
    del second.blocks["0"], second.blocks["1"]
    assert set(dict(second.named_parameters())) <= set(dict(whole.named_parameters()))
    assert "blocks.3.attn.q_proj.weight" in dict(second.named_parameters())

    hidden = first(idx)
    assert hidden.shape == (2, 20, 32)
    torch.testing.assert_close(second(hidden), expected)
    with pytest.raises(ValueError, match="hidden states"):
        second(idx)


def test_attention_uses_local_head_count() -> None:
    """A column shard of q/k/v (half the heads) plus a row shard of c_proj gives half of the full output."""
    torch.manual_seed(0)
    config = _tiny()
    attn = GPT(config).blocks["0"].attn.eval()
    x = torch.randn(2, 5, config.n_embd)
    full = attn.c_proj(_attn_without_proj(attn, x))
    half = config.n_embd // 2
    partial = torch.zeros_like(full)
    for rank in range(2):
        cols = slice(rank * half, (rank + 1) * half)
        shard = type(attn)(config).eval()
        for proj in ("q_proj", "k_proj", "v_proj"):
            getattr(shard, proj).weight = torch.nn.Parameter(getattr(attn, proj).weight[cols])
            getattr(shard, proj).bias = torch.nn.Parameter(getattr(attn, proj).bias[cols])
        shard.c_proj.weight = torch.nn.Parameter(attn.c_proj.weight[:, cols])
        shard.c_proj.bias = torch.nn.Parameter(attn.c_proj.bias / 2)
        partial = partial + shard(x)
    torch.testing.assert_close(partial, full)


def _attn_without_proj(attn: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    b, t, d = x.shape
    q, k, v = (p(x).view(b, t, -1, attn.head_dim).transpose(1, 2) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_layer": 0}, "n_layer=0"),
        ({"n_embd": 30, "n_head": 4}, "n_embd=30"),
        ({"dropout": 1.0}, "dropout=1.0"),
        ({"vocab_size": 2.5}, "vocab_size=2.5"),
        ({"bias": 1}, "bias=1"),
    ],
)
def test_config_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)


def test_preset_errors() -> None:
    with pytest.raises(ValueError, match="gpt2-medium"):
        GPTConfig.from_preset("huge")
    with pytest.raises(ValueError, match="n_lyer"):
        GPTConfig.from_preset("tiny", n_lyer=3)
    assert GPTConfig.from_preset("tiny", dropout=0.1).dropout == 0.1


def test_lr_schedule() -> None:
    assert lr_lambda(0, 10, 100, 0.1) == pytest.approx(0.1)
    assert lr_lambda(9, 10, 100, 0.1) == pytest.approx(1.0)
    assert lr_lambda(10, 10, 100, 0.1) == pytest.approx(1.0)
    assert lr_lambda(55, 10, 100, 0.1) == pytest.approx(0.55)
    assert lr_lambda(100, 10, 100, 0.1) == pytest.approx(0.1)
    assert lr_lambda(500, 10, 100, 0.1) == pytest.approx(0.1)
    assert lr_lambda(500, 0, None, 0.1) == 1.0
    with pytest.raises(ValueError, match="max_steps=5"):
        GPTLightningModule(_tiny(), warmup_steps=10, max_steps=5)
    with pytest.raises(ValueError, match="learning_rate=0"):
        GPTLightningModule(_tiny(), learning_rate=0)


def test_optimizer_groups_and_hparams_roundtrip() -> None:
    module = GPTLightningModule(_tiny(), warmup_steps=2, max_steps=10)
    opt_conf = module.configure_optimizers()
    decay, no_decay = opt_conf["optimizer"].param_groups
    assert all(p.dim() >= 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert all(p.dim() < 2 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(module.parameters()))
    assert opt_conf["lr_scheduler"]["interval"] == "step"
    assert isinstance(module.hparams["config"], dict)
    rebuilt = GPTLightningModule(**module.hparams)
    assert rebuilt.config == module.config


def test_lightning_module_learns_synthetic_data() -> None:
    torch.manual_seed(0)
    data = ByteCorpusDataModule(synthetic=True, synthetic_tokens=40_000, block_size=32, batch_size=16)
    data.setup("fit")
    module = GPTLightningModule(_tiny(), learning_rate=3e-3)
    optimizer = module.configure_optimizers()["optimizer"]
    batches = iter(data.train_dataloader())
    losses = []
    for step in range(30):
        loss = module.training_step(next(batches), step)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(256), abs=0.3)
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
    x, y = next(iter(data.val_dataloader()))
    with torch.no_grad():
        assert module.loss_fn(module(x), y).item() < losses[0] - 1.0
