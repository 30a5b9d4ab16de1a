"""The two collectives of ZeRO stages 1 and 2 over a :class:`~lightning_par.data_parallel.shard_layout.ShardLayout`.

* :class:`ReduceScatterReducer` (stage 2, Rajbhandari et al., SC'20, §5.2 "P_os+g"): as backward produces each
  gradient, it is copied into its bucket's rank-major buffer and the parameter's full gradient is freed; when a bucket
  is complete its ``reduce_scatter_tensor`` is launched asynchronously (overlapping the rest of backward, as torch DDP's
  all-reduce does, Li et al., VLDB 2020, §3.2) and lands directly in this rank's persistent gradient shard of
  ``Psi / N`` elements. A bucket's buffer is freed as soon as its reduce-scatter has landed: before the buffer of a
  new bucket is allocated, every launched bucket but the newest ``max_buckets_in_flight`` is waited for and freed, so
  gradient memory never exceeds the shard plus ``max_buckets_in_flight + 1`` buckets (the paper's "constant buffers",
  §6.1), plus the one parameter gradient autograd has just produced.
* :class:`ParamGather` (stages 1 and 2): after each rank has stepped its shard, one ``all_gather_into_tensor`` per
  bucket rebuilds every full parameter on every rank. All buckets are launched at once; each is copied out when it
  is waited for, either at once (:meth:`ParamGather.gather`) or later, bucket by bucket (:meth:`ParamGather.launch`
  then :meth:`ParamGather.wait`), e.g. just before the module that uses it runs its next forward.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_par.data_parallel.reducer import CommStats
from lightning_par.compat import foreach_copy_, local_tensor
from lightning_par.data_parallel.shard_layout import LayoutBucket, ParamShard, ShardLayout
from lightning_par.memory import LiveStorageBytes

__all__ = ["ParamGather", "ReduceScatterReducer", "all_gather_params"]

# torch 2.13 renamed the tensor forms of the two collectives; older versions only have the old names.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ReduceScatterReducer:
    """Average gradients over the dp group with bucketed reduce-scatters launched during backward; keep a shard.

    Every backward (every micro-batch, also under gradient accumulation) reduce-scatters its gradients and adds them
    to the shard, so full gradients never outlive their bucket: gradient memory stays ``Psi / N`` elements plus at
    most ``max_buckets_in_flight + 1`` bucket buffers, at the price of one reduce-scatter per micro-batch.
    :meth:`reset` after the optimizer step starts a new accumulation. With :attr:`require_sync` off the hooks do
    nothing (full gradients accumulate in ``.grad``, e.g. across the micro-batches of a pipeline schedule) until
    :meth:`reduce_all`.

    Args:
        layout: the dim-0 sharding and buckets of the parameters.
        reduce_dtype: dtype the gradients travel and are summed in (default: each bucket's parameter dtype).
        grad_dtype: dtype of the kept gradient shard (default: the parameter dtype; fp32 under mixed precision so
            the fp32 master weights get an fp32 gradient).
        max_buckets_in_flight: reduce-scatters left running when a new bucket starts filling (1: one bucket's
            communication overlaps the next bucket's backward; 0: each is waited for first, no overlap, one bucket of
            memory).
        measure_memory: count the gradient storages (shard, bucket buffers, parameter gradients) alive at every
            event in :attr:`grad_memory` (costs a little Python per gradient; for tests and benchmarks).
        replicate_group: HSDP's replicas of this shard group (``dp_replicate``): each landed chunk is all-reduced
            over it (the gradients were divided by the whole data-parallel size on the way in), so the shard holds
            the average over every data-parallel rank. ``bytes_sent`` then also counts that all-reduce's input.

    Attributes:
        grad_shard: ``(layout.shard_numel,)`` tensor, this rank's averaged gradient chunks of every bucket, or
            ``None`` before the first backward.
        history: :class:`~lightning_par.data_parallel.reducer.CommStats` of every backward; ``bytes_sent`` counts
            each reduce-scatter's input buffer (payload handed to the collective, wire dtype).
        grad_memory: with ``measure_memory``, a :class:`~lightning_par.memory.LiveStorageBytes` whose ``peak`` is the
            most gradient bytes alive at once (else ``None``).

    Raises:
        ValueError: ``max_buckets_in_flight`` is not an integer >= 0.
    """

    def __init__(
        self,
        layout: ShardLayout,
        reduce_dtype: torch.dtype | None = None,
        grad_dtype: torch.dtype | None = None,
        max_buckets_in_flight: int = 1,
        measure_memory: bool = False,
        replicate_group: dist.ProcessGroup | None = None,
    ) -> None:
        if isinstance(max_buckets_in_flight, bool) or not isinstance(max_buckets_in_flight, int) or (
            max_buckets_in_flight < 0
        ):
            raise ValueError(f"max_buckets_in_flight={max_buckets_in_flight!r} is not valid: expected an integer >= 0.")
        self.layout = layout
        self.group = layout.group
        self.world = layout.world
        self.replicate_group = replicate_group
        replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        #: the average is over every replica's shard group: each gradient is divided by this on its way in.
        self.divisor = self.world * replicas
        self.reduce_dtype = reduce_dtype
        self.grad_dtype = grad_dtype or layout.buckets[0].dtype
        self.max_buckets_in_flight = max_buckets_in_flight
        self.grad_shard: Tensor | None = None
        self.grad_memory = LiveStorageBytes() if measure_memory else None
        self.require_sync = True
        self.history: list[CommStats] = []
        self._accumulating = False
        self._stats = CommStats()
        self._reset_buckets()
        # Where each unpadded tensor's chunks sit in its bucket's rank-major buffer: (N, chunk_rows, row_numel) with
        # the bucket's per-rank stride, computed once (the buffers themselves are new every backward).
        self._slots: dict[int, tuple[tuple[int, ...], tuple[int, ...], int]] = {}
        for s in layout.shards:
            if s.rows == self.world * s.chunk_rows:
                b = layout.buckets[s.bucket]
                self._slots[id(s.param)] = (
                    (self.world, s.chunk_rows, s.row_numel), (b.chunk_numel, s.row_numel, 1), s.offset
                )
        self._handles = [s.param.register_post_accumulate_grad_hook(self._on_grad_ready) for s in layout.shards]

    def _reset_buckets(self) -> None:
        n = len(self.layout.buckets)
        self._buffers: list[Tensor | None] = [None] * n
        self._arrived: list[set[int]] = [set() for _ in range(n)]
        self._launched = [False] * n
        self._next_launch = 0
        self._in_flight: deque[tuple[int, object, Tensor]] = deque()
        self._launch_time = [0.0] * n
        self._done_time: list[float | None] = [None] * n

    def _wire_dtype(self, bucket: LayoutBucket) -> torch.dtype:
        return self.reduce_dtype or bucket.dtype

    def _ensure_shard(self) -> Tensor:
        if self.grad_shard is None:
            self.grad_shard = torch.zeros(
                self.layout.shard_numel, dtype=self.grad_dtype, device=self.layout.buckets[0].device
            )
            if self.grad_memory is not None:
                self.grad_memory.add(self.grad_shard)
        return self.grad_shard

    def _buffer(self, bucket: LayoutBucket) -> Tensor:
        buf = self._buffers[bucket.index]
        if buf is None:
            # Free what has landed before this bucket's buffer exists: at most max_buckets_in_flight stay out.
            while len(self._in_flight) > self.max_buckets_in_flight:
                self._land_oldest()
            buf = torch.empty(self.world * bucket.chunk_numel, dtype=self._wire_dtype(bucket), device=bucket.device)
            self._buffers[bucket.index] = buf
            if self.grad_memory is not None:
                self.grad_memory.add(buf)
        return buf

    # ------------------------------------------------------------------ backward
    def start_backward(self) -> None:
        """Mark the start of a backward pass (for the overlap measurement)."""
        self._stats = CommStats(backward_start=time.perf_counter())

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        # One call per parameter per backward. Autograd runs hooks with grad mode off unless
        # backward(create_graph=True); a no_grad decorator costs 1.7 us a call.
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self._on_grad_ready(param)
        if not self.require_sync or param.grad is None:
            return
        s = self.layout.by_param[id(param)]
        bucket = self.layout.buckets[s.bucket]
        if self.grad_memory is not None:
            self.grad_memory.add(param.grad)
        buf, grad = self._buffer(bucket), local_tensor(param.grad)
        fast = self._slots.get(id(param))
        # The average's division happens on the way into the buffer (one pass over the gradient, not a copy and then
        # a division of the whole buffer).
        if fast is not None:  # no padding: the slot is one strided view of the buffer, the gradient one reshape
            size, stride, offset = fast
            torch.div(grad.view(size), self.divisor, out=buf.as_strided(size, stride, offset))
        else:
            self.layout.copy_in(buf, s, grad)
            self.layout.chunk_slot(buf, s).div_(self.divisor)
        param.grad = None  # the full gradient is not kept: ZeRO-2
        self._stats.backward_end = time.perf_counter()
        self._arrived[bucket.index].add(id(param))
        if len(self._arrived[bucket.index]) == len(bucket.shards):
            self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        """Launch buckets in index order up to the first incomplete one (all if ``force``), so every rank issues
        the same collectives in the same order."""
        buckets = self.layout.buckets
        while self._next_launch < len(buckets):
            bucket = buckets[self._next_launch]
            if not force and len(self._arrived[bucket.index]) < len(bucket.shards):
                return
            self._launch(bucket)
            self._next_launch += 1

    def _launch(self, bucket: LayoutBucket) -> None:
        buf = self._buffer(bucket)
        arrived = self._arrived[bucket.index]
        if len(arrived) < len(bucket.shards):  # parameters that got no gradient on this rank contribute zeros
            for s in bucket.shards:
                if id(s.param) not in arrived:
                    self.layout.chunk_slot(buf, s).zero_()
        shard = self._ensure_shard()
        target = shard[bucket.shard_offset : bucket.shard_offset + bucket.chunk_numel]
        if self._accumulating or buf.dtype != shard.dtype:
            out = torch.empty(bucket.chunk_numel, dtype=buf.dtype, device=buf.device)
            if self.grad_memory is not None:
                self.grad_memory.add(out)
        else:
            out = target  # lands in the shard directly
        self._launched[bucket.index] = True
        self._launch_time[bucket.index] = time.perf_counter()
        self._stats.bytes_sent += buf.numel() * buf.element_size()
        work = _reduce_scatter_tensor(out, buf, group=self.group, async_op=True)
        self._in_flight.append((bucket.index, work, out))

    def _land_oldest(self) -> None:
        """Wait for the oldest reduce-scatter in flight, add it to the shard if needed and free its buffer."""
        index, work, out = self._in_flight.popleft()
        work.wait()
        if self.replicate_group is not None:  # HSDP: sum the replicas' reduced chunks (each already divided)
            self._stats.bytes_sent += out.numel() * out.element_size()
            dist.all_reduce(out, group=self.replicate_group)
        self._done_time[index] = time.perf_counter()
        bucket = self.layout.buckets[index]
        assert self.grad_shard is not None
        target = self.grad_shard[bucket.shard_offset : bucket.shard_offset + bucket.chunk_numel]
        if out.data_ptr() != target.data_ptr():
            if self._accumulating:
                target.add_(out)
            else:
                target.copy_(out)
        self._buffers[index] = None  # the bucket's memory goes back now

    @torch.no_grad()
    def finish(self) -> CommStats:
        """Wait for every bucket after backward; the averaged chunks are then in :attr:`grad_shard`."""
        start = time.perf_counter()
        stats = self._stats
        if stats.backward_end == 0.0:  # no gradient hook ran on this rank
            stats.backward_end = start
        self._launch_ready(force=True)
        while self._in_flight:
            self._land_oldest()
        stats.exposed_s = time.perf_counter() - start
        for bucket in self.layout.buckets:
            stats.launches.append(self._launch_time[bucket.index])
            done = self._done_time[bucket.index]
            stats.completions.append(done if done is not None else time.perf_counter())
        self._accumulating = True
        self._reset_buckets()
        self.history.append(stats)
        return stats

    def reduce_all(self) -> CommStats:
        """Reduce-scatter every current ``.grad`` now, without overlap, and free them (for callers that run backward
        in pieces with :attr:`require_sync` off, such as a pipeline schedule, and synchronise once at the end)."""
        sync = self.require_sync
        self.require_sync = True
        try:
            start = time.perf_counter()
            self.start_backward()
            for s in self.layout.shards:
                if s.param.grad is not None:
                    self._on_grad_ready(s.param)
            stats = self.finish()
            stats.exposed_s = time.perf_counter() - start  # nothing overlapped: all of it is exposed
            return stats
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


class ParamGather:
    """Rebuild the full (local) parameters on every rank from each rank's updated rows: one all-gather per bucket.

    Args:
        layout: the sharding.
        source: ``source(s)`` is this rank's updated rows of ``s`` ``(num_rows, *shape[1:])`` (a master shard,
            possibly in another dtype: it is cast to the parameter dtype).

    Attributes:
        bytes_per_gather: bytes handed to the all-gathers as output buffers by the last :meth:`launch` (the full
            bucket sizes in the parameter dtype).
    """

    def __init__(self, layout: ShardLayout, source: Callable[[ParamShard], Tensor]) -> None:
        self.layout = layout
        self.source = source
        self.bytes_per_gather = 0
        self._pending: dict[int, tuple[Tensor, object]] = {}
        self._plans: dict[int, _GatherPlan] = {}

    @property
    def pending(self) -> bool:
        """Whether some launched bucket has not been copied out yet."""
        return bool(self._pending)

    def buffers(self) -> list[Tensor]:
        """The persistent per-bucket send buffers (this rank's chunks, ``Psi / N`` elements in all)."""
        return [plan.chunk for plan in self._plans.values()]

    def _plan(self, bucket: LayoutBucket) -> _GatherPlan:
        plan = self._plans.get(bucket.index)
        if plan is None or not plan.valid():
            plan = self._plans[bucket.index] = _GatherPlan(self.layout, bucket, self.source)
        return plan

    @torch.no_grad()
    def launch(self, buckets: Iterable[LayoutBucket] | None = None) -> None:
        """Start the all-gathers of ``buckets`` (default: all), in the given order; :meth:`wait` completes them."""
        layout = self.layout
        self.bytes_per_gather = 0
        for bucket in layout.buckets if buckets is None else buckets:
            if bucket.index in self._pending:
                self.wait([bucket])
            plan = self._plan(bucket)
            if plan.in_dsts:
                foreach_copy_(plan.in_dsts, plan.in_srcs)
            out = torch.empty(layout.world * bucket.chunk_numel, dtype=bucket.dtype, device=bucket.device)
            work = _all_gather_tensor(out, plan.chunk, group=layout.group, async_op=True)
            self.bytes_per_gather += out.numel() * out.element_size()
            self._pending[bucket.index] = (out, work)

    @torch.no_grad()
    def wait(self, buckets: Iterable[LayoutBucket] | None = None) -> None:
        """Wait for the all-gathers of ``buckets`` (default: every pending one) and write them into the parameters."""
        indices = list(self._pending) if buckets is None else [b.index for b in buckets if b.index in self._pending]
        layout = self.layout
        for index in indices:
            out, work = self._pending.pop(index)
            work.wait()
            plan = self._plan(layout.buckets[index])
            slots = out.view(layout.world, -1).split(plan.sizes, dim=1)  # (N, chunk_numel of each tensor)
            if plan.out_dsts:
                foreach_copy_(plan.out_dsts, [slots[i] for i in plan.even])
            for i in plan.uneven:
                s = plan.shards[i]
                layout.copy_out(out, s, local_tensor(s.param).data)

    def gather(self, buckets: Iterable[LayoutBucket] | None = None) -> int:
        """:meth:`launch` then :meth:`wait`; returns :attr:`bytes_per_gather`."""
        buckets = list(self.layout.buckets if buckets is None else buckets)
        self.launch(buckets)
        self.wait(buckets)
        return self.bytes_per_gather


class _GatherPlan:
    """What one bucket's gather touches, computed once: the persistent send buffer and its views (copy-in), and the
    parameters' storage seen as ``(N, chunk_numel)`` (copy-out), so a step costs one call per bucket for each copy.
    Rebuilt if a parameter's storage moved (:meth:`valid`)."""

    def __init__(self, layout: ShardLayout, bucket: LayoutBucket, source: Callable[[ParamShard], Tensor]) -> None:
        self.shards = list(bucket.shards)
        self.chunk = torch.zeros(bucket.chunk_numel, dtype=bucket.dtype, device=bucket.device)  # padding stays 0
        self.in_dsts = [layout.own_chunk(self.chunk, s) for s in self.shards if s.num_rows]
        self.in_srcs = [source(s) for s in self.shards if s.num_rows]
        self.sizes = [s.chunk_numel for s in self.shards]
        self.even = [i for i, s in enumerate(self.shards) if s.rows == layout.world * s.chunk_rows]
        self.uneven = [i for i, s in enumerate(self.shards) if s.rows != layout.world * s.chunk_rows]
        self.out_dsts = [
            s.rows_view(local_tensor(s.param).detach()).view(layout.world, s.chunk_numel)
            for s in (self.shards[i] for i in self.even)
        ]
        self._ptrs = self._pointers()

    def _pointers(self) -> list[int]:
        return [local_tensor(s.param).data_ptr() for s in self.shards]

    def valid(self) -> bool:
        return self._pointers() == self._ptrs

def all_gather_params(
    layout: ShardLayout, source: Callable[[ParamShard], Tensor], buckets: Iterable[LayoutBucket] | None = None
) -> int:
    """Rebuild the full (local) parameters of ``buckets`` (default: all) on every rank from each rank's updated rows
    (``source(s)``, see :class:`ParamGather`); returns the bytes handed to the all-gathers as output buffers."""
    return ParamGather(layout, source).gather(buckets)
