"""Module buffers (BatchNorm running statistics) follow torch DDP's ``broadcast_buffers=True`` in every dp mode.

A user's CNN with BatchNorm (:class:`tests.support.user_models.TinyBNNet`) trains 4 steps then validates once, under
Lightning's own ``ddp`` strategy (torch DDP, the reference) and under ``ddp_overlap``, ``zero1``, ``zero2``,
``zero3``, HSDP and a dp2 x tp2 x pp2 layout. Checked, rank by rank: the buffers after every training step equal
``ddp``'s (rank 1's too: it starts each forward from rank 0's statistics), and after validation every rank holds the
same buffers, ``ddp``'s. Losses (training and validation) match ``ddp``'s. ``broadcast_buffers=False`` lets the
replicas drift (what every dp mode did before), and an accumulation window follows torch DDP's ``no_sync`` rule.

Each world size is one launch (world 2: every 1-D dp mode; world 4: HSDP; world 8: 3D).
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_par.launcher import run_distributed
from tests.support.helpers import QUIET_TRAINER
from tests.support.user_models import ImageDataset, TinyBNNet

pytestmark = pytest.mark.distributed

STEPS, MICRO = 4, 8


class BufferRecorder(L.Callback):
    """This rank's buffers after every training step, and its training losses."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.steps.append({k: v.detach().clone() for k, v in pl_module.named_buffers()})
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach()) * trainer.accumulate_grad_batches)


def _strategy(case: dict[str, Any]) -> Any:
    if case["strategy"] == "ddp":
        return "ddp"
    from lightning.pytorch.strategies import StrategyRegistry

    entry = StrategyRegistry[case["strategy"]]
    return entry["strategy"](**{**entry["init_params"], "timeout_s": 90, **case.get("options", {})})


