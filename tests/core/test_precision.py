"""What each Lightning precision means for the strategies, checked without processes."""

from __future__ import annotations

import re

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision

from lightning_par.parallel_dims import ParallelDims
from lightning_par.precision import check_precision, compute_dtype, distributed_scaler, fsdp_mixed_precision
from lightning_par.strategies import PipelineStrategy, ZeroStrategy
from tests.support.user_models import make_mlp


def test_compute_dtypes_and_the_zero3_policy():
    assert compute_dtype("bf16-mixed") == torch.bfloat16 and compute_dtype("16-mixed") == torch.float16
    assert compute_dtype("bf16-true") == torch.bfloat16 and compute_dtype("32-true") == torch.float32
    assert fsdp_mixed_precision("bf16-mixed") == (torch.bfloat16, torch.float32)
    assert fsdp_mixed_precision("16-mixed") == (torch.float16, torch.float32)
    assert fsdp_mixed_precision("bf16-true") is None and fsdp_mixed_precision("32-true") is None


def _attach(strategy, precision: str | None = None, plugins=()) -> None:
    """Let a Trainer attach its precision plugin to ``strategy`` (no process starts)."""
    kwargs = {"precision": precision} if precision else {}
    L.Trainer(strategy=strategy, accelerator="cpu", devices=2, plugins=list(plugins), logger=False, **kwargs)


def test_zero3_takes_fsdp_mixed_precision_unless_the_user_chose_one():
    strategy = ZeroStrategy(stage=3)
    _attach(strategy, "bf16-mixed")
    zero = strategy.precision_options().zero
    assert (zero.param_dtype, zero.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert strategy.options.zero.param_dtype is None  # the strategy's own options are left as given
    mine = ZeroStrategy(stage=3, mixed_precision={"reduce_dtype": "bf16"})
    _attach(mine, "bf16-mixed")
    assert (mine.precision_options().zero.param_dtype, mine.precision_options().zero.reduce_dtype) == (
        None, torch.bfloat16)
    for stage in (1, 2):  # fp32 parameters are the master weights: nothing to change
        other = ZeroStrategy(stage=stage)
        _attach(other, "bf16-mixed")
        assert other.precision_options() is other.options


def test_pipelining_refuses_fp16_loss_scaling_before_any_process_starts():
    strategy = PipelineStrategy(pp_size=2, schedule="1f1b", num_microbatches=2)
    _attach(strategy, plugins=[MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))])
    strategy.connect(make_mlp())
    with pytest.raises(ValueError, match=re.escape("precision='16-mixed' is not valid with pipelining (pp_size=2)")):
        strategy.validate_model(ParallelDims(world_size=2, pp_size=2))
    check_precision("bf16-mixed", 2)  # bf16 needs no scaling
    check_precision("16-mixed", 1)
    with pytest.raises(ValueError, match="Use precision='bf16-mixed'"):
        check_precision("16-mixed", 4)


def test_the_distributed_scaler_keeps_the_settings():
    scaler = torch.amp.GradScaler("cpu", init_scale=128.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=7)
    new = distributed_scaler(scaler, process_group=object())
    assert type(new).__name__ == "DistributedGradScaler"
    assert (new._init_scale, new.get_growth_factor(), new.get_backoff_factor(), new.get_growth_interval()) == (
        128.0, 4.0, 0.25, 7)
    assert distributed_scaler(new) is new


def test_the_recipe_refuses_fp16_with_pipelining(tmp_path):
    from hydra import compose, initialize_config_dir

    from lightning_par.config.schema import register_configs
    from lightning_par.train import validate_run
    from tests.config.test_compose import CONF

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=["model=tiny", "parallel=pp2", "strategy=1f1b",
                                                       "trainer.precision=16-mixed"])
    with pytest.raises(ValueError, match="not valid with pipelining"):
        validate_run(cfg)


def test_the_single_gpu_benchmark_harness_runs_and_says_when_nothing_was_measured():
    from lightning_par.benchmarks import single_gpu

    r = single_gpu.measure("tiny", False, "cpu", batch=2, steps=2, warmup=1)
    assert r["tokens_per_s"] == pytest.approx(2 * 32 * 2 / (2 * r["step_s"]))
    assert r["mfu"] is None and r["peak_mem_bytes"] is None and r["params"] > 0 and r["loss"] > 0
    if not torch.cuda.is_available():
        assert single_gpu.run(quick=True).startswith("Single GPU: not measured (no CUDA device")
