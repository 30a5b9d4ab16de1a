"""Module buffers across the dp replicas: torch DDP's ``broadcast_buffers`` for every dp mode and layout.

Buffers (BatchNorm's running statistics, a step counter) are not parameters: no gradient reduction makes them agree.
Each replica updates them from its own batch, so without a broadcast they drift apart, silently (a BatchNorm model's
rank 1 ends with other running statistics and another validation loss than rank 0). torch's
``DistributedDataParallel`` broadcasts them from rank 0 before a forward, by default (``broadcast_buffers=True``);
:class:`BufferSync` does the same, over the ranks that replicate the module (the ``dp_cp`` group, the one that
averages its gradients), whatever the dp mode (``ddp``, ZeRO-1/2/3, HSDP) and with tensor and pipeline parallelism.

When: as torch DDP (``DistributedDataParallel._pre_forward`` and ``require_forward_param_sync``, torch 2.13), the
broadcast runs before a forward if the previous forward was a training forward outside an accumulation window's
``no_sync`` (or there was none yet). So the first validation forward after training broadcasts, the following ones
and the first training forward after them do not, and neither does the forward after a ``no_sync`` one. Following
that rule exactly is what makes the buffers equal to those of Lightning's ``ddp`` strategy, rank by rank.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_par.compat import local_tensor, privateuse1_backend_name

__all__ = ["SYNC_BATCHNORM_DEVICES", "BufferSync", "broadcast_coalesced", "prepare_sync_batchnorm"]


def broadcast_coalesced(tensors: list[Tensor], src: int, group: dist.ProcessGroup) -> None:
    """Broadcast ``tensors`` from global rank ``src`` to every rank of ``group``, in place, one broadcast per dtype.

    Args:
        tensors: plain (local) tensors, the same shapes and dtypes on every rank of ``group``.
        src: the global rank whose values everyone receives.
        group: the process group.
    """
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for t in same:
            t.detach().copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


class BufferSync:
    """Broadcasts a module's buffers from rank 0 of the dp group before a forward, with torch DDP's rule for when
    (see the module docstring).

    Args:
        module: the module whose buffers the replicas share (this rank's part of the model under pipelining).
        group: the process group of the ranks that replicate ``module`` (the ``dp_cp`` mesh's group).
        enabled: ``False``: never broadcast (torch DDP's ``broadcast_buffers=False``): each replica keeps its own
            buffers after the start-up broadcast.

    Attributes:
        broadcasts: how many times the buffers were broadcast (for tests and ``summary.json``).
    """

    def __init__(self, module: nn.Module, group: dist.ProcessGroup, enabled: bool = True) -> None:
        self.module = module
        self.group = group
        self.enabled = bool(enabled) and dist.get_world_size(group) > 1
        self._src = dist.get_global_rank(group, 0) if self.enabled else 0
        self._due = True  # torch DDP's require_forward_param_sync starts True
        self._accumulating = False
        self.broadcasts = 0

    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Forwards inside are an accumulation window's (torch DDP's ``no_sync``): the next forward does not
        broadcast."""
        previous, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = previous

    def before_forward(self) -> None:
        """Call once before each forward (training or evaluation), on every rank of the group: broadcasts the buffers
        when torch DDP would. Collective over the group when it broadcasts; every rank decides alike (the same
        sequence of steps and grad modes)."""
        due, self._due = self._due, torch.is_grad_enabled() and not self._accumulating
        if not (self.enabled and due):
            return
        buffers = [local_tensor(b) for b in self.module.buffers()]
        if buffers:
            with torch.no_grad():
                broadcast_coalesced(buffers, self._src, self.group)
            self.broadcasts += 1


#: Device types torch's ``SyncBatchNorm`` accepts in training (torch 2.13, ``SyncBatchNorm.forward``).
SYNC_BATCHNORM_DEVICES: tuple[str, ...] = ("cuda", "hpu", "xpu", privateuse1_backend_name())


def prepare_sync_batchnorm(module: nn.Module, device: torch.device, group: dist.ProcessGroup) -> int:
    """Make every ``nn.SyncBatchNorm`` of ``module`` synchronise over ``group`` (the dp replicas) unless it was given
    its own process group: torch's default, the whole world, would also average over tensor- and pipeline-parallel
    ranks. Returns how many there are.

    Raises:
        ValueError: ``module`` has a ``SyncBatchNorm`` and ``device`` is not an accelerator torch's ``SyncBatchNorm``
            runs on (its forward refuses CPU input); on CPU plain BatchNorm with ``broadcast_buffers=True`` keeps the
            replicas' running statistics equal.
    """
    sync = [m for m in module.modules() if isinstance(m, nn.SyncBatchNorm)]
    if sync and device.type not in SYNC_BATCHNORM_DEVICES:
        raise ValueError(
            f"{len(sync)} nn.SyncBatchNorm layer(s) found on device={device.type!r}: torch's SyncBatchNorm runs only on "
            f"{list(SYNC_BATCHNORM_DEVICES)} (its forward refuses CPU input). On CPU keep nn.BatchNorm (do not call "
            f"convert_sync_batchnorm): with reducer.broadcast_buffers=True (the default) every dp replica starts each "
            f"forward from dp rank 0's running statistics, as under torch DDP."
        )
    for m in sync:
        if m.process_group is None:
            m.process_group = group
    return len(sync)