def _worker(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = []
    for case in cases:
        strategy = _strategy(case)
        dp, dp_rank = world, rank
        if not isinstance(strategy, str):
            dims = strategy.resolve_parallel_dims(world)
            dp, dp_rank = dims.dp_size, dims.coordinates(rank)["dp"]
        accumulate = case.get("accumulate", 1)
        train = ImageDataset(n=MICRO * dp * STEPS * accumulate)
        val = ImageDataset(n=MICRO * dp, seed=1)
        loader, val_loader = (
            DataLoader(d, batch_size=MICRO, sampler=DistributedSampler(d, dp, dp_rank, shuffle=False), drop_last=True)
            for d in (train, val)
        )
        torch.manual_seed(0)
        module = TinyBNNet()
        recorder = BufferRecorder()
        trainer = L.Trainer(devices=world, strategy=strategy, max_epochs=1, callbacks=[recorder],
                            accumulate_grad_batches=accumulate, **QUIET_TRAINER)
        trainer.fit(module, loader, val_loader)
        out.append({
            "name": case["name"], "rank": rank, "dp_rank": dp_rank, "steps": recorder.steps, "losses": recorder.losses,
            "val_loss": float(trainer.callback_metrics["val_loss"]),
            "final": {k: v.detach().clone() for k, v in module.named_buffers()},
        })
    return out


def _launch(world: int, cases: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    results = run_distributed(_worker, world, (cases,), timeout_s=600)
    return {c["name"]: [r[i] for r in results] for i, c in enumerate(cases)}


WORLD2 = [
    {"name": "ddp", "strategy": "ddp"},
    {"name": "ddp_overlap", "strategy": "ddp_overlap"},
    {"name": "zero1", "strategy": "zero1"},
    {"name": "zero2", "strategy": "zero2"},
    {"name": "zero3", "strategy": "zero3"},
    {"name": "ddp_overlap-off", "strategy": "ddp_overlap", "options": {"broadcast_buffers": False}},
    {"name": "ddp-accumulate", "strategy": "ddp", "accumulate": 2},
    {"name": "ddp_overlap-accumulate", "strategy": "ddp_overlap", "accumulate": 2},
]
WORLD8 = [
    {"name": "3d-zero1", "strategy": "parallel_3d",
     "options": {"dp_size": 2, "tp_size": 2, "pp_size": 2, "dp_mode": "zero1", "num_microbatches": 1,
                 "schedule": "gpipe"}},
    {"name": "hsdp-zero3", "strategy": "zero3", "options": {"dp_replicate_size": 2, "dp_shard_size": 4}},
    {"name": "ddp8", "strategy": "ddp"},
]


@pytest.fixture(scope="module")
def world2() -> dict[str, list[dict[str, Any]]]:
    return _launch(2, WORLD2)


@pytest.fixture(scope="module")
def world8() -> dict[str, list[dict[str, Any]]]:
    return _launch(8, WORLD8)


def _assert_buffers_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert actual.keys() == expected.keys(), what
    for k in expected:
        assert torch.equal(actual[k], expected[k]), (
            f"{what}: {k} differs by {(actual[k].double() - expected[k].double()).abs().max().item():.3g}"
        )


def _assert_like_ddp(runs: list[dict[str, Any]], ddp: list[dict[str, Any]]) -> None:
    """Each rank's buffers after every step and after validation are ``ddp``'s rank of the same dp coordinate;
    every rank ends with the same buffers; losses are ``ddp``'s."""
    for r in runs:
        ref = ddp[r["dp_rank"]]
        assert len(r["steps"]) == len(ref["steps"]) == len(r["losses"])
        for i, (got, want) in enumerate(zip(r["steps"], ref["steps"])):
            _assert_buffers_equal(got, want, f"rank {r['rank']} after step {i}")
        _assert_buffers_equal(r["final"], ref["final"], f"rank {r['rank']} after validation")
        _assert_buffers_equal(r["final"], runs[0]["final"], f"rank {r['rank']} against rank 0 after validation")
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-6, atol=0)
        assert r["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-6)


def test_lightning_ddp_reference_broadcasts(world2):
    """The reference itself: under torch DDP the ranks end validation with rank 0's buffers, and rank 1's statistics
    after a step are not what its own batches alone would give (checked through ``ddp_overlap-off``)."""
    ddp = world2["ddp"]
    _assert_buffers_equal(ddp[1]["final"], ddp[0]["final"], "ddp rank 1 against rank 0")
    off = world2["ddp_overlap-off"]
    assert not torch.equal(off[1]["steps"][-1]["model.0.bn.running_mean"], ddp[1]["steps"][-1]["model.0.bn.running_mean"])


@pytest.mark.parametrize("name", ["ddp_overlap", "zero1", "zero2", "zero3", "ddp_overlap-accumulate"])
def test_buffers_match_lightning_ddp_on_every_rank(world2, name):
    ddp = world2["ddp-accumulate" if name.endswith("accumulate") else "ddp"]
    _assert_like_ddp(world2[name], ddp)


def test_broadcast_buffers_false_keeps_each_replicas_own(world2):
    """Turned off, the replicas' running statistics drift apart, as they did in every dp mode before."""
    off = world2["ddp_overlap-off"]
    key = "model.0.bn.running_mean"
    assert not torch.equal(off[0]["final"][key], off[1]["final"][key])
    # rank 0 is the authority either way: its buffers are ddp's
    _assert_buffers_equal(off[0]["steps"][-1], world2["ddp"][0]["steps"][-1], "rank 0 with broadcast_buffers=False")


def test_buffers_match_lightning_ddp_under_hsdp(world8):
    """HSDP 2 x 4 (dp 8, zero3) against ``ddp`` at world 8: every rank ends with the same buffers, exactly; rank by
    rank, after every step, ``ddp``'s up to fp32 rounding of the parameters (FSDP2's reduce-scatter over 8 ranks rounds
    otherwise than torch DDP's all-reduce: 9e-10 measured after the second step)."""
    runs, ddp = world8["hsdp-zero3"], world8["ddp8"]
    for r in runs:
        _assert_buffers_equal(r["final"], runs[0]["final"], f"rank {r['rank']} against rank 0 after validation")
        ref = ddp[r["dp_rank"]]
        for got, want in zip([*r["steps"], r["final"]], [*ref["steps"], ref["final"]]):
            assert got.keys() == want.keys()
            for k in got:
                torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-6, atol=0)
        assert r["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-6)


def test_buffers_agree_and_match_lightning_ddp_in_3d(world2, world8):
    """dp2 x tp2 x pp2 (zero1, one micro-batch: BatchNorm then sees the batch ``ddp`` sees): each rank holds its
    stage's buffers. After validation the ranks of one stage hold the same buffers, exactly; after every step each
    rank's are those of ``ddp``'s rank with its dp coordinate, up to fp32 rounding of the parameters (the 3D
    gradient reduction rounds differently from torch DDP's: 9e-10 measured after the second step)."""
    runs, ddp = world8["3d-zero1"], world2["ddp"]
    by_stage: dict[tuple[str, ...], dict[str, torch.Tensor]] = {}
    for r in runs:
        first = by_stage.setdefault(tuple(sorted(r["final"])), r["final"])
        _assert_buffers_equal(r["final"], first, f"rank {r['rank']} against its stage's first rank")
        ref = ddp[r["dp_rank"]]
        for got, want in zip([*r["steps"], r["final"]], [*ref["steps"], ref["final"]]):
            assert got and set(got) <= set(want)
            for k in got:
                torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=1e-6, atol=0)
        assert r["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-6)
    assert len(by_stage) == 2, sorted(by_stage)
