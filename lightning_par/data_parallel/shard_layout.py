"""Where each parameter's ZeRO shard lives: every tensor cut along dim 0 into ``dp_size`` chunks, packed in buckets.

ZeRO (Rajbhandari et al., SC'20, §5) partitions the optimizer state, gradients and parameters into ``N = dp_size``
equal parts. How the parts are cut is left open; two common choices:

* per-parameter assignment (torch's ``ZeroRedundancyOptimizer``, DeepSpeed stage 1 by parameter groups): a rank owns
  whole tensors, chosen greedily by size. Balanced only when the model has many tensors of about equal size; a GPT's
  embedding and ``lm_head`` each hold a large share of the parameters, so one rank ends up with far more than ``1/N``.
* every tensor cut into ``N`` chunks along dim 0, with ``torch.chunk`` semantics (``ceil(rows / N)`` rows per chunk,
  the last chunks shorter or empty). This is FSDP2's layout (``Shard(0)`` on the dp mesh): balanced to within one row
  per tensor, and a rank's chunk of a tensor is a ``DTensor`` on the dp mesh with a regular placement.

This module implements the second. Because the chunks are ``Shard(0)`` DTensors, the optimizer state of stages 1 and
2 has exactly the layout of FSDP2's (stage 3) optimizer state: a sharded checkpoint saved at any stage and dp size
loads into any other (``torch.distributed.checkpoint`` reshards DTensors), and ``torch.nn.utils.clip_grad_norm_``
over the shards computes the norm of the whole model's gradient (DTensor reduces the partial norms over dp).

Communication packs tensors into buckets of at most ``bucket_cap_mb`` MiB, in reverse registration order (about the
order backward produces gradients, as torch DDP does, Li et al., VLDB 2020, §3.2). A bucket's collective buffer is
laid out rank-major, ``(N, chunk_numel)``: row ``j`` holds, for every tensor of the bucket, the ``chunk_rows`` rows of
chunk ``j`` (zero-padded), so one ``reduce_scatter_tensor`` leaves each rank exactly its chunks, and one
``all_gather_into_tensor`` of the chunks rebuilds every full tensor (FSDP2's copy-in / copy-out).

Tensors are the *local* tensors of the parameters: the parameter itself, or a tensor-parallel ``DTensor``'s local
shard, so the same layout serves the dp axis of a 2-D or 3-D mesh.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_par.compat import local_tensor  # re-exported for callers that import it from here

__all__ = ["LayoutBucket", "ParamShard", "ShardLayout", "local_tensor"]

_MiB = 1024 * 1024


@dataclass
class ParamShard:
    """One parameter's place in the layout.

    The parameter's local tensor, seen as ``(rows, row_numel)``, is cut into ``N`` chunks of ``chunk_rows`` rows;
    this rank owns rows ``[start_row, start_row + num_rows)`` (``num_rows`` may be 0 when ``rows < N``). In its
    bucket's per-rank chunk, the tensor's (padded) chunk starts at element ``offset``.
    """

    name: str
    param: nn.Parameter
    rows: int
    row_numel: int
    chunk_rows: int
    start_row: int
    num_rows: int
    bucket: int = -1
    offset: int = 0

    @property
    def chunk_numel(self) -> int:
        """Elements of one (padded) chunk: ``chunk_rows * row_numel``."""
        return self.chunk_rows * self.row_numel

    @property
    def shard_shape(self) -> torch.Size:
        """Shape of this rank's chunk: ``(num_rows, *local_shape[1:])``."""
        return torch.Size((self.num_rows, *local_tensor(self.param).shape[1:]))

    def rows_view(self, t: Tensor) -> Tensor:
        """``t`` (the parameter's local shape, contiguous) as ``(rows, row_numel)``."""
        return t.view(self.rows, self.row_numel)

    def own_rows(self, t: Tensor) -> Tensor:
        """This rank's chunk of ``t`` (a tensor of the parameter's local shape), a view ``(num_rows, *shape[1:])``."""
        return self.rows_view(t)[self.start_row : self.start_row + self.num_rows].view(self.shard_shape)


@dataclass
class LayoutBucket:
    """Tensors that travel in one collective. ``chunk_numel`` elements per rank; ``shard_offset`` is where this
    bucket's chunk starts in a rank's flat shard of the whole layout."""

    index: int
    shards: list[ParamShard]
    chunk_numel: int
    shard_offset: int
    dtype: torch.dtype
    device: torch.device
    numel_unpadded: int = 0
    extra: dict = field(default_factory=dict)


