"""Option and layout validation of ``Parallel3DStrategy``, before any process group (nothing distributed mocked)."""

from __future__ import annotations

import pytest
from lightning.pytorch.strategies import StrategyRegistry

from lightning_par.models import GPTConfig, GPTLightningModule
from lightning_par.parallel_dims import ParallelDims
from lightning_par.strategies.parallel_3d import Parallel3DStrategy


def _strategy_with_module(n_layer: int = 4, n_head: int = 2, **options) -> Parallel3DStrategy:
    strategy = Parallel3DStrategy(**options)
    config = GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=32, block_size=16, vocab_size=256, dropout=0.0)
    strategy._lightning_module = GPTLightningModule(config)
    return strategy


def test_unknown_dp_mode() -> None:
    with pytest.raises(ValueError, match=r"dp_mode='zero4' is not valid: expected one of \['ddp', 'zero1'"):
        Parallel3DStrategy(dp_mode="zero4")


def test_zero_bubble_schedules_with_resharding_zero3_are_refused() -> None:
    # Measured with torch 2.13 at pp 2 x dp 2: the zero-bubble schedules crash (or, dualpipev, train with wrong
    # gradients) when FSDP2 reshards after forward; interleaved 1F1B on torch's engine is exact.
    for schedule in ("interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"):
        with pytest.raises(ValueError, match=rf"schedule='{schedule}' with dp_mode='zero3' and reshard_after_forward"):
            Parallel3DStrategy(pp_size=2, schedule=schedule, dp_mode="zero3", num_microbatches=4)
        # Without resharding, or with another dp mode, the combination is accepted.
        Parallel3DStrategy(pp_size=2, schedule=schedule, dp_mode="zero3", reshard_after_forward=False, num_microbatches=4)
        Parallel3DStrategy(pp_size=2, schedule=schedule, dp_mode="zero2", num_microbatches=4)
    Parallel3DStrategy(pp_size=2, schedule="interleaved_1f1b", dp_mode="zero3", num_microbatches=4)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"tp_size": 0}, r"tp_size=0 is not valid"),
        ({"pp_size": 0}, r"pp_size=0 is not valid"),
        ({"schedule": "zigzag"}, r"schedule='zigzag' is not valid"),
        ({"pp_size": 2, "schedule": "interleaved_1f1b", "num_microbatches": 5}, r"num_microbatches=5 is not valid"),
        ({"pp_size": 4, "schedule": "1f1b", "num_microbatches": 2}, r"num_microbatches=2 is not valid"),
        ({"pp_size": 2, "schedule": "dualpipev", "num_microbatches": 2}, r"num_microbatches=2 is not valid"),
        ({"sequence_parallel": "yes"}, r"sequence_parallel='yes' is not valid"),
        ({"dp_mode": "ddp", "mixed_precision": "bf16"}, r"zero options \['mixed_precision'\] are not valid with dp_mode='ddp'"),
        ({"dp_mode": "zero2", "mixed_precision": "int3"}, r"mixed_precision"),
        ({"split": "random"}, r"split='random' is not valid"),
    ],
)
def test_invalid_options(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Parallel3DStrategy(**options)


def test_layout_must_match_world_size() -> None:
    strategy = Parallel3DStrategy(dp_size=2, tp_size=2, pp_size=2)
    assert strategy.resolve_parallel_dims(8).shape == (2, 1, 2, 1, 2)
    assert Parallel3DStrategy(dp_size=-1, tp_size=2, pp_size=2).resolve_parallel_dims(16).dp_size == 4
    with pytest.raises(ValueError, match=r"dp_size \* tp_size \* pp_size = 2 \* 2 \* 2 = 8 does not equal world_size=4"):
        strategy.resolve_parallel_dims(4)


def test_tp_checks_run_in_validate_model() -> None:
    strategy = _strategy_with_module(n_head=1, tp_size=2, pp_size=1)
    with pytest.raises(ValueError, match=r"n_head=1 is not divisible by tp_size=2"):
        strategy.validate_model(ParallelDims(dp_size=1, tp_size=2, pp_size=1, world_size=2))


def test_pp_checks_run_in_validate_model() -> None:
    strategy = _strategy_with_module(n_layer=2, pp_size=2, schedule="interleaved_1f1b", num_microbatches=2,
                                     dp_mode="ddp")
    with pytest.raises(ValueError, match=r"layers"):
        strategy.validate_model(ParallelDims(dp_size=1, tp_size=1, pp_size=2, world_size=2))


def test_plan_must_fit_the_model() -> None:
    strategy = _strategy_with_module(tp_size=2, plan={"blocks.*.nothing": "colwise"})
    with pytest.raises(ValueError, match=r"nothing"):
        strategy.validate_model(ParallelDims(dp_size=1, tp_size=2, pp_size=1, world_size=2))


def test_registered_name_and_config_build() -> None:
    from omegaconf import OmegaConf

    from lightning_par.config.build import build_strategy

    Parallel3DStrategy.register_strategies(StrategyRegistry)
    assert "parallel_3d" in StrategyRegistry
    cfg = OmegaConf.create(
        {
            "parallel": {"dp_size": -1, "tp_size": 2, "pp_size": 2, "world_size": 8},
            "strategy": {"name": "parallel_3d", "dp_mode": "zero2", "tensor_parallel": {"sequence_parallel": True},
                         "pipeline": {"num_microbatches": 2}},
        }
    )
    from unittest import mock

    with mock.patch("lightning_par.config.build.strategy_classes", return_value={"parallel_3d": Parallel3DStrategy}):
        strategy = build_strategy(cfg)
    assert isinstance(strategy, Parallel3DStrategy)
    assert strategy.dp_mode == "zero2" and strategy._sizes == {"dp_size": 2, "tp_size": 2, "pp_size": 2}
