"""Activation checkpointing and mixed precision through every strategy, pipeline schedule and 3D, against one process.

Each case trains ``STEPS`` steps under a strategy and must match one process run in the *same precision* on the same
global batches (:func:`tests.support.precision.reference_fit_precision`: each dp replica's batch, micro-batch by
micro-batch, under the precision's autocast, gradients averaged as the all-reduce does). Models: the reference GPT
(AdamW) and a user's ``nn.Sequential`` MLP (SGD with momentum, and AdamW). One launch per world size.

Tolerances (``_TOL``):

* ``"exact"`` — where the run does the reference's arithmetic operation for operation: every dp mode and the
  pipeline, in fp32, under bf16/fp16 autocast with fp32 parameters, in bf16-true; and ``zero3`` under ``-mixed``
  against a reference that, as FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, computes with a
  bf16 copy of the parameters and averages fp32 gradients. Activation checkpointing recomputes the same values. Losses
  within ``rtol=1e-5``, parameters within :func:`tests.support.helpers.assert_params_close` (the fp32 parity of the project).
* ``"half"`` — with tensor parallelism in half precision: a row-parallel layer's output is the sum of the ranks'
  partial products, each rounded to bf16 (8 significant bits, unit roundoff ``u = 2**-8``) before the all-reduce adds
  them, where one process rounds the whole sum once; that is one more rounding (at most ``u`` relative) per layer
  output, and those differences then flow through the rest of the step. Losses within ``rtol = u = 2**-8`` (measured:
  at most 6e-4 for bf16, 9e-5 for fp16, over 3 steps); parameters by their update from the initial values,
  ``||(p - p0) - (p_ref - p0)|| / ||p_ref - p0|| <= 2**-4`` over the whole model (measured: 0.4% with SGD, up to 4.3%
  with AdamW, whose per-entry normalisation turns rounding noise in near-zero gradient entries into full-size
  updates of either sign). A gradient summed instead of averaged, or not reduced at all, moves the SGD update by
  50-100%.
"""

from __future__ import annotations

import pytest
import torch

from lightning_par.pipeline_parallel.options import SCHEDULES
from lightning_par.precision import MIXED_PRECISIONS
from tests.support.helpers import assert_params_close, ci_params, global_losses, running
from tests.support.p3d import make_gpt, run_plan, token_data
from tests.support.pipeline import RegressionDataset, one_thread
from tests.support.precision import reference_fit_precision
from tests.support.user_models import make_mlp

pytestmark = pytest.mark.distributed

STEPS, MICRO = 2, 8
HALF_LOSS_RTOL = 2.0**-8
HALF_UPDATE_RTOL = 2.0**-4


def _case(strategy: str, model: str, precision: str = "32-true", ac: str = "none", **options) -> tuple:
    if ac != "none":
        options["activation_checkpointing"] = ac
    tp = options.get("tp_size", 1) > 1
    tol = "half" if tp and precision != "32-true" else "exact"
    return strategy, model, precision, options, tol


_TP2 = dict(tp_size=2, dp_size=1)
_PP2 = dict(pp_size=2, dp_size=1, num_microbatches=4)
_CP2 = dict(cp_size=2, dp_size=1)
_3D = dict(dp_size=2, tp_size=2, pp_size=2, num_microbatches=4)

