"""The two collectives of ZeRO stages 1 and 2 over a :class:`~lightning_par.data_parallel.shard_layout.ShardLayout`.

* :class:`ReduceScatterReducer` (stage 2, Rajbhandari et al., SC'20, §5.2 "P_os+g"): as backward produces each
  gradient, it is copied into its bucket's rank-major buffer and the parameter's full gradient is freed; when a bucket
  is complete its ``reduce_scatter_tensor`` is launched asynchronously (overlapping the rest of backward, as torch DDP's
  all-reduce does, Li et al., VLDB 2020, §3.2), and each rank adds the averaged chunk to its persistent gradient shard
  of ``Psi / N`` elements. Only bucket-sized buffers are alive at once: the paper's "constant buffers" (§6.1).
* :func:`all_gather_params` (stages 1 and 2): after each rank has stepped its shard, one ``all_gather_into_tensor``
  per bucket rebuilds every full parameter on every rank; the next bucket's all-gather is in flight while the
  previous one is copied out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_par.data_parallel.reducer import CommStats
from lightning_par.data_parallel.shard_layout import LayoutBucket, ParamShard, ShardLayout, local_tensor

__all__ = ["ReduceScatterReducer", "all_gather_params"]

# torch 2.13 renamed the tensor forms of the two collectives; older versions only have the old names.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ReduceScatterReducer:
    """Average gradients over the dp group with bucketed reduce-scatters launched during backward; keep a shard.

    Every backward (every micro-batch, also under gradient accumulation) reduce-scatters its gradients and adds them
    to the shard, so full gradients never outlive their bucket: gradient memory stays ``Psi / N`` elements (plus
    one bucket in flight) at the price of one reduce-scatter per micro-batch. :meth:`reset` after the optimizer step
    starts a new accumulation. With :attr:`require_sync` off the hooks do nothing (full gradients accumulate in
    ``.grad``, e.g. across the micro-batches of a pipeline schedule) until :meth:`reduce_all`.

    Args:
        layout: the dim-0 sharding and buckets of the parameters.
        reduce_dtype: dtype the gradients travel and are summed in (default: each bucket's parameter dtype).
        grad_dtype: dtype of the kept gradient shard (default: the parameter dtype; fp32 under mixed precision so
            the fp32 master weights get an fp32 gradient).

    Attributes:
        grad_shard: ``(layout.shard_numel,)`` tensor, this rank's averaged gradient chunks of every bucket, or
            ``None`` before the first backward.
        history: :class:`~lightning_par.data_parallel.reducer.CommStats` of every backward; ``bytes_sent`` counts
            each reduce-scatter's input buffer (payload handed to the collective, wire dtype).
    """

    def __init__(
        self, layout: ShardLayout, reduce_dtype: torch.dtype | None = None, grad_dtype: torch.dtype | None = None
    ) -> None:
        self.layout = layout
        self.group = layout.group
        self.world = layout.world
        self.reduce_dtype = reduce_dtype
        self.grad_dtype = grad_dtype or layout.buckets[0].dtype
        self.grad_shard: Tensor | None = None
        self.require_sync = True
        self.history: list[CommStats] = []
        self._accumulating = False
        self._stats = CommStats()
        self._reset_buckets()
        self._handles = [
            s.param.register_post_accumulate_grad_hook(self._on_grad_ready) for s in layout.shards
        ]

    def _reset_buckets(self) -> None:
        n = len(self.layout.buckets)
        self._buffers: list[Tensor | None] = [None] * n
        self._arrived: list[set[int]] = [set() for _ in range(n)]
        self._launched = [False] * n
        self._work: list[tuple[object, Tensor] | None] = [None] * n
        self._launch_time = [0.0] * n
        self._done_time: list[float | None] = [None] * n

    def _dtype(self, bucket: LayoutBucket) -> torch.dtype:
        return self.reduce_dtype or bucket.dtype

    def _buffer(self, bucket: LayoutBucket) -> Tensor:
        buf = self._buffers[bucket.index]
        if buf is None:
            buf = torch.zeros(self.world * bucket.chunk_numel, dtype=self._dtype(bucket), device=bucket.device)
            self._buffers[bucket.index] = buf
        return buf

    # ------------------------------------------------------------------ backward
    def start_backward(self) -> None:
        """Mark the start of a backward pass (for the overlap measurement)."""
        self._stats = CommStats(backward_start=time.perf_counter())

    @torch.no_grad()
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self.require_sync or param.grad is None:
            return
        s = self.layout.by_param[id(param)]
        bucket = self.layout.buckets[s.bucket]
        self.layout.copy_in(self._buffer(bucket), s, local_tensor(param.grad))
        param.grad = None  # the full gradient is not kept: ZeRO-2
        self._stats.backward_end = time.perf_counter()
        self._arrived[bucket.index].add(id(param))
        if len(self._arrived[bucket.index]) == len(bucket.shards):
            self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        """Launch buckets in index order up to the first incomplete one (all if ``force``), so every rank issues
        the same collectives in the same order."""
        for bucket in self.layout.buckets:
            if self._launched[bucket.index]:
                continue
            if not force and len(self._arrived[bucket.index]) < len(bucket.shards):
                return
            self._launch(bucket)

    def _launch(self, bucket: LayoutBucket) -> None:
        # A fresh zero buffer each backward: parameters that got no gradient on this rank contribute zeros.
        buf = self._buffer(bucket)
        buf.div_(self.world)
        out = torch.empty(bucket.chunk_numel, dtype=buf.dtype, device=buf.device)
        self._launched[bucket.index] = True
        self._launch_time[bucket.index] = time.perf_counter()
        self._stats.bytes_sent += buf.numel() * buf.element_size()
        work = _reduce_scatter_tensor(out, buf, group=self.group, async_op=True)

        def _done(_fut: object, i: int = bucket.index) -> None:
            self._done_time[i] = time.perf_counter()

        try:
            work.get_future().add_done_callback(_done)
        except RuntimeError:  # gloo's reduce-scatter has no future: completion is then timed at wait()
            pass
        self._work[bucket.index] = (work, out)

    @torch.no_grad()
    def finish(self) -> CommStats:
        """Wait for every bucket after backward and add the averaged chunks to :attr:`grad_shard`."""
        stats = self._stats
        if stats.backward_end == 0.0:  # no gradient hook ran on this rank
            stats.backward_end = time.perf_counter()
        self._launch_ready(force=True)
        if self.grad_shard is None:
            self.grad_shard = torch.zeros(
                self.layout.shard_numel, dtype=self.grad_dtype, device=self.layout.buckets[0].device
            )
        for bucket in self.layout.buckets:
            work, out = self._work[bucket.index]
            work.wait()
            chunk = self.grad_shard[bucket.shard_offset : bucket.shard_offset + bucket.chunk_numel]
            if self._accumulating:
                chunk.add_(out)
            else:
                chunk.copy_(out)
            stats.launches.append(self._launch_time[bucket.index])
            done = self._done_time[bucket.index]
            stats.completions.append(done if done is not None else time.perf_counter())
        self._accumulating = True
        self._reset_buckets()  # frees the bucket buffers
        self.history.append(stats)
        return stats

    def reduce_all(self) -> CommStats:
        """Reduce-scatter every current ``.grad`` now, without overlap, and free them (for callers that run backward
        in pieces with :attr:`require_sync` off, such as a pipeline schedule, and synchronise once at the end)."""
        sync = self.require_sync
        self.require_sync = True
        try:
            self.start_backward()
            for s in self.layout.shards:
                if s.param.grad is not None:
                    self._on_grad_ready(s.param)
            return self.finish()
        finally:
            self.require_sync = sync

    def shard_grad(self, s: ParamShard) -> Tensor:
        """This rank's averaged gradient rows of ``s``, a view ``(num_rows, *shape[1:])`` into :attr:`grad_shard`."""
        assert self.grad_shard is not None, "shard_grad before the first backward"
        bucket = self.layout.buckets[s.bucket]
        return self.layout.own_chunk(
            self.grad_shard[bucket.shard_offset : bucket.shard_offset + bucket.chunk_numel], s
        )

    def reset(self) -> None:
        """Start a new accumulation: the next backward overwrites the shard instead of adding to it."""
        self._accumulating = False

    def remove_hooks(self) -> None:
        """Detach from the parameters (the reducer is then inert)."""
        for h in self._handles:
            h.remove()
        self._handles = []


@torch.no_grad()
def all_gather_params(
    layout: ShardLayout, source: Callable[[ParamShard], Tensor], buckets: Iterable[LayoutBucket] | None = None
) -> int:
    """Rebuild the full (local) parameters of ``buckets`` on every rank from each rank's updated rows.

    Args:
        layout: the sharding.
        source: ``source(s)`` is this rank's updated rows of ``s`` ``(num_rows, *shape[1:])`` (a master shard,
            possibly in another dtype: it is cast to the parameter dtype).
        buckets: the buckets to gather (default: all).

    Returns:
        Bytes handed to the all-gathers as output buffers on this rank (the full bucket sizes, parameter dtype).
    """
    nbytes = 0
    pending: tuple[LayoutBucket, Tensor, object] | None = None
    for bucket in list(layout.buckets if buckets is None else buckets):
        chunk = torch.zeros(bucket.chunk_numel, dtype=bucket.dtype, device=bucket.device)
        for s in bucket.shards:
            if s.num_rows:
                layout.own_chunk(chunk, s).copy_(source(s))
        out = torch.empty(layout.world * bucket.chunk_numel, dtype=bucket.dtype, device=bucket.device)
        work = _all_gather_tensor(out, chunk, group=layout.group, async_op=True)
        nbytes += out.numel() * out.element_size()
        if pending is not None:
            _copy_out(layout, *pending)
        pending = (bucket, out, work)
    if pending is not None:
        _copy_out(layout, *pending)
    return nbytes


def _copy_out(layout: ShardLayout, bucket: LayoutBucket, out: Tensor, work: object) -> None:
    work.wait()
    for s in bucket.shards:
        layout.copy_out(out, s, local_tensor(s.param).data)
