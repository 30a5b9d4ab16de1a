"""The recipe with damaged checkpoints and background saves, end to end (tiny GPT, 2 ranks, checkpoints every 2 steps):
a run with ``trainer.async_checkpoint=true`` commits every checkpoint it started; after its newest checkpoint is damaged
(a shard truncated) and a killed save's staging directory is left next to it, a restarted run skips the damaged one
naming the file, resumes from the previous one with the same losses, removes the leftover and finishes.
(Each damage variant's fall-back choice: tests/checkpoint/test_checkpoint_damage.py.)"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from lightning_par.checkpoint import verify_checkpoint
from lightning_par.checkpoint.atomic import staging_dir
from lightning_par.train import launch_job
from tests.fault.test_faults import _cfg, _losses

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_async_checkpoints_commit_and_a_damaged_newest_one_is_skipped(tmp_path, caplog):
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    first = launch_job(_cfg("strategy=zero2", "trainer.max_steps=4", "trainer.async_checkpoint=true"), run_dir)
    assert first is not None and first["steps"] == 4
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt", "step-2.ckpt", "step-4.ckpt"]
    for step in (2, 4):
        record = verify_checkpoint(ckpts / f"step-{step}.ckpt")
        assert record["global_step"] == step and record["saved_in_background"] is True
        assert len(record["files"]) == 4  # 2 shards, .metadata, meta.pt

    shard = ckpts / "step-4.ckpt" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    staging_dir(ckpts / "step-6.ckpt").mkdir()  # what a save killed on a full disk leaves
    with caplog.at_level(logging.WARNING):
        summary = launch_job(_cfg("strategy=zero2", "trainer.max_steps=6"), run_dir)
    assert summary is not None and summary["steps"] == 6
    assert Path(summary["resumed_from"]).name == "step-2.ckpt"
    assert verify_checkpoint(ckpts / "step-6.ckpt")["saved_in_background"] is False
    assert any("Skipping checkpoint" in r.message and "step-4.ckpt" in r.message and "__1_0.distcp has 100 bytes"
               in r.message for r in caplog.records), [r.message for r in caplog.records]
    assert not staging_dir(ckpts / "step-6.ckpt").exists()
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(6))
    for step in (2, 3):  # run before the damage and again after the fall-back: the background save was exact
        assert len(losses[step]) == 2 and abs(losses[step][0] - losses[step][1]) <= 1e-6, losses[step]