#: name: (registry name, model, precision, strategy options, tolerance)
WORLD2 = {
    # activation checkpointing, fp32: every strategy, every schedule
    "ac-ddp_overlap-gpt-full": _case("ddp_overlap", "gpt", ac="full"),
    "ac-ddp_overlap-gpt-selective": _case("ddp_overlap", "gpt", ac="selective"),
    "ac-ddp_overlap-mlp-sgd-full": _case("ddp_overlap", "mlp-sgd", ac="full"),
    "ac-zero1-gpt-selective": _case("zero1", "gpt", ac="selective"),
    "ac-zero1-mlp-sgd-full": _case("zero1", "mlp-sgd", ac="full"),
    "ac-zero2-gpt-full": _case("zero2", "gpt", ac="full"),
    "ac-zero2-mlp-adamw-full": _case("zero2", "mlp-adamw", ac="full"),
    "ac-zero3-gpt-full": _case("zero3", "gpt", ac="full"),
    "ac-zero3-gpt-selective": _case("zero3", "gpt", ac="selective"),
    "ac-zero3-mlp-sgd-full": _case("zero3", "mlp-sgd", ac="full"),
    "ac-tp2-gpt-full-sp": _case("tensor_parallel", "gpt", ac="full", sequence_parallel=True, **_TP2),
    "ac-tp2-gpt-selective": _case("tensor_parallel", "gpt", ac="selective", **_TP2),
    "ac-tp2-mlp-sgd-full": _case("tensor_parallel", "mlp-sgd", ac="full", **_TP2),
    **{f"ac-pp2-{s}-mlp-sgd-full": _case("pipeline", "mlp-sgd", ac="full", schedule=s, **_PP2) for s in SCHEDULES},
    "ac-pp2-1f1b-gpt-selective": _case("pipeline", "gpt", ac="selective", schedule="1f1b", **_PP2),
    "ac-pp2-zbv_zero_bubble-gpt-full": _case("pipeline", "gpt", ac="full", schedule="zbv_zero_bubble", **_PP2),
    # cp: the recomputation attends over the cp ranks as the forward did
    "ac-cp2-ring-gpt-full": _case("parallel_3d", "gpt", ac="full", **_CP2),
    "ac-cp2-all_to_all-gpt-selective": _case("parallel_3d", "gpt", ac="selective", method="all_to_all", **_CP2),
    # bf16-mixed: every strategy
    **{f"bf16-{s}-{m}": _case(s, m, "bf16-mixed") for s in ("ddp_overlap", "zero1", "zero2", "zero3")
       for m in ("gpt", "mlp-sgd")},
    "bf16-tp2-gpt-sp": _case("tensor_parallel", "gpt", "bf16-mixed", sequence_parallel=True, **_TP2),
    "bf16-tp2-mlp-sgd": _case("tensor_parallel", "mlp-sgd", "bf16-mixed", **_TP2),
    "bf16-gpipe-gpt": _case("gpipe", "gpt", "bf16-mixed", **_PP2),
    "bf16-1f1b-mlp-sgd": _case("1f1b", "mlp-sgd", "bf16-mixed", **_PP2),
    "bf16-zbv_zero_bubble-mlp-adamw": _case("pipeline", "mlp-adamw", "bf16-mixed", schedule="zbv_zero_bubble", **_PP2),
    "bf16-zero3-gpt-full": _case("zero3", "gpt", "bf16-mixed", ac="full"),
    # bf16-true: parameters, gradients, optimizer state and pipeline sends in bf16
    "bf16true-ddp_overlap-gpt": _case("ddp_overlap", "gpt", "bf16-true"),
    "bf16true-zero3-mlp-sgd": _case("zero3", "mlp-sgd", "bf16-true"),
    "bf16true-tp2-mlp-sgd": _case("tensor_parallel", "mlp-sgd", "bf16-true", **_TP2),
    "bf16true-1f1b-mlp-sgd": _case("1f1b", "mlp-sgd", "bf16-true", **_PP2),
    # fp16 autocast with loss scaling (the plugin given explicitly: Lightning turns 16-mixed into bf16 on CPU)
    "fp16-ddp_overlap-mlp-sgd": _case("ddp_overlap", "mlp-sgd", "16-mixed"),
    "fp16-zero2-gpt": _case("zero2", "gpt", "16-mixed"),
    "fp16-zero3-mlp-sgd": _case("zero3", "mlp-sgd", "16-mixed"),
    "fp16-tp2-gpt": _case("tensor_parallel", "gpt", "16-mixed", **_TP2),
}
WORLD8 = {
    "ac-3d-zero1-1f1b-mlp-sgd-full": _case("parallel_3d", "mlp-sgd", ac="full", dp_mode="zero1", schedule="1f1b", **_3D),
    "ac-3d-zero3-1f1b-mlp-adamw-full": _case("parallel_3d", "mlp-adamw", ac="full", dp_mode="zero3", schedule="1f1b",
                                             **_3D),
    "ac-3d-ddp-zbv-gpt-selective-sp": _case("parallel_3d", "gpt", ac="selective", dp_mode="ddp",
                                            schedule="zbv_zero_bubble", sequence_parallel=True, **_3D),
    "ac-3d-zero2-interleaved-gpt-full-sp": _case("parallel_3d", "gpt", ac="full", dp_mode="zero2",
                                                 schedule="interleaved_1f1b", sequence_parallel=True, **_3D),
    "bf16-3d-zero1-1f1b-mlp-sgd": _case("parallel_3d", "mlp-sgd", "bf16-mixed", dp_mode="zero1", schedule="1f1b",
                                        **_3D),
    "bf16-3d-zero2-zbv-mlp-adamw": _case("parallel_3d", "mlp-adamw", "bf16-mixed", dp_mode="zero2",
                                         schedule="zbv_zero_bubble", **_3D),
    "bf16-3d-zero3-1f1b-gpt-sp": _case("parallel_3d", "gpt", "bf16-mixed", dp_mode="zero3", schedule="1f1b",
                                       sequence_parallel=True, **_3D),
    "bf16-3d-ddp-interleaved-gpt-selective": _case("parallel_3d", "gpt", "bf16-mixed", ac="selective", dp_mode="ddp",
                                                   schedule="interleaved_1f1b", **_3D),
}


