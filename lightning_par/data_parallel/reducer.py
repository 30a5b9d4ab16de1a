"""Bucketed gradient all-reduce launched during backward, over any process group.

This is the data-parallel engine of ``ddp_overlap`` and of the dp axis in 2D/3D layouts. torch's
``DistributedDataParallel`` does the same for plain tensors, but it wraps the module, and it does not compose with
DTensor parameters or ``torch.distributed.pipelining`` (it crashes, or trains with silently wrong losses). This
reducer wraps nothing: it registers a post-accumulate-grad hook on each parameter, so it works on the local shard of
a DTensor and on a pipeline stage's parameters alike.

Algorithm (PyTorch DDP, Li et al., VLDB 2020, §3.2): parameters are packed, in reverse registration order (roughly
the order backward produces their gradients), into buckets of at most ``bucket_cap_mb`` MiB. When the last gradient
of a bucket is ready, the bucket's flat buffer is all-reduced asynchronously while backward keeps computing the
gradients of earlier layers. Buckets are launched strictly in index order, so every rank issues the same collectives
in the same order even when hooks fire in a different order. ``finish()`` waits for the rest after backward.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_par.compat import foreach_copy_, local_tensor
from lightning_par.data_parallel.compression import CAST_DTYPES, PowerSGDState
from lightning_par.data_parallel.options import ReducerOptions

__all__ = ["Bucket", "CommStats", "GradientReducer", "reducer_options"]

_MiB = 1024 * 1024
_FIRST_BUCKET_BYTES = _MiB


def reducer_options(**options: Any) -> dict[str, Any]:
    """:class:`GradientReducer`'s options validated, with their defaults, by
    :class:`~lightning_par.data_parallel.options.ReducerOptions` (the one place that checks them), as keyword
    arguments.

    Raises:
        ValueError: an invalid option; the message names it, its value and what would be valid.
        TypeError: an unknown option.
    """
    return ReducerOptions(**options).reducer_kwargs()


@dataclass
class Bucket:
    """Parameters whose gradients travel in one all-reduce, and the flat buffer ``(numel,)`` that carries them."""

    index: int
    params: list[nn.Parameter]
    offsets: list[int]
    buffer: Tensor
    #: each parameter's slot in ``buffer``, shaped like its local tensor (built once: the buffer lives as long).
    views: list[Tensor] = field(default_factory=list)
    #: whether each parameter is a DTensor (its gradient's local tensor is what travels).
    is_dtensor: list[bool] = field(default_factory=list)
    arrived: set[int] = field(default_factory=set)
    launched: bool = False
    work: object | None = None
    wire: Tensor | None = None
    launch_time: float = 0.0
    done_time: float | None = None

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


@dataclass
class CommStats:
    """Timings of one synchronised backward, in seconds of ``time.perf_counter``.

    ``backward_end`` is when the last gradient hook of the step ran (the end of backward's computation).
    ``exposed_s`` is how long the step waited for communication after backward (``finish()``: launching what was
    left, waiting for every bucket and writing the results back): the communication time overlap did *not* hide.
    ``latency_share_before_backward_end`` is the share of the buckets' latency (launch to completion, summed over
    buckets) that elapsed before backward ended. It is *not* the time overlap saved: a collective that runs while
    backward computes may slow backward down as much (on a CPU the two share the cores), which only an A/B
    measurement shows (``lightning_par.benchmarks.ddp``). ``overlap_fraction`` is its old name. ``bytes_sent`` counts
    the payload handed to the collectives (wire dtype), per rank.
    """

    backward_start: float = 0.0
    backward_end: float = 0.0
    launches: list[float] = field(default_factory=list)
    completions: list[float] = field(default_factory=list)
    bytes_sent: int = 0
    exposed_s: float = 0.0

    @property
    def comm_time_s(self) -> float:
        return sum(max(0.0, d - s) for s, d in zip(self.launches, self.completions))

    @property
    def hidden_time_s(self) -> float:
        return sum(max(0.0, min(d, self.backward_end) - s) for s, d in zip(self.launches, self.completions))

    @property
    def latency_share_before_backward_end(self) -> float:
        total = self.comm_time_s
        return self.hidden_time_s / total if total > 0 else 0.0

    @property
    def overlap_fraction(self) -> float:
        """Old name of :attr:`latency_share_before_backward_end`."""
        return self.latency_share_before_backward_end

    @property
    def first_launch_before_backward_end(self) -> bool:
        return bool(self.launches) and self.launches[0] < self.backward_end


class GradientReducer:
    """Average the gradients of ``params`` over ``group`` with bucketed, overlapped all-reduces.

    The keyword defaults are :class:`~lightning_par.data_parallel.options.ReducerOptions`'s.

    Args:
        params: parameters to reduce (those with ``requires_grad``); plain tensors or DTensors (their local shards
            are reduced, which is what a dp axis beside a tp axis needs).
        group: the data-parallel process group.
        bucket_cap_mb: bucket size in MiB of fp32 gradient (torch DDP's default is 25); the first bucket (the last
            layers' gradients) is capped at 1 MiB, as in DDP, so that communication starts early.
        gradient_as_bucket_view: after reduction, point each plain tensor's ``.grad`` at its slice of the bucket
            instead of copying back, so gradients and buckets share memory (the default; torch's DDP defaults to
            False).
        static_graph: the set and order of gradients is the same every step: after the first synchronised step the
            buckets are rebuilt in the order gradients actually arrived on the group's first rank, the same on
            every rank (DDP's bucket rebuilding), so the first bucket launches as early as possible.
        comm_hook: ``"none"``, ``"fp16"``, ``"bf16"`` (cast the bucket for the wire) or ``"powersgd"``.
        powersgd_rank: rank of the PowerSGD approximation.
        powersgd_start_iter: plain all-reduce steps before PowerSGD starts.

    Raises:
        ValueError: an invalid option (the message names it), or no parameter requires a gradient.
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        group: dist.ProcessGroup,
        *,
        bucket_cap_mb: float = ReducerOptions.bucket_cap_mb,
        gradient_as_bucket_view: bool = ReducerOptions.gradient_as_bucket_view,
        static_graph: bool = ReducerOptions.static_graph,
        comm_hook: str = ReducerOptions.comm_hook,
        powersgd_rank: int = ReducerOptions.powersgd_rank,
        powersgd_start_iter: int = ReducerOptions.powersgd_start_iter,
    ) -> None:
        checked = ReducerOptions(
            bucket_cap_mb, gradient_as_bucket_view, static_graph, comm_hook, powersgd_rank, powersgd_start_iter
        )
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("The model has no parameter that requires a gradient: there is nothing to reduce.")
        self.group = group if group is not None else dist.group.WORLD
        self.world = dist.get_world_size(group)
        self.bucket_cap_bytes = int(checked.bucket_cap_mb * _MiB)
        self.gradient_as_bucket_view = checked.gradient_as_bucket_view
        self.static_graph = checked.static_graph
        self.comm_hook = checked.comm_hook
        self.powersgd = PowerSGDState(powersgd_rank, powersgd_start_iter) if comm_hook == "powersgd" else None
        self.require_sync = True
        self.history: list[CommStats] = []
        self._stats = CommStats()
        self._arrival: list[nn.Parameter] = []
        self._rebuilt = False
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]
        self._build_buckets(list(reversed(self.params)))

    # ------------------------------------------------------------------ buckets
    def _build_buckets(self, order: list[nn.Parameter]) -> None:
        self.buckets: list[Bucket] = []
        self._where: dict[int, tuple[Bucket, int]] = {}
        current: list[nn.Parameter] = []
        size = 0
        for p in order:
            nbytes = local_tensor(p).numel() * 4
            # As torch DDP does, the first bucket is capped at 1 MiB so that communication starts early.
            cap = min(self.bucket_cap_bytes, _FIRST_BUCKET_BYTES) if not self.buckets else self.bucket_cap_bytes
            if current and size + nbytes > cap:
                self._add_bucket(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            self._add_bucket(current)

    def _add_bucket(self, params: list[nn.Parameter]) -> None:
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += local_tensor(p).numel()
        dtype = local_tensor(params[0]).dtype
        buffer = torch.zeros(total, dtype=dtype, device=local_tensor(params[0]).device)
        views = [buffer[o : o + local_tensor(p).numel()].view(local_tensor(p).shape) for o, p in zip(offsets, params)]
        is_dtensor = [isinstance(p, DTensor) for p in params]
        bucket = Bucket(len(self.buckets), params, offsets, buffer, views, is_dtensor)
        for i, p in enumerate(params):
            self._where[id(p)] = (bucket, i)
        self.buckets.append(bucket)
        self._next_launch = 0

    def bucket_sizes_bytes(self) -> list[int]:
        """Size of each bucket's buffer in bytes, in launch order."""
        return [b.nbytes for b in self.buckets]

    # ------------------------------------------------------------------ backward
    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Backward passes inside accumulate gradients locally without communicating (gradient accumulation)."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    def overlap_summary(self) -> dict[str, Any]:
        """Figures of the synchronised backwards so far (the first, with its one-off set-up, left out when there are
        others), empty before the first one:

        * ``comm_latency_share_before_backward_end``: share of the buckets' latency that elapsed before backward
          ended (see :class:`CommStats`; ``comm_overlap_fraction`` is its old name, kept for readers of old
          summaries);
        * ``comm_exposed_s``: median seconds per synchronised backward spent waiting for communication after
          backward (the communication overlap did not hide);
        * ``first_bucket_launched_before_backward_end``, ``comm_bytes_per_step``, ``num_buckets``,
          ``synchronised_backwards``, ``comm_hook``.
        """
        if not self.history:
            return {}
        history = self.history[1:] or self.history
        comm = sum(s.comm_time_s for s in history)
        share = sum(s.hidden_time_s for s in history) / comm if comm > 0 else 0.0
        exposed = sorted(s.exposed_s for s in history)
        return {
            "comm_latency_share_before_backward_end": share,
            "comm_overlap_fraction": share,
            "comm_exposed_s": exposed[len(exposed) // 2],
            "first_bucket_launched_before_backward_end": all(s.first_launch_before_backward_end for s in history),
            "comm_bytes_per_step": history[-1].bytes_sent,
            "num_buckets": len(self.buckets),
            "synchronised_backwards": len(self.history),
            "comm_hook": self.comm_hook,
        }

    def start_backward(self) -> None:
        """Mark the start of a backward pass (for the overlap measurement)."""
        if self.require_sync:
            self._stats = CommStats(backward_start=time.perf_counter())

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        # The hot path: one call per parameter per backward, so it only records the arrival; the gradients are copied
        # into the bucket when it is complete (_launch). Autograd runs hooks with grad mode off unless
        # backward(create_graph=True); a no_grad decorator cost 1.7 us a call here.
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self._on_grad_ready(param)
        if param.grad is None or not self.require_sync:
            return
        bucket, i = self._where[id(param)]
        if self.static_graph and not self._rebuilt:
            self._arrival.append(param)
        self._stats.backward_end = time.perf_counter()
        arrived = bucket.arrived
        arrived.add(i)
        if len(arrived) == len(bucket.params):
            self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        """Launch buckets in index order, up to the first one that is not complete (all of them if ``force``)."""
        buckets = self.buckets
        while self._next_launch < len(buckets):
            bucket = buckets[self._next_launch]
            if not force and len(bucket.arrived) < len(bucket.params):
                return
            self._launch(bucket)
            self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        # Gather the bucket's gradients into its buffer, dividing by the world size on the way (one pass over the
        # memory instead of a copy and then an in-place division: 0.3 ms less backward per step on the small GPT, of
        # 36 ms, as torch DDP's reducer does with mul_out). A parameter that got no gradient this step contributes
        # zeros; one whose .grad already is its slot (gradient_as_bucket_view) is divided in place.
        arrived = bucket.arrived
        divisor = 1 if self.powersgd is not None else self.world  # PowerSGD averages in its own all-reduces
        div = torch.div
        for i, (p, view, is_dtensor) in enumerate(zip(bucket.params, bucket.views, bucket.is_dtensor)):
            if i not in arrived:
                view.zero_()
                continue
            grad = p.grad
            local = local_tensor(grad) if is_dtensor else grad
            if local.data_ptr() != view.data_ptr():
                div(local, divisor, out=view)
            elif divisor != 1:
                view.div_(divisor)
        bucket.launched = True
        bucket.launch_time = time.perf_counter()
        bucket.done_time = None
        if self.powersgd is not None:
            # PowerSGD's second all-reduce depends on the first: it runs in finish(), after backward.
            return
        wire = bucket.buffer.to(CAST_DTYPES[self.comm_hook]) if self.comm_hook in CAST_DTYPES else bucket.buffer
        bucket.wire = wire
        self._stats.bytes_sent += wire.numel() * wire.element_size()
        # The process group's own allreduce (sum, asynchronous), not dist.all_reduce: its argument checks and logging
        # wrapper cost 0.2-0.3 ms per step of 37 ms here (4 buckets, small GPT, dp 2), measured against torch DDP,
        # which calls the process group from C++.
        work = self.group.allreduce([wire])

        def _done(_fut: object, bucket: Bucket = bucket) -> None:
            bucket.done_time = time.perf_counter()

        work.get_future().add_done_callback(_done)
        bucket.work = work

    def finish(self) -> CommStats | None:
        """Wait for every bucket after backward and write the averaged gradients into ``param.grad``.

        Parameters that got no gradient this step count as zeros. Returns the step's :class:`CommStats`, or ``None``
        when synchronisation was off (gradient accumulation).
        """
        if not self.require_sync:
            return None
        start = time.perf_counter()
        stats = self._stats
        if stats.backward_end == 0.0:  # no gradient hook ran on this rank
            stats.backward_end = start
        with torch.no_grad():
            self._launch_ready(force=True)
            for bucket in self.buckets:
                if self.powersgd is not None:
                    self._powersgd_bucket(bucket, stats)
                else:
                    bucket.work.wait()
                    if bucket.wire is not bucket.buffer:
                        bucket.buffer.copy_(bucket.wire)
                stats.launches.append(bucket.launch_time)
                stats.completions.append(bucket.done_time if bucket.done_time is not None else time.perf_counter())
                self._write_back(bucket)
                bucket.arrived, bucket.launched, bucket.work, bucket.wire = set(), False, None, None
        self._next_launch = 0
        if self.powersgd is not None:
            self.powersgd.iteration += 1
        stats.exposed_s = time.perf_counter() - start
        self.history.append(stats)
        if self.static_graph and not self._rebuilt:
            self._rebuilt = True
            self._build_buckets(self._arrival_order_of_rank0())
        self._arrival = []
        return stats

    def _arrival_order_of_rank0(self) -> list[nn.Parameter]:
        """The parameters in the order their gradients arrived on the group's first rank (those that got none last,
        in reverse registration order). Every rank builds its buckets from this order, as torch DDP broadcasts rank
        0's bucket assignment: where gradients arrive in another order on another rank, buckets built from the local
        order would hold different parameters on different ranks and the all-reduce would add unrelated gradients
        (tests/data_parallel/test_reducer.py)."""
        index = {id(p): i for i, p in enumerate(self.params)}
        arrived = {id(p) for p in self._arrival}
        order = self._arrival + [p for p in reversed(self.params) if id(p) not in arrived]
        device = local_tensor(self.params[0]).device
        indices = torch.tensor([index[id(p)] for p in order], dtype=torch.int64, device=device)
        dist.broadcast(indices, src=dist.get_global_rank(self.group, 0), group=self.group)
        return [self.params[i] for i in indices.tolist()]

    def reduce_all(self) -> CommStats:
        """Reduce every current ``.grad`` now, without overlap (for callers that run backward in pieces, such as a
        pipeline schedule, and synchronise once at the end)."""
        sync = self.require_sync
        self.require_sync = True
        start = time.perf_counter()
        self.start_backward()
        for p in self.params:
            if p.grad is not None:
                self._on_grad_ready(p)
        stats = self.finish()
        self.require_sync = sync
        assert stats is not None
        stats.exposed_s = time.perf_counter() - start  # nothing overlapped: all of it is exposed
        return stats

    def _powersgd_bucket(self, bucket: Bucket, stats: CommStats) -> None:
        assert self.powersgd is not None
        plain: list[int] = []
        for i, p in enumerate(bucket.params):
            view = self._slice(bucket, i).view(local_tensor(p).shape)
            if self.powersgd.compressible(view):
                self.powersgd.allreduce_(id(p) % (1 << 30), view, self.group, self.world)
                stats.bytes_sent += 4 * self.powersgd.rank * (view.shape[0] + view[0].numel())
            else:
                plain.append(i)
        if plain:
            flat = torch.cat([self._slice(bucket, i) for i in plain]).div_(self.world)
            stats.bytes_sent += flat.numel() * flat.element_size()
            dist.all_reduce(flat, group=self.group)
            start = 0
            for i in plain:
                chunk = self._slice(bucket, i)
                chunk.copy_(flat[start : start + chunk.numel()])
                start += chunk.numel()
        bucket.done_time = time.perf_counter()

    @staticmethod
    def _slice(bucket: Bucket, i: int) -> Tensor:
        n = local_tensor(bucket.params[i]).numel()
        return bucket.buffer[bucket.offsets[i] : bucket.offsets[i] + n]

    def _write_back(self, bucket: Bucket) -> None:
        """Hand the reduced gradients to the parameters (called by ``finish`` under ``no_grad``)."""
        as_view = self.gradient_as_bucket_view
        into: list[Tensor] = []
        sources: list[Tensor] = []
        for p, reduced, is_dtensor in zip(bucket.params, bucket.views, bucket.is_dtensor):
            grad = p.grad
            if as_view and not is_dtensor:
                if grad is not reduced:
                    p.grad = reduced
                continue
            if grad is None:
                p.grad = grad = torch.zeros_like(p)
            into.append(local_tensor(grad))
            sources.append(reduced)
        if into:
            foreach_copy_(into, sources)  # one call per bucket instead of one per parameter

    def remove_hooks(self) -> None:
        """Detach from the parameters (the reducer is then inert)."""
        for h in self._handles:
            h.remove()
        self._handles = []
