"""Pipelining in a Fabric loop: ``loss = lightning_par.fabric.train_step(model, batch)`` runs the schedule and matches
one process (fp32, SGD with momentum and AdamW); ``model(x)`` and ``fabric.backward`` are refused, naming it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_par.fabric import MeshStrategy
from lightning_par.launcher import run_distributed
from tests.support.fabric import PipelinedLM, fabric_pipelined_worker, reference_loop
from tests.support.helpers import TIMEOUT_S, assert_params_close
from tests.support.user_models import AttentionNet

pytestmark = pytest.mark.distributed


def make_lm() -> PipelinedLM:
    torch.manual_seed(0)
    return PipelinedLM(AttentionNet())


def pp2_1f1b() -> MeshStrategy:
    return MeshStrategy(pp_size=2, schedule="1f1b", num_microbatches=2)


def dp2_tp2_pp2() -> MeshStrategy:
    return MeshStrategy(dp_size=2, tp_size=2, pp_size=2, schedule="1f1b", num_microbatches=2, dp_mode="zero1")


def _check(world: int, cases: list[tuple[str, object, int, dict]], micro_batch: int, steps: int) -> list[dict]:
    runs = [dict(strategy=s, model=make_lm, micro_batch=micro_batch, steps=steps, **kw) for _, s, _, kw in cases]
    results = run_distributed(fabric_pipelined_worker, world, (runs,), timeout_s=TIMEOUT_S)
    for (label, _, dp, _), run, got in zip(cases, runs, results[0]):
        losses, state = reference_loop(
            make_lm, run["optimizer"], micro_batch * dp, steps, run.get("accumulate", 1), run.get("clip_norm"),
            run.get("dataset"),
        )
        torch.testing.assert_close(got["losses"], losses, rtol=1e-5, atol=0, msg=lambda m, l=label: f"{l}: {m}")
        try:
            assert_params_close(got["state"], state)
        except AssertionError as err:
            raise AssertionError(f"{label}: {err}") from None
        assert len(got["refused"]) == 2 and all("train_step(model" in r for r in got["refused"]), got["refused"]
        assert "not valid under pipelining (pp_size=" in got["loss_fn_refused"], got["loss_fn_refused"]
    return results[0]


def test_fabric_pipeline_1f1b_pp2_matches_one_process(tmp_path) -> None:
    """1f1b pp2 through train_step: SGD with momentum (accumulation over 2 batches through fabric.no_backward_sync,
    global norm clipping) and AdamW; the AdamW run's fabric.save (each stage its shards) loads into one process."""
    from lightning_par.checkpoint import load_model_weights

    path = str(tmp_path / "ckpt")
    got = _check(2, [
        ("pp2 1f1b sgd acc2 clip", pp2_1f1b, 1, {"optimizer": "sgd", "accumulate": 2, "clip_norm": 1.0}),
        ("pp2 1f1b adamw", pp2_1f1b, 1, {"optimizer": "adamw", "save": path}),
    ], micro_batch=4, steps=3)
    plain = PipelinedLM(AttentionNet())
    load_model_weights(path, plain)
    assert_params_close({n: p.detach() for n, p in plain.named_parameters()}, got[1]["state"], rtol=0, atol=0)


@pytest.mark.slow
def test_fabric_pipeline_dp2_tp2_pp2_matches_one_process() -> None:
    """dp2 x tp2 x pp2 (world 8) through train_step, SGD with momentum and AdamW."""
    _check(8, [
        ("dp2 tp2 pp2 sgd clip", dp2_tp2_pp2, 2, {"optimizer": "sgd", "clip_norm": 1.0}),
        ("dp2 tp2 pp2 adamw", dp2_tp2_pp2, 2, {"optimizer": "adamw"}),
    ], micro_batch=4, steps=2)


def _train_step_misuse() -> list[str]:
    import lightning as L

    from lightning_par.fabric import train_step
    from tests.support.helpers import TokenDataset

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp_overlap")
    fabric.launch()
    model = fabric.setup(AttentionNet())  # no loss_fn of its own
    x, y = TokenDataset()[0]
    out = []
    for batch in ((x[None], y[None]), {"x": x[None]}):
        try:
            train_step(model, batch, loss_fn=None if isinstance(batch, tuple) else F.mse_loss)
        except ValueError as err:
            out.append(str(err))
    return out


def test_fabric_train_step_misuse_is_refused() -> None:
    """train_step without a loss function (the model has no loss_fn, none passed), and on a batch that is not
    (inputs, targets) without pipeline_batch: a ValueError naming what to pass."""
    got = run_distributed(_train_step_misuse, 2, timeout_s=TIMEOUT_S)
    for errors in got:
        assert len(errors) == 2, errors
        assert "needs the loss: pass loss_fn=" in errors[0] and "AttentionNet" in errors[0], errors
        assert "expected (inputs, targets)" in errors[1] and "AttentionNet.pipeline_batch" in errors[1], errors


def dp2_pp2() -> MeshStrategy:
    return MeshStrategy(dp_size=2, pp_size=2, schedule="1f1b", num_microbatches=2)


@pytest.mark.slow
def test_fabric_pipeline_dp2_pp2_label_masks_match_one_process() -> None:
    """dp2 x pp2 on answer-only label masks (every replica and micro-batch counts other numbers of tokens): the
    gradients and the loss train_step returns are one process's token mean of the global batch."""
    from tests.support.labels import ChatRecords

    _check(4, [
        ("dp2 pp2 sgd label mask", dp2_pp2, 2, {"optimizer": "sgd", "dataset": ChatRecords(64)}),
        ("dp2 pp2 adamw acc2 label mask", dp2_pp2, 2, {"optimizer": "adamw", "accumulate": 2,
                                                        "dataset": ChatRecords(64)}),
    ], micro_batch=4, steps=2)


def pp2_gpipe() -> MeshStrategy:
    return MeshStrategy(pp_size=2, schedule="gpipe", num_microbatches=4)


@pytest.mark.slow
def test_fabric_pipeline_gpipe_pp2_matches_one_process() -> None:
    """GPipe pp2 (4 micro-batches) through train_step, SGD with momentum with accumulation and AdamW."""
    _check(2, [
        ("pp2 gpipe sgd acc2", pp2_gpipe, 1, {"optimizer": "sgd", "accumulate": 2}),
        ("pp2 gpipe adamw clip", pp2_gpipe, 1, {"optimizer": "adamw", "clip_norm": 1.0}),
    ], micro_batch=4, steps=2)
