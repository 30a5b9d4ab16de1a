"""Activation checkpointing through every strategy, every pipeline schedule and 3D, against one process.

Each case trains ``STEPS`` steps under a strategy with ``activation_checkpointing`` ``"full"`` or ``"selective"`` and
must match a one-process run without it on the same global batches (recomputation changes when activations exist,
not their values): losses within ``rtol=1e-5``, gathered parameters within ``assert_params_close``. Models: the
reference GPT (AdamW; selective checkpoints its attention) and a user's ``nn.Sequential`` MLP (SGD with momentum, and
AdamW; full checkpoints its children). One launch per world size.
"""

from __future__ import annotations

import pytest
import torch

from lightning_par.pipeline_parallel.options import SCHEDULES
from tests.helpers import assert_params_close, global_losses
from tests.p3d_helpers import make_gpt, run_plan, token_data
from tests.pp_helpers import RegressionDataset, one_thread, reference_fit_microbatched
from tests.user_models import make_mlp

pytestmark = pytest.mark.distributed

STEPS, MICRO = 2, 8


def _case(strategy: str, model: str, ac: str, **options) -> tuple[str, str, dict]:
    return strategy, model, {"activation_checkpointing": ac, **options}


def _m(schedule: str) -> int:
    return 4


#: name: (registry name, model, strategy options)
WORLD2 = {
    "ddp_overlap-gpt-full": _case("ddp_overlap", "gpt", "full"),
    "ddp_overlap-gpt-selective": _case("ddp_overlap", "gpt", "selective"),
    "ddp_overlap-mlp-sgd-full": _case("ddp_overlap", "mlp-sgd", "full"),
    "zero1-gpt-selective": _case("zero1", "gpt", "selective"),
    "zero1-mlp-sgd-full": _case("zero1", "mlp-sgd", "full"),
    "zero2-gpt-full": _case("zero2", "gpt", "full"),
    "zero2-mlp-adamw-full": _case("zero2", "mlp-adamw", "full"),
    "zero3-gpt-full": _case("zero3", "gpt", "full"),
    "zero3-gpt-selective": _case("zero3", "gpt", "selective"),
    "zero3-mlp-sgd-full": _case("zero3", "mlp-sgd", "full"),
    "tp2-gpt-full-sp": _case("tensor_parallel", "gpt", "full", tp_size=2, dp_size=1, sequence_parallel=True),
    "tp2-gpt-selective": _case("tensor_parallel", "gpt", "selective", tp_size=2, dp_size=1),
    "tp2-mlp-sgd-full": _case("tensor_parallel", "mlp-sgd", "full", tp_size=2, dp_size=1),
    **{f"pp2-{s}-mlp-sgd-full": _case("pipeline", "mlp-sgd", "full", pp_size=2, dp_size=1, schedule=s,
                                      num_microbatches=4) for s in SCHEDULES},
    "pp2-1f1b-gpt-selective": _case("pipeline", "gpt", "selective", pp_size=2, dp_size=1, schedule="1f1b",
                                    num_microbatches=4),
    "pp2-zbv_zero_bubble-gpt-full": _case("pipeline", "gpt", "full", pp_size=2, dp_size=1,
                                          schedule="zbv_zero_bubble", num_microbatches=4),
}
_3D = dict(dp_size=2, tp_size=2, pp_size=2, num_microbatches=4)
WORLD8 = {
    "3d-zero1-1f1b-mlp-sgd-full": _case("parallel_3d", "mlp-sgd", "full", dp_mode="zero1", schedule="1f1b", **_3D),
    "3d-zero3-1f1b-mlp-adamw-full": _case("parallel_3d", "mlp-adamw", "full", dp_mode="zero3", schedule="1f1b", **_3D),
    "3d-ddp-zbv-gpt-selective-sp": _case("parallel_3d", "gpt", "selective", dp_mode="ddp", schedule="zbv_zero_bubble",
                                         sequence_parallel=True, **_3D),
    "3d-zero2-interleaved-gpt-full-sp": _case("parallel_3d", "gpt", "full", dp_mode="zero2",
                                              schedule="interleaved_1f1b", sequence_parallel=True, **_3D),
}


def _dp(options: dict, world: int) -> int:
    dp = options.get("dp_size", -1)
    return dp if dp != -1 else world // (options.get("tp_size", 1) * options.get("pp_size", 1))


def _launch(world: int, cases: dict) -> dict:
    plan = [{"kind": "fit", "name": name, "strategy": strategy, "model": model, "options": options, "steps": STEPS,
             "micro_batch": MICRO} for name, (strategy, model, options) in cases.items()]
    samples = MICRO * max(_dp(o, world) for _, _, o in cases.values()) * STEPS
    return run_plan(world, plan, token_data(samples), token_data(16, seed=1), timeout_s=900), samples


@pytest.fixture(scope="module")
def world2() -> tuple[dict, int]:
    return _launch(2, WORLD2)


@pytest.fixture(scope="module")
def world8() -> tuple[dict, int]:
    return _launch(8, WORLD8)


def _factory(model: str):
    if model.startswith("gpt"):
        return make_gpt
    return lambda: make_mlp(optimizer=model.rsplit("-", 1)[1])


def _checkpointed(model: str, options: dict) -> int:
    """Modules each rank checkpoints: the GPT's 4 blocks (or their attention), the MLP's 5 children; split over the
    pipeline stages (the MLP's 5 children as 3 + 2 by parameter count)."""
    pp = options.get("pp_size", 1)
    if model.startswith("gpt"):
        return 4 // pp
    return 5 if pp == 1 else -1  # uneven: checked per rank below


def _check(runs: list[dict], model: str, options: dict, world: int, samples: int) -> None:
    counts = [r["extras"]["activation_checkpointed_modules"] for r in runs]
    expected = _checkpointed(model, options)
    assert all(c == expected for c in counts) if expected > 0 else (min(counts) > 0 and max(counts) < 5), counts
    assert all(r["extras"]["activation_checkpointing"] == options["activation_checkpointing"] for r in runs)
    dataset = token_data(samples) if model.startswith("gpt") else RegressionDataset(n=samples)
    m = options.get("num_microbatches", 1) if options.get("pp_size", 1) > 1 else 1
    with one_thread():
        ref_losses, ref_params = reference_fit_microbatched(_factory(model), dataset, MICRO, STEPS, m,
                                                            _dp(options, world))
    torch.testing.assert_close(torch.tensor(global_losses(runs)), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for r in runs:
        assert_params_close(r["state"], ref_params)


@pytest.mark.parametrize("name", list(WORLD2))
def test_activation_checkpointing_every_strategy_and_schedule(world2, name):
    out, samples = world2
    _, model, options = WORLD2[name]
    _check(out[name], model, options, 2, samples)


@pytest.mark.parametrize("name", list(WORLD8))
def test_activation_checkpointing_at_dp2_tp2_pp2(world8, name):
    out, samples = world8
    _, model, options = WORLD8[name]
    _check(out[name], model, options, 8, samples)
