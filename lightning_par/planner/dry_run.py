"""Exact model-state bytes at any scale, without the hardware: the real :func:`~lightning_par.parallelize.parallelize`
for one rank of an ``N``-rank world, on the ``meta`` device and a fake process group.

The planner's memory model (:mod:`lightning_par.planner.memory`) is formulas. A dry run reads what the runtime
actually builds instead: the model is built on the ``meta`` device (no memory, no initialisation), a fake process
group (torch's ``"fake"`` backend, :func:`lightning_par.compat.fake_store`) makes this one process rank ``r`` of a world
of ``N`` ranks whose collectives move no data, and :func:`~lightning_par.parallelize.parallelize` cuts the rank's
pipeline stage, splits its tensors over tp, shards over dp (ZeRO-1/2 chunks, FSDP2 for zero3, HSDP, experts over
ep). Then, from what was built:

* parameters: every parameter of the module, its local shard (a ``DTensor``'s local tensor);
* gradients: what the dp mode keeps at the optimizer step: a gradient the shape of each trainable local parameter
  (ddp, zero1, zero3: FSDP2's gradients are sharded like its parameters), or for zero2 the gradient of each chunk the
  ZeRO engine owns (the full gradients are freed as they are reduce-scattered);
* optimizer state: the module's own optimizer (``configure_optimizers``), re-pointed by the dp engine at what this
  rank steps, and its state created lazily the way the runtime does it (one step with zero gradients and learning
  rate 0, :func:`~lightning_par.data_parallel.zero.init_optimizer_state`, on meta tensors), plus fp32 master chunks
  under ZeRO-1/2 mixed precision;
* buffers: the flat gradient buckets of the dp all-reduce (``ddp``, ``zero1``) and which gradients are views of them
  (a tensor-parallel DTensor's gradient is not: it is held twice, as itself and in its bucket slot).

All counts are bytes of local shapes (``numel * element_size``), so they are what a real run of the same layout holds
(the gloo runs' storage counts agree, ``tests/planner/test_plan_dry_run.py``) and scale to thousands of ranks in
milliseconds. The process group lives only inside each call; a caller that already has one cannot dry-run.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_par.compat import clear_dtensor_sharding_cache, fake_store, local_tensor
from lightning_par.parallel_dims import ParallelDims
from lightning_par.parallelize import ParallelModel, ParallelOptions, parallelize

__all__ = ["RankState", "dry_run", "dry_run_ranks", "fake_world", "stage_ranks", "worst_rank"]


@dataclass(frozen=True)
class RankState:
    """What one rank holds of the model state, read from what :func:`parallelize` built (bytes).

    Attributes:
        rank: the global rank.
        coordinates: its position on every mesh axis (:meth:`ParallelDims.coordinates`).
        params: parameters held (elements of the local shards; ZeRO-1/2 hold whole parameters).
        param_bytes: bytes of those parameters.
        grad_bytes: bytes of the gradients alive at the optimizer step.
        optimizer_state_bytes: bytes of the optimizer's state (and fp32 master chunks under ZeRO-1/2 mixed precision).
        optimizers: the optimizers' class names.
        bucket_bytes: the flat gradient buckets of the dp all-reduce (``ddp``, ``zero1``), allocated when the engine
            is built: a buffer, not model state (the planner's ``buffer_bytes`` counts it).
        grad_view_bytes: the part of ``grad_bytes`` that lives inside those buckets (``gradient_as_bucket_view``:
            a plain parameter's gradient is its bucket slot; a tensor-parallel DTensor's gradient is a tensor of its
            own, copied into its slot). Gradients and buckets together hold ``grad_bytes - grad_view_bytes +
            bucket_bytes``.
        viewed_bucket_bytes: the buckets among ``bucket_bytes`` that hold at least one gradient view (what a count
            of the gradients' storages, :func:`lightning_par.memory.model_state_bytes`, includes).
    """

    rank: int
    coordinates: dict[str, int]
    params: int
    param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    optimizers: tuple[str, ...] = ()
    bucket_bytes: int = 0
    grad_view_bytes: int = 0
    viewed_bucket_bytes: int = 0

    @property
    def pp_rank(self) -> int:
        """The pipeline stage (rank on the ``pp`` axis)."""
        return self.coordinates["pp"]

    @property
    def model_state_bytes(self) -> int:
        """``param_bytes + grad_bytes + optimizer_state_bytes``."""
        return self.param_bytes + self.grad_bytes + self.optimizer_state_bytes


@contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """This process as ``rank`` of a ``world_size``-rank default process group on torch's fake backend (collectives
    return without moving data), destroyed on exit; DTensor's sharding cache is cleared on entry and exit, so that
    no result computed on the fake meshes outlives them (a later real world, or a forked child, would resolve their
    process-group names).

    Raises:
        RuntimeError: a default process group already exists in this process (a dry run needs its own).
    """
    if dist.is_initialized():
        raise RuntimeError(
            "A dry run needs its own (fake) default process group, but this process already has one: run the dry "
            "run in a process without torch.distributed initialised (e.g. recipes/plan.py --dry-run)."
        )
    clear_dtensor_sharding_cache()  # results cached under an earlier group of the same shape name its groups
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        clear_dtensor_sharding_cache()  # nor may a later (or forked) real group redistribute over the fake names


def _fresh(dims: ParallelDims) -> ParallelDims:
    """The same sizes, without the cached meshes of an earlier process group."""
    return ParallelDims(**{f.name: getattr(dims, f.name) for f in dataclasses.fields(dims) if f.init})


def _nbytes(t: Tensor) -> int:
    local = local_tensor(t)
    return local.numel() * local.element_size()


def _optimizers(configured: Any) -> list[torch.optim.Optimizer]:
    """The optimizers of a ``configure_optimizers`` return value (an optimizer, a list or tuple of them, a
    ``(optimizers, schedulers)`` pair, or dicts with ``"optimizer"``)."""
    if configured is None:
        return []
    if isinstance(configured, torch.optim.Optimizer):
        return [configured]
    if isinstance(configured, Mapping):
        return _optimizers(configured.get("optimizer"))
    if isinstance(configured, (list, tuple)):
        if len(configured) == 2 and isinstance(configured[0], (list, tuple)):
            return _optimizers(list(configured[0]))
        return list(itertools.chain.from_iterable(_optimizers(c) for c in configured))
    return []


def _engines(engine: Any) -> list[Any]:
    """The engines of the dp axis (a grouped engine's parts under expert parallelism)."""
    return list(getattr(engine, "engines", None) or [engine])


def _unique(tensors: Iterable[Tensor]) -> list[Tensor]:
    seen: set[int] = set()
    out = []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _buckets(parallel: ParallelModel) -> tuple[int, int, int]:
    """``(bucket_bytes, grad_view_bytes, viewed_bucket_bytes)``: the dp all-reduce buckets built on this rank, the
    gradients that will be views of them, and the buckets holding such views."""
    from lightning_par.data_parallel.reducer import GradientReducer

    buckets = views = viewed = 0
    for engine in _engines(parallel.engine):
        reducer = getattr(engine, "reducer", None)
        if not isinstance(reducer, GradientReducer):
            continue
        for bucket in reducer.buckets:
            buckets += bucket.nbytes
            if reducer.gradient_as_bucket_view:
                inside = sum(_nbytes(p) for p, is_dtensor in zip(bucket.params, bucket.is_dtensor) if not is_dtensor)
                views += inside
                viewed += bucket.nbytes if inside else 0
    return buckets, views, viewed


def _count(parallel: ParallelModel, optimizers: list[torch.optim.Optimizer]) -> tuple[int, int, int, int]:
    """``(params, param_bytes, grad_bytes, optimizer_state_bytes)`` of what ``parallel`` built on this rank."""
    params = _unique(parallel.module.parameters())
    numel = sum(local_tensor(p).numel() for p in params)
    param_bytes = sum(_nbytes(p) for p in params)
    grad_bytes = sum(_nbytes(p) for p in params if p.requires_grad)
    state_bytes = 0
    for engine in _engines(parallel.engine):
        chunks = getattr(engine, "local_params", None)
        if chunks is None:  # ddp and zero3: gradients the shape of the (sharded) parameters
            continue
        if engine.stage == 2:  # the full gradients are freed once reduce-scattered: only the chunks' remain
            grad_bytes -= sum(_nbytes(s.param) for s in engine.layout.shards if s.param.requires_grad)
            grad_bytes += sum(_nbytes(c) for c in chunks.values())
        if engine.mixed:  # fp32 master chunks, stepped by the optimizer
            state_bytes += sum(_nbytes(c) for c in chunks.values())
    for optimizer in optimizers:
        for per_param in optimizer.state.values():
            state_bytes += sum(_nbytes(v) for v in per_param.values() if isinstance(v, Tensor))
    return numel, param_bytes, grad_bytes, state_bytes


def dry_run(
    build_module: Callable[[], nn.Module],
    dims: ParallelDims,
    options: ParallelOptions,
    rank: int = 0,
    *,
    optimizer: bool = True,
) -> RankState:
    """Build ``rank``'s part of the model as :func:`parallelize` would on ``dims.world_size`` ranks, on the ``meta``
    device and a fake process group, and count what it holds.

    Args:
        build_module: makes the LightningModule (any module meeting :mod:`lightning_par.contract`); called under
            ``torch.device("meta")``, so it allocates nothing.
        dims: the layout (any world size: 1024 ranks take well under a second).
        options: what :func:`parallelize` applies (dp mode, pipeline schedule, ...).
        rank: the global rank to build, ``0 <= rank < dims.world_size``.
        optimizer: also build the module's optimizer(s) from ``configure_optimizers`` and create their state
            (``False``: ``optimizer_state_bytes`` is 0).

    Returns:
        The rank's :class:`RankState`.

    Raises:
        ValueError: ``rank`` out of range, or a layout/model the runtime refuses (:func:`parallelize`'s checks).
        RuntimeError: this process already has a default process group.
    """
    coords = dims.coordinates(rank)  # ValueError naming rank and world_size
    with fake_world(rank, dims.world_size):
        with torch.device("meta"):
            module = build_module()
        parallel = parallelize(module, _fresh(dims), options, device=torch.device("cpu"))
        optimizers: list[torch.optim.Optimizer] = []
        if optimizer and callable(getattr(module, "configure_optimizers", None)):
            from lightning_par.data_parallel.zero import init_optimizer_state

            optimizers = _optimizers(module.configure_optimizers())
            for opt in optimizers:
                parallel.engine.shard_optimizer(opt)
                init_optimizer_state(opt)
        numel, param_bytes, grad_bytes, state_bytes = _count(parallel, optimizers)
        bucket_bytes, view_bytes, viewed_bytes = _buckets(parallel)
    return RankState(
        rank=rank, coordinates=coords, params=numel, param_bytes=param_bytes, grad_bytes=grad_bytes,
        optimizer_state_bytes=state_bytes, optimizers=tuple(type(o).__name__ for o in optimizers),
        bucket_bytes=bucket_bytes, grad_view_bytes=view_bytes, viewed_bucket_bytes=viewed_bytes,
    )


def stage_ranks(dims: ParallelDims, rank: int = 0) -> list[int]:
    """One rank per pipeline stage: ``rank``'s coordinates on every other axis, each ``pp`` coordinate.

    Raises:
        ValueError: ``rank`` out of range.
    """
    dims.coordinates(rank)
    per_stage = dims.world_size // dims.pp_size  # pp is the outermost mesh axis
    inner = rank % per_stage
    return [s * per_stage + inner for s in range(dims.pp_size)]


def dry_run_ranks(
    build_module: Callable[[], nn.Module], dims: ParallelDims, options: ParallelOptions, ranks: Iterable[int],
    *, optimizer: bool = True,
) -> list[RankState]:
    """:func:`dry_run` for each of ``ranks``, one after another (one fake world each).

    Raises:
        ValueError, RuntimeError: see :func:`dry_run`.
    """
    return [dry_run(build_module, dims, options, r, optimizer=optimizer) for r in ranks]


def worst_rank(states: Iterable[RankState]) -> RankState:
    """The state with the most model-state bytes (the first of equals).

    Raises:
        ValueError: no states.
    """
    states = list(states)
    if not states:
        raise ValueError("worst_rank needs at least one RankState.")
    return max(states, key=lambda s: (s.model_state_bytes, -s.rank))