def _dp(options: dict, world: int) -> int:
    dp = options.get("dp_size", -1)
    return dp if dp != -1 else world // (options.get("tp_size", 1) * options.get("pp_size", 1))


#: The cells CI runs (the rest are ``slow``): every strategy and schedule family once under activation checkpointing
#: (full and selective alternating), every strategy once under bf16-mixed, three under bf16-true and fp16 each; at
#: dp2·tp2·pp2 one activation-checkpointing and one bf16 cell, both with sequence parallelism.
CI_WORLD2 = [
    "ac-ddp_overlap-gpt-full", "ac-zero1-gpt-selective", "ac-zero2-mlp-adamw-full", "ac-zero3-gpt-selective",
    "ac-tp2-mlp-sgd-full", "ac-pp2-zbv_zero_bubble-gpt-full", "ac-pp2-1f1b-gpt-selective", "ac-cp2-ring-gpt-full",
    "bf16-ddp_overlap-mlp-sgd", "bf16-zero1-gpt", "bf16-zero2-mlp-sgd", "bf16-zero3-gpt", "bf16-tp2-gpt-sp",
    "bf16-1f1b-mlp-sgd", "bf16-zbv_zero_bubble-mlp-adamw",
    "bf16true-zero3-mlp-sgd", "bf16true-tp2-mlp-sgd", "bf16true-1f1b-mlp-sgd",
    "fp16-ddp_overlap-mlp-sgd", "fp16-zero3-mlp-sgd", "fp16-tp2-gpt",
]
CI_WORLD8 = ["ac-3d-ddp-zbv-gpt-selective-sp", "bf16-3d-zero3-1f1b-gpt-sp"]


def _launch(request: pytest.FixtureRequest, world: int, cases: dict) -> tuple[dict, int]:
    wanted = running(request)  # a deselected (slow) cell is not trained
    plan = [{"kind": "fit", "name": name, "strategy": strategy, "model": model, "options": options, "steps": STEPS,
             "micro_batch": MICRO, "precision": precision}
            for name, (strategy, model, precision, options, _) in cases.items() if name in wanted]
    samples = MICRO * max(_dp(c[3], world) for c in cases.values()) * STEPS
    # measured on an idle 2-core machine: about 8 s a run at world 2, 15 s at world 8; the timeout leaves 3x
    return run_plan(world, plan, token_data(samples), token_data(16, seed=1),
                    timeout_s=max(300, (25 if world <= 2 else 45) * len(plan))), samples


@pytest.fixture(scope="module")
def world2(request: pytest.FixtureRequest) -> tuple[dict, int]:
    return _launch(request, 2, WORLD2)


@pytest.fixture(scope="module")
def world8(request: pytest.FixtureRequest) -> tuple[dict, int]:
    return _launch(request, 8, WORLD8)


def _factory(model: str):
    if model.startswith("gpt"):
        return make_gpt
    return lambda: make_mlp(optimizer=model.rsplit("-", 1)[1])


def _zero3(strategy: str, options: dict) -> bool:
    return strategy == "zero3" or options.get("dp_mode") == "zero3"


def _check_extras(runs: list[dict], strategy: str, model: str, precision: str, options: dict) -> None:
    ac = options.get("activation_checkpointing", "none")
    pp = options.get("pp_size", 1)
    for r in runs:
        extras = r["extras"]
        assert extras["precision"] == precision and extras["activation_checkpointing"] == ac
        count = extras["activation_checkpointed_modules"]
        if ac == "none":
            assert count == 0
        elif model.startswith("gpt"):
            assert count == 4 // pp  # the GPT's 4 blocks (or their attention), split over the stages
        else:
            assert 0 < count <= 5  # the MLP's 5 children, split unevenly by parameter count
        wants_fp32_state = precision != "bf16-true"
        assert r["optimizer_state_dtypes"] == (["torch.float32"] if wants_fp32_state else ["torch.bfloat16"])
        if _zero3(strategy, options) and precision in MIXED_PRECISIONS:
            assert extras["zero_param_dtype"] == str(MIXED_PRECISIONS[precision])
            assert extras["zero_reduce_dtype"] == "torch.float32"
    if pp > 1 and (precision == "bf16-true" or (_zero3(strategy, options) and precision == "bf16-mixed")):
        sent = [d for r in runs for d in r["extras"]["pp_sent_dtypes"]]
        assert sent and set(sent) == {"torch.bfloat16"}  # the stages send bf16 activations


