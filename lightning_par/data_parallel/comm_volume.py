"""Count the bytes each rank sends, at the collectives themselves, whoever issues them (our reducers, FSDP2, DTensor).

:class:`CommCounter` is a ``TorchDispatchMode``: every ``c10d`` collective (``torch.distributed.*``) and every
functional collective (``_c10d_functional``, what DTensor issues) passes through the dispatcher, where it is seen with
its tensors and process group. Each call is charged what a rank sends in the bandwidth-optimal (ring) algorithm for
a group of ``N`` ranks (:mod:`lightning_par.comm_cost`; Thakur, Rabenseifner & Gropp 2005; the cost model of the ZeRO
paper's §7):

* all-reduce of ``B`` bytes: ``2 B (N-1)/N``;
* all-gather into ``B`` bytes of output, reduce-scatter of ``B`` bytes of input: ``B (N-1)/N``;
* broadcast of ``B`` bytes: ``B (N-1)/N`` (pipelined ring, averaged over ranks); send: ``B``.

This is the algorithm's volume, not a trace of the backend's packets (gloo and NCCL may pick other algorithms for
small messages); the point is to compare strategies with the same yardstick. Counting costs one Python call per
dispatched op while active, so :class:`CommVolumeCallback` turns it on for one optimizer step only.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import lightning as L
from torch import Tensor

from lightning_par.comm_cost import (
    all_gather_bytes,
    all_reduce_bytes,
    broadcast_bytes,
    reduce_scatter_bytes,
    send_bytes,
)
from lightning_par.compat import (
    FUNCTIONAL_COLLECTIVES_NAMESPACE,
    TorchDispatchMode,
    op_name,
    resolve_process_group,
    tree_leaves,
)

__all__ = ["CommCounter", "CommVolumeCallback"]

def _nbytes(tensors: list[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# Charge per op (bytes this rank sends), from its tensors ``ts`` (flattened arguments, outputs first for c10d ops)
# and the group size ``n``: the buffer each formula of lightning_par.comm_cost takes (an all-gather's output, a
# reduce-scatter's input: ``n`` times the one tensor a list op or a functional op sees).
_CHARGES: dict[str, tuple[str, Any]] = {
    # c10d (in place, outputs first)
    "allreduce_": ("all_reduce", lambda ts, n: all_reduce_bytes(_nbytes(ts), n)),
    "allreduce_coalesced_": ("all_reduce", lambda ts, n: all_reduce_bytes(_nbytes(ts), n)),
    "_allgather_base_": ("all_gather", lambda ts, n: all_gather_bytes(_nbytes(ts[:1]), n)),
    "allgather_": ("all_gather", lambda ts, n: all_gather_bytes(_nbytes(ts[-1:]) * n, n)),
    "allgather_into_tensor_coalesced_": ("all_gather", lambda ts, n: all_gather_bytes(_nbytes(ts[: len(ts) // 2]), n)),
    "_reduce_scatter_base_": ("reduce_scatter", lambda ts, n: reduce_scatter_bytes(_nbytes(ts[1:2]), n)),
    "reduce_scatter_": ("reduce_scatter", lambda ts, n: reduce_scatter_bytes(_nbytes(ts[:1]) * n, n)),
    "reduce_scatter_tensor_coalesced_": (
        "reduce_scatter", lambda ts, n: reduce_scatter_bytes(_nbytes(ts[len(ts) // 2 :]), n)
    ),
    "broadcast_": ("broadcast", lambda ts, n: broadcast_bytes(_nbytes(ts), n)),
    "send": ("send", lambda ts, n: send_bytes(_nbytes(ts))),
    # functional collectives (input only, output returned)
    "all_reduce": ("all_reduce", lambda ts, n: all_reduce_bytes(_nbytes(ts[:1]), n)),
    "all_reduce_coalesced": ("all_reduce", lambda ts, n: all_reduce_bytes(_nbytes(ts), n)),
    "all_gather_into_tensor": ("all_gather", lambda ts, n: all_gather_bytes(_nbytes(ts[:1]) * n, n)),
    "all_gather_into_tensor_coalesced": ("all_gather", lambda ts, n: all_gather_bytes(_nbytes(ts) * n, n)),
    "reduce_scatter_tensor": ("reduce_scatter", lambda ts, n: reduce_scatter_bytes(_nbytes(ts[:1]), n)),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", lambda ts, n: reduce_scatter_bytes(_nbytes(ts), n)),
    "broadcast": ("broadcast", lambda ts, n: broadcast_bytes(_nbytes(ts[:1]), n)),
}


def _group_size(args: tuple, kwargs: dict) -> int:
    import torch.distributed as dist

    for a in tree_leaves((args, kwargs)):
        if isinstance(a, str):  # functional collectives name their group
            try:
                return resolve_process_group(a).size()
            except Exception:  # noqa: BLE001 - not a group name
                continue
        size = getattr(a, "size", None)
        if callable(size) and not isinstance(a, Tensor):
            try:
                value = size()
            except Exception:  # noqa: BLE001
                continue
            if isinstance(value, int):
                return value
    return dist.get_world_size()


class CommCounter(TorchDispatchMode):
    """Accumulate the bytes this rank sends in collectives while the mode is active (see the module docstring).

    Attributes:
        bytes_sent: total bytes charged.
        by_op: bytes charged per collective kind (``"all_reduce"``, ``"all_gather"``, ``"reduce_scatter"``, ...).
        calls: number of collectives per kind.
    """

    def __init__(self) -> None:
        super().__init__()
        self.bytes_sent = 0.0
        self.by_op: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def reset(self) -> None:
        self.bytes_sent = 0.0
        self.by_op.clear()
        self.calls.clear()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        namespace = getattr(func, "namespace", "")
        if namespace in ("c10d", FUNCTIONAL_COLLECTIVES_NAMESPACE):
            self._charge(op_name(func), args, kwargs)
        return func(*args, **kwargs)

    def _charge(self, op: str, args: tuple, kwargs: dict) -> None:
        if op not in _CHARGES:
            return
        tensors = [a for a in tree_leaves(args) if isinstance(a, Tensor)]
        if not tensors:
            return
        n = _group_size(args, kwargs)
        kind, charge = _CHARGES[op]
        sent = charge(tensors, max(n, 1))  # a group of at least one rank
        self.bytes_sent += sent
        self.by_op[kind] += sent
        self.calls[kind] += 1


class CommVolumeCallback(L.Callback):
    """Count the bytes this rank sends during optimizer step ``step`` (0-based, all its micro-batches, the optimizer
    step and what follows it in the same batch, e.g. ZeRO's parameter all-gather).

    Attributes:
        bytes_per_step: bytes sent in that step, ``None`` until it has run.
        by_op: the same split by collective kind.
    """

    def __init__(self, step: int = 1) -> None:
        self.step = step
        self.bytes_per_step: float | None = None
        self.by_op: dict[str, float] = {}
        self._counter: CommCounter | None = None

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step and self._counter is None and self.bytes_per_step is None:
            self._counter = CommCounter()
            self._counter.__enter__()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._counter is not None and trainer.global_step > self.step:
            self._counter.__exit__(None, None, None)
            self.bytes_per_step = self._counter.bytes_sent
            self.by_op = dict(self._counter.by_op)
            self._counter = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._counter = None
