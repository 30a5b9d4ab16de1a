"""Count the bytes the tensor-parallel collectives send, and the Megatron-LM figure to compare them with.

:class:`CommVolume` is a ``TorchDispatchMode``: it sees every functional collective (``torch.ops._c10d_functional``,
which DTensor redistributions and ``loss_parallel`` use) issued in forward *and* backward while it is active, and
records its payload. Bytes *sent per rank* follow the ring algorithms (:mod:`lightning_par.comm_cost`; Patarasuk &
Yuan 2009; the model of Narayanan et al. 2021, §3.2): an all-reduce of ``n`` bytes over ``t`` ranks sends
``2 n (t-1)/t``, an all-gather with output ``n`` or a reduce-scatter with input ``n`` sends ``n (t-1)/t``; a
broadcast is charged its whole payload on every rank (the busiest rank's share). Of the collectives issued through
``torch.distributed`` directly, ``dist.all_reduce`` is counted too (the one-collective sum of the sequence-parallel
norms' partial gradients, :func:`~lightning_par.tensor_parallel.styles.sync_partial_grads`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_par.comm_cost import (
    all_gather_bytes,
    all_reduce_bytes,
    all_to_all_bytes,
    megatron_layer_bytes,
    reduce_scatter_bytes,
    send_bytes,
)
from lightning_par.compat import FUNCTIONAL_COLLECTIVES, HigherOrderOperator, TorchDispatchMode, resolve_process_group

__all__ = ["CollectiveRecord", "CommVolume", "megatron_layer_comm_bytes"]

_F = FUNCTIONAL_COLLECTIVES

#: Bytes one rank sends, from its payload (bytes of its input tensor) and the group size ``t``.
_SENT = {
    "all_reduce": all_reduce_bytes,
    "all_gather": lambda payload, t: all_gather_bytes(payload * t, t),  # the output holds t inputs
    "reduce_scatter": reduce_scatter_bytes,
    "all_to_all": all_to_all_bytes,
    "broadcast": lambda payload, t: send_bytes(payload),  # the busiest rank's: all but the last forward it whole
}


def _group_size(group_name: str) -> int:
    return resolve_process_group(group_name).size()


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective: its kind, payload (bytes of the input tensor on this rank), group size and bytes sent."""

    op: str
    payload_bytes: int
    group_size: int
    sent_bytes: float


class CommVolume(TorchDispatchMode):
    """Record the functional collectives run while active (``with CommVolume(group) as cv: ...``).

    Args:
        group: count only collectives on this process group (e.g. the tp group); None counts all.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.group = group
        self.records: list[CollectiveRecord] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, HigherOrderOperator):
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            # Let DTensor run first and desugar into collectives on local tensors, which then come back here.
            return NotImplemented
        out = func(*args, **kwargs)
        self._record(func, args)
        return out

    def _record(self, func: Any, args: tuple) -> None:
        packet = func.overloadpacket
        if packet is torch.ops.c10d.allreduce_:  # dist.all_reduce: (tensors, process group, ...)
            pg = args[1]
            if isinstance(pg, torch.ScriptObject):
                pg = dist.ProcessGroup.unbox(pg)
            if self.group is not None and pg.group_name != self.group.group_name:
                return
            t = pg.size()
            n = sum(x.numel() * x.element_size() for x in args[0])
            self.records.append(CollectiveRecord("all_reduce", n, t, all_reduce_bytes(n, t)))
            return
        if packet in (_F.all_reduce, _F.all_reduce_):
            tensor, group_name, kind = args[0], args[2], "all_reduce"
        elif packet is _F.all_gather_into_tensor:
            tensor, group_name, kind = args[0], args[2], "all_gather"
        elif packet is _F.reduce_scatter_tensor:
            tensor, group_name, kind = args[0], args[3], "reduce_scatter"
        elif packet is _F.all_to_all_single:
            tensor, group_name, kind = args[0], args[3], "all_to_all"
        elif packet is _F.broadcast:
            tensor, group_name, kind = args[0], args[2], "broadcast"
        else:
            return
        if self.group is not None and group_name != self.group.group_name:
            return
        t = _group_size(group_name)
        n = tensor.numel() * tensor.element_size()
        self.records.append(CollectiveRecord(kind, n, t, _SENT[kind](n, t)))

    @property
    def sent_bytes(self) -> float:
        """Bytes this rank sent, summed over the recorded collectives (ring model)."""
        return sum(r.sent_bytes for r in self.records)

    def counts(self) -> dict[str, int]:
        """Number of collectives of each kind."""
        out: dict[str, int] = {}
        for r in self.records:
            out[r.op] = out.get(r.op, 0) + 1
        return out


def megatron_layer_comm_bytes(batch: int, seq: int, hidden: int, tp_size: int, bytes_per_element: int = 4) -> float:
    """Bytes one rank sends per transformer layer per step under Megatron tensor parallelism: four all-reduces
    (two forward, two backward) of ``batch * seq * hidden`` elements, ``8 b s h (t-1)/t`` elements
    (:func:`lightning_par.comm_cost.megatron_layer_bytes`; Narayanan et al. 2021, §3.2)."""
    return megatron_layer_bytes(batch, seq, hidden, tp_size, bytes_per_element)