def _check(runs: list[dict], case: tuple, world: int, samples: int) -> None:
    strategy, model, precision, options, tol = case
    _check_extras(runs, strategy, model, precision, options)
    dataset = token_data(samples) if model.startswith("gpt") else RegressionDataset(n=samples)
    m = options.get("num_microbatches", 1) if options.get("pp_size", 1) > 1 else 1
    compute = MIXED_PRECISIONS.get(precision) if _zero3(strategy, options) else None
    with one_thread():
        ref_losses, ref_params, initial = reference_fit_precision(
            _factory(model), dataset, MICRO, STEPS, m, _dp(options, world), precision, compute
        )
    losses = torch.tensor(global_losses(runs), dtype=torch.float64)
    expected = torch.tensor(ref_losses, dtype=torch.float64)
    if tol == "exact":
        # a pipeline's logged loss is the mean of its micro-batch losses, summed in their dtype (bf16-true: bf16)
        rtol = HALF_LOSS_RTOL if precision == "bf16-true" and options.get("pp_size", 1) > 1 else 1e-5
        torch.testing.assert_close(losses, expected, rtol=rtol, atol=0)
        for r in runs:
            assert_params_close(r["state"], ref_params)
        return
    torch.testing.assert_close(losses, expected, rtol=HALF_LOSS_RTOL, atol=0)
    for r in runs:
        diff = sum(((r["state"][k].double() - ref_params[k].double()) ** 2).sum() for k in ref_params) ** 0.5
        update = sum(((ref_params[k].double() - initial[k].double()) ** 2).sum() for k in ref_params) ** 0.5
        assert diff / update <= HALF_UPDATE_RTOL, (float(diff / update), r["rank"])


@pytest.mark.parametrize("name", ci_params(WORLD2, CI_WORLD2))
def test_every_strategy_and_schedule(world2, name):
    out, samples = world2
    _check(out[name], WORLD2[name], 2, samples)


@pytest.mark.parametrize("name", ci_params(WORLD8, CI_WORLD8))
def test_dp2_tp2_pp2(world8, name):
    out, samples = world8
    _check(out[name], WORLD8[name], 8, samples)


# ------------------------------------------------------------------------------------------------ fp16 loss scaling
def _overflow_worker(stage: int) -> dict:
    """``zero{stage}`` under ``16-mixed``: on dp rank 1, the first backward writes ``inf`` into one gradient entry that
    dp rank 0's shard holds (the last layer's bias, row 0). Every rank must skip that step and back the scale off."""
    import os

    import lightning as L
    from lightning.pytorch.plugins import MixedPrecision
    from lightning.pytorch.strategies import StrategyRegistry

    from tests.support.helpers import quiet_trainer
    from tests.support.p3d import _loader

    class Overflow(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            if trainer.global_rank == 1:
                bias = pl_module.model[-1].bias

                def poison(grad: torch.Tensor) -> torch.Tensor:
                    if trainer.global_step == 0:
                        grad = grad.clone()
                        grad[0] = float("inf")
                    return grad

                bias.register_hook(poison)

    torch.set_num_threads(1)
    entry = StrategyRegistry[f"zero{stage}"]
    strategy = entry["strategy"](**{**entry["init_params"], "timeout_s": 60})
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    trainer = quiet_trainer(strategy, 2, max_steps=1, limit_val_batches=0, callbacks=[Overflow()],
                            plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
    module = make_mlp("sgd")
    initial = {n: p.detach().clone() for n, p in module.named_parameters()}
    trainer.fit(module, _loader(RegressionDataset(n=16), MICRO, 2, int(os.environ["RANK"])))
    final = strategy.full_state_dict()
    return {"moved": max(float((final[n] - initial[n]).abs().max()) for n in initial),
            "scale": float(strategy.precision_plugin.scaler.get_scale()),
            "scaler": type(strategy.precision_plugin.scaler).__name__}


@pytest.mark.parametrize("stage", [2])
def test_fp16_overflow_on_one_ranks_shard_skips_the_step_everywhere(stage):
    from lightning_par.launcher import run_distributed
    from tests.support.helpers import TIMEOUT_S

    results = run_distributed(_overflow_worker, 2, (stage,), timeout_s=TIMEOUT_S)
    for r in results:
        assert r["moved"] == 0.0  # no rank stepped: the parameters are the initial ones everywhere
        assert r["scale"] == 2.0**9  # and every rank backed its scale off
        assert r["scaler"] == "DistributedGradScaler"