class ShardLayout:
    """Dim-0 chunking of ``named_params`` over the ``N`` ranks of ``group``, packed in buckets.

    Args:
        named_params: ``(name, parameter)`` pairs (plain tensors or DTensors), those with ``requires_grad``.
        group: the data-parallel process group.
        bucket_cap_mb: bucket size in MiB of the unsharded tensors (each bucket's collective moves about this much).

    Raises:
        ValueError: no parameter, a 0-dim or non-contiguous parameter (it cannot be cut along dim 0), parameters
            whose local tensors differ in device, or ``bucket_cap_mb <= 0``.
    """

    def __init__(
        self, named_params: list[tuple[str, nn.Parameter]], group: dist.ProcessGroup, bucket_cap_mb: float
    ) -> None:
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r} is not valid: expected a number > 0 (MiB).")
        named_params = [(n, p) for n, p in named_params if p.requires_grad]
        if not named_params:
            raise ValueError("The model has no parameter that requires a gradient: ZeRO has nothing to shard.")
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.shards: list[ParamShard] = []
        for name, p in named_params:
            local = local_tensor(p)
            if local.dim() == 0:
                raise ValueError(
                    f"Parameter {name!r} is 0-dimensional: ZeRO shards along dim 0. Store it with shape (1,)."
                )
            if not local.is_contiguous():
                raise ValueError(f"Parameter {name!r} is not contiguous: ZeRO shards need contiguous parameters.")
            rows = local.shape[0]
            chunk_rows = -(-rows // self.world)
            start = min(self.rank * chunk_rows, rows)
            num = max(0, min(start + chunk_rows, rows) - start)
            self.shards.append(ParamShard(name, p, rows, local.numel() // rows, chunk_rows, start, num))
        self.by_param: dict[int, ParamShard] = {id(s.param): s for s in self.shards}
        self.by_name: dict[str, ParamShard] = {s.name: s for s in self.shards}
        self._build_buckets(int(bucket_cap_mb * _MiB))

    def _build_buckets(self, cap_bytes: int) -> None:
        self.buckets: list[LayoutBucket] = []
        current: list[ParamShard] = []
        size = 0
        for s in reversed(self.shards):
            local = local_tensor(s.param)
            nbytes = local.numel() * local.element_size()
            first = local_tensor(current[0].param) if current else local
            same_kind = first.dtype == local.dtype and first.device == local.device
            if current and (size + nbytes > cap_bytes or not same_kind):
                self._add_bucket(current)
                current, size = [], 0
            current.append(s)
            size += nbytes
        if current:
            self._add_bucket(current)

    def _add_bucket(self, shards: list[ParamShard]) -> None:
        index = len(self.buckets)
        offset = 0
        for s in shards:
            s.bucket, s.offset = index, offset
            offset += s.chunk_numel
        first = local_tensor(shards[0].param)
        shard_offset = sum(b.chunk_numel for b in self.buckets)
        unpadded = sum(local_tensor(s.param).numel() for s in shards)
        self.buckets.append(LayoutBucket(index, shards, offset, shard_offset, first.dtype, first.device, unpadded))

    # ------------------------------------------------------------------ sizes
    @property
    def shard_numel(self) -> int:
        """Elements of this rank's flat shard of the whole layout (padded chunks, the same on every rank)."""
        return sum(b.chunk_numel for b in self.buckets)

    @property
    def numel(self) -> int:
        """Elements of all the (local) parameters, unpadded: the paper's ``Psi`` for this model replica."""
        return sum(local_tensor(s.param).numel() for s in self.shards)

    # ------------------------------------------------------------------ copy-in / copy-out
    def chunk_slot(self, buffer: Tensor, s: ParamShard) -> Tensor:
        """The slot of tensor ``s`` in a rank-major bucket ``buffer`` of ``N * chunk_numel`` elements, as a view
        ``(N, chunk_rows, row_numel)``: ``[j]`` is chunk ``j`` (zero-padded)."""
        b = self.buckets[s.bucket]
        return buffer.view(self.world, b.chunk_numel)[:, s.offset : s.offset + s.chunk_numel].view(
            self.world, s.chunk_rows, s.row_numel
        )

    def _chunk_bounds(self, s: ParamShard) -> list[tuple[int, int]]:
        return [(min(j * s.chunk_rows, s.rows), min((j + 1) * s.chunk_rows, s.rows)) for j in range(self.world)]

    def copy_in(self, buffer: Tensor, s: ParamShard, full: Tensor) -> None:
        """Scatter ``full`` (the parameter's local shape) into its chunks of the rank-major ``buffer``; padding rows
        are zeroed. Casts to the buffer's dtype."""
        slot = self.chunk_slot(buffer, s)
        rows = s.rows_view(full)
        if s.rows == self.world * s.chunk_rows:
            slot.copy_(rows.view(self.world, s.chunk_rows, s.row_numel))
            return
        for j, (lo, hi) in enumerate(self._chunk_bounds(s)):
            slot[j, : hi - lo].copy_(rows[lo:hi])
            slot[j, hi - lo :].zero_()

    def copy_out(self, buffer: Tensor, s: ParamShard, full: Tensor) -> None:
        """Write the chunks of ``s`` held in the rank-major ``buffer`` into ``full`` (the parameter's local shape),
        casting to its dtype."""
        slot = self.chunk_slot(buffer, s)
        rows = s.rows_view(full)
        if s.rows == self.world * s.chunk_rows:
            rows.view(self.world, s.chunk_rows, s.row_numel).copy_(slot)
            return
        for j, (lo, hi) in enumerate(self._chunk_bounds(s)):
            rows[lo:hi].copy_(slot[j, : hi - lo])

    def own_chunk(self, chunk: Tensor, s: ParamShard) -> Tensor:
        """This rank's rows of ``s`` inside its bucket ``chunk`` (``(chunk_numel,)`` of the bucket), as
        ``(num_rows, *shape[1:])``."""
        return chunk[s.offset : s.offset + s.num_rows * s.row_numel].view(s.shard_shape)
