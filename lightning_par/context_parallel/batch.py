"""Splitting a batch's sequence over the cp ranks, with causal load balancing."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from lightning_par.context_parallel.attention import load_balanced_positions, split_sequence

__all__ = ["SequenceSplit"]


class SequenceSplit:
    """This cp rank's piece of each batch: every tensor whose dim 1 is the sequence (as long as the batch's first
    tensor's dim 1) cut into ``2 * cp_size`` chunks, rank ``i`` keeping chunks ``i`` and ``2 cp_size - 1 - i`` (so
    every rank does the same causal-attention work: the "zigzag" layout of Megatron-Core's context parallelism and of
    torch's ``context_parallel`` load balancer), and the global ``position_ids`` ``(seq / cp_size,)`` of what it
    kept: appended to a tuple or list batch, under ``"position_ids"`` in a mapping (a mapping that holds its own
    ``position_ids`` ``(batch, seq)``, a packed block's, keeps them, split like the tokens).

    Args:
        cp_rank: this rank's coordinate on the cp axis.
        cp_size: ranks on the cp axis.

    Attributes:
        positions: the global positions ``(seq / cp_size,)`` of the last batch's kept tokens (the attention reads
            them too); ``None`` before the first batch.

    Raises:
        ValueError: (at a batch) a sequence length that is not a multiple of ``2 * cp_size``.
    """

    def __init__(self, cp_rank: int, cp_size: int) -> None:
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.positions: Tensor | None = None

    def __call__(self, batch: Any) -> Any:
        tensors = list(batch.values()) if isinstance(batch, Mapping) else list(batch)
        first = next((t for t in tensors if isinstance(t, Tensor) and t.dim() >= 2), None)
        if first is None:
            raise ValueError(
                "context parallelism needs a batch with a (batch, seq, ...) tensor to split along dim 1; got "
                f"{type(batch).__name__} without one."
            )
        seq = first.shape[1]
        positions = self.positions = load_balanced_positions(seq, self.cp_rank, self.cp_size).to(first.device)

        def split(t: Any) -> Any:
            if isinstance(t, Tensor) and t.dim() >= 2 and t.shape[1] == seq:
                return split_sequence(t, self.cp_rank, self.cp_size, dim=1)
            return t

        if isinstance(batch, Mapping):
            pieces = {k: split(v) for k, v in batch.items()}
            # A packed block's own position_ids (restarting with every document) are split like the tokens and kept:
            # the attention takes the global positions from this split (``positions``), the model its own.
            own = batch.get("position_ids")
            if not (isinstance(own, Tensor) and own.dim() >= 2 and own.shape[1] == seq):
                pieces["position_ids"] = positions
            return pieces
        pieces = [*(split(t) for t in batch), positions]
        return pieces if isinstance(batch, list) else tuple(pieces)
