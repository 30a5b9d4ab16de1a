"""Which part of each sequence this rank holds while a context-parallel step runs, for layers whose statistics span
a whole sequence (a mixture-of-experts router's per-sequence load-balancing loss and expert capacity).

:class:`~lightning_par.context_parallel.attention.CPAttentionMode` registers itself here while it is active; outside a
context-parallel step :func:`active_sequence_shard` is ``None`` and a rank holds whole sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch import Tensor

__all__ = ["SequenceShard", "active_sequence_shard"]


@dataclass
class SequenceShard:
    """This rank's piece of every sequence of the batch.

    Attributes:
        group: the cp process group (the ranks holding the other pieces).
        positions: ``(seq_local,)`` int64, the global positions of the local tokens.
        size: the number of cp ranks.
    """

    group: dist.ProcessGroup | None
    positions: Tensor
    size: int


_active: list[SequenceShard] = []


def active_sequence_shard() -> SequenceShard | None:
    """The sequence shard of the context-parallel step running now (``None``: this rank holds whole sequences)."""
    return _active[-1] if _active else None


def push(shard: SequenceShard) -> None:
    """Register ``shard`` as active (called by the cp attention mode on entry)."""
    _active.append(shard)


def pop() -> None:
    """Unregister the innermost active shard (called by the cp attention mode on exit)."""
    _active.pop()
