"""``strategy.float8``: its options, and every refusal before training starts (no process group)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_par.float8 import Float8Options, check_float8_device, check_float8_run, float8_available, float8_modules
from lightning_par.models import GPT, GPTConfig, GPTLightningModule
from lightning_par.parallel_dims import ParallelDims
from lightning_par.parallelize import ParallelOptions, validate

TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=256)


def _gpt(**overrides) -> GPTLightningModule:
    return GPTLightningModule(GPTConfig(**{**TINY, **overrides}))


def _validate(module, world: int = 1, dp_mode: str = "ddp", **sizes_and_float8) -> None:
    f8 = sizes_and_float8.pop("float8")
    dims = ParallelDims(world_size=world, **sizes_and_float8)
    validate(module, dims, ParallelOptions.build(dp_mode, float8=f8))


def test_torchao_is_installed_with_the_dev_extra():
    # the dev extra carries torchao, so CI runs every float8 test; without it, float8 is refused (below)
    assert float8_available()


def test_options_defaults_and_all_gather_rule():
    f8 = Float8Options(enabled=True)
    assert f8.recipe == "tensorwise" and f8.include == ("*",) and f8.exclude == ("lm_head", "output")
    assert f8.all_gather("zero3") and not f8.all_gather("zero2") and not f8.all_gather("ddp")
    assert not Float8Options(enabled=True, recipe="rowwise").all_gather("zero3")
    assert Float8Options(include=["blocks.*"]).include == ("blocks.*",)  # a list from a config becomes a tuple


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"recipe": "delayed"}, r"float8.recipe='delayed'.*tensorwise.*rowwise"),
        ({"enabled": "yes"}, r"float8.enabled"),
        ({"include": [3]}, r"float8.include=\[3\].*module path patterns"),
        ({"fsdp_all_gather": "on"}, r"float8.fsdp_all_gather"),
    ],
)
def test_invalid_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Float8Options(**kwargs)


def test_unknown_option_is_named():
    with pytest.raises(ValueError, match=r"float8.scaling is not a valid option.*recipe"):
        ParallelOptions.build(float8={"scaling": "tensorwise"})


def test_selection_by_path_patterns():
    gpt = GPT(GPTConfig(**TINY))
    every = float8_modules(gpt, Float8Options(enabled=True))
    assert len(every) == 12 and "lm_head" not in every  # q, k, v, c_proj, c_fc, mlp.c_proj per block
    mlp = float8_modules(gpt, Float8Options(enabled=True, include=["blocks.*.mlp.*"]))
    assert sorted(mlp) == ["blocks.0.mlp.c_fc", "blocks.0.mlp.c_proj", "blocks.1.mlp.c_fc", "blocks.1.mlp.c_proj"]
    no_attn_out = float8_modules(gpt, Float8Options(enabled=True, exclude=["lm_head", "*.attn.c_proj"]))
    assert len(no_attn_out) == 10
    assert "lm_head" in float8_modules(gpt, Float8Options(enabled=True, exclude=[]))


@pytest.mark.parametrize(
    ("sizes", "dp_mode", "float8", "match"),
    [
        ({"world": 2, "tp_size": 2}, "ddp", {"recipe": "rowwise"},
         r"float8.recipe='rowwise' is not valid with tp_size=2: .*tensorwise scaling only"),
        ({"world": 2}, "ddp", {"fsdp_all_gather": True},
         r"float8.fsdp_all_gather=True is not valid with dp_mode='ddp': only zero3"),
        ({"world": 2}, "zero2", {"fsdp_all_gather": True}, r"dp_mode='zero2'"),
        ({"world": 2}, "zero3", {"fsdp_all_gather": True, "recipe": "rowwise"},
         r"float8.fsdp_all_gather=True is not valid with float8.recipe='rowwise'"),
        ({"world": 2, "pp_size": 2}, "ddp", {}, r"float8.enabled=True is not valid with pp_size=2"),
        ({"world": 2, "cp_size": 2}, "ddp", {}, r"float8.enabled=True is not valid with cp_size=2"),
        ({"world": 1}, "ddp", {"include": ["nothing.*"]}, r"selects no nn.Linear layer of GPT"),
        ({"world": 2, "tp_size": 2}, "ddp", {"exclude": []},
         r"float8 layer 'lm_head' is not valid with tp_size=2: its plan style 'vocab_head' has no float8 form.*"
         r"Add 'lm_head' to float8.exclude"),
    ],
)
def test_refused_before_start(sizes, dp_mode, float8, match):
    world = sizes.pop("world")
    with pytest.raises(ValueError, match=match):
        _validate(_gpt(), world, dp_mode, float8={"enabled": True, **float8}, **sizes)


def test_layer_width_not_a_multiple_of_16_is_refused():
    with pytest.raises(ValueError, match=r"float8 layer 'blocks.0.attn.q_proj' is not valid: .*in_features=24.*"
                                         r"multiple of 16.*float8.exclude"):
        _validate(_gpt(n_embd=24), float8={"enabled": True})


def test_fsdp_all_gather_without_float8_is_refused():
    with pytest.raises(ValueError, match=r"float8.fsdp_all_gather=True is not valid with float8.enabled=False"):
        _validate(_gpt(), float8={"fsdp_all_gather": True})


def test_the_valid_layouts_pass():
    _validate(_gpt(), 1, "ddp", float8={"enabled": True})
    _validate(_gpt(), 2, "zero3", float8={"enabled": True})
    _validate(_gpt(), 2, "ddp", tp_size=2, float8={"enabled": True})
    _validate(_gpt(), 2, "zero1", float8={"enabled": True, "recipe": "rowwise"})
    _validate(_gpt(), 4, "zero3", dp_replicate_size=2, float8={"enabled": True})


def test_devices_without_float8_matrix_units_are_refused(monkeypatch):
    check_float8_device(torch.device("cpu"))
    with pytest.raises(ValueError, match=r"float8.enabled=True is not valid on device 'meta'"):
        check_float8_device(torch.device("meta"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"NVIDIA A100-SXM4-80GB \(compute capability 8.0\).*8.9 or later"):
        check_float8_device(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_float8_device(torch.device("cuda", 0))


def test_strategy_and_recipe_config_take_the_group():
    from hydra import compose, initialize_config_dir

    from lightning_par.config.build import build_strategy
    from lightning_par.config.schema import register_configs
    from lightning_par.strategies import ZeroStrategy
    from tests.config.test_option_defaults import CONF

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=[
            "strategy=zero3", "strategy.float8.enabled=true", "strategy.float8.exclude=[lm_head,'*.attn.*']",
        ])
        strategy = build_strategy(cfg)
        assert strategy.options.float8 == Float8Options(enabled=True, exclude=("lm_head", "*.attn.*"))
        bad = compose(config_name="config", overrides=["strategy=zero3", "strategy.float8.recipe=delayed"])
        with pytest.raises(ValueError, match="float8.recipe='delayed'"):
            build_strategy(bad)
    assert ZeroStrategy(stage=3, float8={"enabled": True}).options.float8.enabled


def test_a_plain_network_selects_its_linear_layers():
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    assert sorted(float8_modules(net, Float8Options(enabled=True))) == ["0", "2"]


def test_sequence_parallel_on_the_cpu_is_refused():
    with pytest.raises(ValueError, match=r"sequence_parallel=True on the CPU \(tp_size=2\).*gloo cannot send"):
        check_float8_run(torch.device("cpu"), 2, True)
    check_float8_run(torch.device("cpu"), 2, False)
    check_float8_run(torch.device("cpu"), 1, True)


@pytest.mark.slow
def test_float8_loss_curve_stays_with_bf16_quick():
    """The benchmark section's quick run (40 steps of GPT small on the byte corpus, bf16-mixed, one process): float8
    ends within 3% of bf16's validation loss (the 300-step figures are in docs/float8.md)."""
    from lightning_par.benchmarks.float8 import train

    bf16 = train(False, 40, 16, 4)
    f8 = train(True, 40, 16, 4)
    assert f8["float8_layers"] == 24 and bf16["float8_layers"] == 0
    assert bf16["losses"][-1] < bf16["losses"][0] - 1.0  # it learns
    assert abs(f8["val_loss"] / bf16["val_loss"] - 1) < 0.03, (f8["val_loss"], bf16["val_loss"])
