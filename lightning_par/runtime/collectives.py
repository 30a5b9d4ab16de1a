"""The process group and the collectives a host's strategy offers its loop (``barrier``, ``broadcast``, the reduce),
the same under both adapters."""

from __future__ import annotations

import atexit
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_par.compat.fabric import distributed_is_initialized, init_dist_connection, sync_ddp_if_available
from lightning_par.fault.process_group_exit import destroy_process_group_at_exit

__all__ = ["barrier", "broadcast", "reduce", "start_process_group"]


def start_process_group(cluster_environment: Any, backend: str, timeout_s: float,
                        before: Callable[[], None] | None = None) -> None:
    """Start the default process group (unless one is there) with a collective timeout of ``timeout_s`` seconds, so a
    dead or stuck rank ends the job with an error instead of a hang; ``before()`` runs first when this starts it. A
    group started here is destroyed at exit (:func:`~lightning_par.fault.process_group_exit.
    destroy_process_group_at_exit`)."""
    started = not dist.is_initialized()
    if started and before is not None:
        before()
    init_dist_connection(cluster_environment, backend, timeout=timedelta(seconds=timeout_s))
    if started:
        atexit.register(destroy_process_group_at_exit)


def barrier() -> None:
    """A barrier over the world (nothing without a process group)."""
    if distributed_is_initialized():
        dist.barrier()


def broadcast(obj: Any, src: int = 0) -> Any:
    """``obj`` of rank ``src`` on every rank (``obj`` itself without a process group)."""
    if not distributed_is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src)
    return box[0]


def reduce(tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
    """Over the world by default (``"mean"``), as Lightning's; a DTensor (the vocab-parallel loss is a replicated
    one) is made plain first; anything but a tensor is returned as it is."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    if isinstance(tensor, Tensor):
        return sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
    return tensor
