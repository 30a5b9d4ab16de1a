"""The meshes of a layout are built once per default process group in a process (each Trainer run resolves its own
ParallelDims; building again started new process groups every run, never freed)."""

from __future__ import annotations

import os
import socket

import torch.distributed as dist

from lightning_par.parallel_dims import ParallelDims


def _init() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)


def test_a_second_run_of_the_same_layout_reuses_the_meshes_and_a_new_default_group_does_not() -> None:
    _init()
    first = ParallelDims(world_size=1).build_mesh()
    again = ParallelDims(world_size=1).build_mesh()
    assert again is first  # a second Trainer run: no new process groups
    dist.destroy_process_group()
    _init()  # another default group: its own meshes
    assert ParallelDims(world_size=1).build_mesh() is not first
    dist.destroy_process_group()
