"""Build the dp engine of a layout: ``ddp`` (the bucketed reducer), ZeRO-1/2 (:mod:`~lightning_par.data_parallel.zero`),
ZeRO-3 (FSDP2, :mod:`~lightning_par.data_parallel.fsdp`), one per parameter group on its own meshes
(:mod:`~lightning_par.data_parallel.grouped`). It sits above the engines it builds, which import only the base classes of
:mod:`~lightning_par.data_parallel.engine` (no import circle: tests/core/test_import_layers.py)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lightning_par.data_parallel.buffers import BufferSync
from lightning_par.data_parallel.engine import DataParallelEngine, DDPEngine, broadcast_from_dp_rank0
from lightning_par.data_parallel.fsdp import FSDPZero, fully_shard_roots
from lightning_par.data_parallel.grouped import GroupedEngine
from lightning_par.data_parallel.meshes import DataParallelMeshes
from lightning_par.data_parallel.options import ReducerOptions, ZeroOptions, zero_stage
from lightning_par.data_parallel.zero import ZeroShardedDataParallel

__all__ = ["apply_data_parallel"]


def apply_data_parallel(
    module: nn.Module,
    dp_mesh: DeviceMesh | DataParallelMeshes,
    dp_mode: str,
    reducer: ReducerOptions | None = None,
    zero: ZeroOptions | None = None,
    stage_modules: Sequence[nn.Module] | None = None,
    communicate: bool = True,
    groups: Sequence[tuple[Sequence[nn.Module], DataParallelMeshes]] = (),
) -> DataParallelEngine:
    """Make the dp replicas of ``module`` equal (broadcast from dp rank 0), then apply ``dp_mode``; the engine's
    :attr:`~DataParallelEngine.buffers` then broadcasts the module buffers before forwards (``reducer``'s
    ``broadcast_buffers``).

    Args:
        module: the model (for a pipeline stage: the LightningModule holding only this rank's parameters).
        dp_mesh: a 1-D data-parallel mesh, or the meshes of each role under HSDP
            (:class:`~lightning_par.data_parallel.meshes.DataParallelMeshes`): ``ddp`` all-reduces over every
            data-parallel rank, ``zero1``/``zero2`` shard within ``dp_shard`` and reduce across ``dp_replicate``,
            ``zero3`` is FSDP2 on the 2-D ``(dp_replicate, dp_shard)`` mesh.
        dp_mode: ``"ddp"``, ``"zero1"``, ``"zero2"`` or ``"zero3"``.
        reducer: the reducer's options (``ddp``).
        zero: the ZeRO options (``zero*``; their stage must match ``dp_mode``).
        stage_modules: with pipelining, the stage modules the schedule runs; ``zero3`` makes each an FSDP2 root (its
            blocks units), since a schedule calls them, not ``module``.
        communicate: ``False`` for evaluation without sharding: the replicas are made equal and nothing else (a plain
            :class:`DataParallelEngine`; ``dp_mode`` must then be ``"ddp"``).
        groups: modules whose parameters have their replicas on other meshes (the experts under expert parallelism:
            ``edp``), each with those meshes. The dp mode runs over them there, and over the rest on ``dp_mesh``
            (:class:`~lightning_par.data_parallel.grouped.GroupedEngine`).

    Raises:
        ValueError: an unknown ``dp_mode``, a missing or mismatched ``zero``, or a model with nothing to train.
    """
    stage = zero_stage(dp_mode)
    if stage and (zero is None or zero.stage != stage):
        raise ValueError(f"dp_mode={dp_mode!r} needs ZeroOptions(stage={stage}); got {zero!r}.")
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError(
            f"{type(module).__name__} has no parameter that requires a gradient: there is nothing to train. Build the "
            f"layers in __init__ or configure_model."
        )
    meshes = DataParallelMeshes.of(dp_mesh)
    grouped = [(list(mods), DataParallelMeshes.of(m)) for mods, m in groups if mods]
    group_params = [{id(p) for mod in mods for p in mod.parameters()} for mods, _ in grouped]
    elsewhere = set().union(*group_params)
    broadcast_from_dp_rank0(module, meshes.dp.get_group(), skip=elsewhere)
    for mods, group_meshes in grouped:
        for mod in mods:
            broadcast_from_dp_rank0(mod, group_meshes.dp.get_group())
    engine = _engine(module, meshes, stage, reducer, zero, stage_modules, communicate, grouped, group_params)
    enabled = (reducer or ReducerOptions()).broadcast_buffers
    engine.buffers = BufferSync(module, meshes.dp.get_group(), enabled=enabled)
    return engine


def _engine(
    module: nn.Module,
    meshes: DataParallelMeshes,
    stage: int,
    reducer: ReducerOptions | None,
    zero: ZeroOptions | None,
    stage_modules: Sequence[nn.Module] | None,
    communicate: bool,
    grouped: list[tuple[list[nn.Module], DataParallelMeshes]],
    group_params: list[set[int]],
) -> DataParallelEngine:
    elsewhere = set().union(*group_params)
    if stage == 3:
        assert zero is not None
        if stage_modules:
            fully_shard_roots(stage_modules, meshes, zero, groups=grouped)
        return FSDPZero(module, meshes, zero, roots=stage_modules, groups=grouped)
    if stage == 0 and not communicate:
        return DataParallelEngine(module, meshes.dp)
    names_of = {id(p): n for n, p in module.named_parameters()}
    main = [p for p in module.parameters() if id(p) not in elsewhere]
    if stage == 0:
        engines: list[DataParallelEngine] = [DDPEngine(module, meshes.dp, reducer, params=main)]
        engines += [DDPEngine(module, m.dp, reducer, params=[p for mod in mods for p in mod.parameters()])
                    for mods, m in grouped]
    else:
        assert zero is not None
        engines = [ZeroShardedDataParallel(module, meshes, zero, names=[names_of[id(p)] for p in main])
                   if grouped else ZeroShardedDataParallel(module, meshes, zero)]
        engines += [ZeroShardedDataParallel(module, m, zero, names=[names_of[i] for i in ids])
                    for (_, m), ids in zip(grouped, group_params)]
    if not grouped:
        return engines[0]
    return GroupedEngine(module, engines, [{names_of[i] for i in ids} for ids in group_params])
