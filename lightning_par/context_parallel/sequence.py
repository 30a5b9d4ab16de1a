"""Which part of each sequence this rank holds while a context-parallel step runs, for layers whose statistics span
a whole sequence (a mixture-of-experts router's per-sequence load-balancing loss and expert capacity).

:class:`~lightning_par.context_parallel.attention.CPAttentionMode` holds its shard here while it is active
(:func:`sequence_shard`, a :class:`~lightning_par.step_context.StepVar` scoped to the mode); outside a context-parallel
step :func:`active_sequence_shard` is ``None`` and a rank holds whole sequences.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_par.step_context import StepToken, StepVar

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch import Tensor

__all__ = ["SequenceShard", "active_sequence_shard", "sequence_shard"]


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


#: The shards of the context-parallel scopes entered on this thread and not yet left, innermost last.
_SHARDS: StepVar[tuple[SequenceShard, ...]] = StepVar("sequence_shard", ())


def active_sequence_shard() -> SequenceShard | None:
    """The sequence shard of the context-parallel step running now (``None``: this rank holds whole sequences)."""
    shards = _SHARDS.get()
    return shards[-1] if shards else None


@contextmanager
def sequence_shard(shard: SequenceShard) -> Generator[SequenceShard, None, None]:
    """Make ``shard`` the active shard for the enclosed block (the previous one is back on exit)."""
    with _SHARDS.scoped((*_SHARDS.get(), shard)):
        yield shard


def push(shard: SequenceShard) -> StepToken:
    """Make ``shard`` active until :func:`pop` (prefer :func:`sequence_shard`, which cannot be left unbalanced).

    Returns:
        The token :func:`pop` restores the previous shard with.
    """
    return _SHARDS.set((*_SHARDS.get(), shard))


def pop(token: StepToken | None = None) -> None:
    """Make the shard active before the innermost :func:`push` active again: the one ``token`` (returned by that
    :func:`push`) recorded, or without a token the innermost shard is dropped."""
    if token is not None:
        _SHARDS.reset(token)
    else:
        _SHARDS.set(_SHARDS.get()[:-1])
