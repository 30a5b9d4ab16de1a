"""The ("pp", "dp", "tp") mesh on 8 gloo ranks: sub-mesh groups hold the ranks the coordinates say."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_par.launcher import DistributedRunError, init_process_group_from_env, run_distributed
from lightning_par.parallel_dims import ParallelDims

pytestmark = pytest.mark.distributed


def _mesh_worker() -> dict:
    init_process_group_from_env(timeout_s=30)
    dims = ParallelDims(dp_size=-1, tp_size=2, pp_size=2, world_size=dist.get_world_size())
    dims.build_mesh("cpu")
    rank = dist.get_rank()
    out = {}
    for axis in ("pp", "dp", "tp"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=dims.get_mesh(axis).get_group())
        out[axis] = t.item()
    return {"rank": rank, "coords": dims.coordinates(rank), "sums": out}


def test_sub_meshes_group_the_right_ranks():
    dims = ParallelDims(dp_size=2, tp_size=2, pp_size=2, world_size=8)
    for r in run_distributed(_mesh_worker, 8, timeout_s=120):
        for axis in ("pp", "dp", "tp"):
            peers = [q for q in range(8) if all(dims.coordinates(q)[a] == r["coords"][a] for a in ("pp", "dp", "tp") if a != axis)]
            assert r["sums"][axis] == sum(peers), (axis, r)


def _failing_worker() -> None:
    init_process_group_from_env(timeout_s=10)
    if dist.get_rank() == 1:
        raise RuntimeError("rank one fails on purpose")
    dist.barrier()


def test_a_failing_rank_ends_the_world_with_its_error():
    with pytest.raises(DistributedRunError, match="rank one fails on purpose"):
        run_distributed(_failing_worker, 2, timeout_s=60)


def _hanging_worker() -> None:
    import time

    time.sleep(30)


def test_a_world_past_its_timeout_is_killed():
    with pytest.raises(DistributedRunError, match="timed out after 2 s"):
        run_distributed(_hanging_worker, 2, timeout_s=2)
