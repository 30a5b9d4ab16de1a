"""Background checkpoints (``torch.distributed.checkpoint.async_save``) on 2 gloo ranks, in one launch:

* a background save holds the values of the moment it was started (the parameters change right after), while the
  training group keeps running collectives, and becomes a checkpoint only at ``commit``;
* a background save still writing when its processes are SIGKILLed never becomes the newest checkpoint: the previous
  one is resumed from, and the staging directory it left is removed at the next start.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_par.checkpoint import load_model_weights, save_sharded, verify_checkpoint
from lightning_par.checkpoint.async_save import start_async_save
from lightning_par.checkpoint.atomic import remove_leftovers, staging_dir
from lightning_par.fault.resume import latest_checkpoint, resolve_ckpt_path
from lightning_par.launcher import DistributedRunError, init_process_group_from_env, run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]


def _state(value: float) -> dict:
    return {"state_dict": {"weight": torch.full((2, 3), value)}, "global_step": int(value)}


def _async_then_killed(directory: str) -> None:
    import torch.distributed.checkpoint as dcp

    init_process_group_from_env(timeout_s=60)
    rank0 = dist.get_rank() == 0
    group = dist.new_group(backend="gloo")
    d = Path(directory)
    # 1. A background save committed after its writes: the values of when it started, not the ones after.
    checkpoint = _state(2.0)
    weight = checkpoint["state_dict"]["weight"]
    pending = start_async_save(d / "step-2.ckpt", checkpoint, {"global_step": 2}, is_rank0=rank0,
                               barrier=dist.barrier, process_group=group)
    weight.add_(100.0)  # training goes on
    for _ in range(20):
        dist.all_reduce(torch.ones(1))  # the training group is free while the background save runs
    assert not (d / "step-2.ckpt").exists()  # not a checkpoint before commit
    pending.commit()
    verify_checkpoint(d / "step-2.ckpt")
    # 2. A background save that is still writing when the processes are killed.
    original = dcp.FileSystemWriter.write_data

    def slow_write(self, plan, planner):
        time.sleep(60)
        return original(self, plan, planner)

    dcp.FileSystemWriter.write_data = slow_write
    start_async_save(d / "step-4.ckpt", _state(4.0), {"global_step": 4}, is_rank0=rank0, barrier=dist.barrier,
                     process_group=group)
    dist.barrier()
    assert staging_dir(d / "step-4.ckpt").is_dir()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def test_a_background_save_commits_what_it_started_with_and_a_killed_one_never_counts(tmp_path):
    save_sharded(tmp_path / "step-0.ckpt", _state(0.0), {"global_step": 0}, is_rank0=True, barrier=lambda: None)
    with pytest.raises(DistributedRunError, match=r"^rank 1 \(pid \d+\) was killed by signal SIGKILL"):
        run_distributed(_async_then_killed, 2, (str(tmp_path),), timeout_s=90)
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.zeros(2, 3))
    assert load_model_weights(tmp_path / "step-2.ckpt", module)["global_step"] == 2
    assert torch.equal(module.weight.detach(), torch.full((2, 3), 2.0))
    assert not (tmp_path / "step-4.ckpt").exists() and staging_dir(tmp_path / "step-4.ckpt").is_dir()
    assert latest_checkpoint(tmp_path) == tmp_path / "step-2.ckpt"
    assert resolve_ckpt_path("last", tmp_path) == tmp_path / "step-2.ckpt"
    assert remove_leftovers(tmp_path) == [staging_dir(tmp_path / "step-4.ckpt")]
