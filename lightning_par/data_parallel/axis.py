"""The dp axis in the registry: its check and its step in ``parallelize()`` (the dp mode on the dp meshes)."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_par.axis_registry import Axis, Build
from lightning_par.data_parallel.buffers import prepare_sync_batchnorm
from lightning_par.data_parallel.apply import apply_data_parallel
from lightning_par.data_parallel.meshes import DataParallelMeshes
from lightning_par.data_parallel.planner import DATA_PARALLEL_TERMS
from lightning_par.data_parallel.token_mean import dp_token_mean_step
from lightning_par.parallel_dims import ParallelDims

__all__ = ["DATA_PARALLEL"]


def _check(module: nn.Module, network: nn.Module, dims: ParallelDims, options: Any) -> None:
    if options.dp_mode != "ddp" and not any(p.requires_grad for p in module.parameters()):
        raise ValueError(
            f"{type(module).__name__} has no parameter that requires a gradient: dp_mode={options.dp_mode!r} has "
            f"nothing to shard. Build the layers in __init__ or configure_model, or use dp_mode='ddp'."
        )


def _apply(build: Build) -> None:
    """The dp mode over the whole LightningModule (its state names are the checkpoint's). For evaluation ZeRO-1/2
    keep plain replicas (there is no optimizer to shard); ``zero3`` still shards. ``nn.SyncBatchNorm`` layers
    synchronise over the dp replicas (refused on CPU, where torch's SyncBatchNorm does not run). A token-mean loss
    under a label mask is weighed per replica (:mod:`~lightning_par.data_parallel.token_mean`)."""
    options = build.options
    meshes = DataParallelMeshes.from_dims(build.dims)
    prepare_sync_batchnorm(build.module, build.device, meshes.dp.get_group())
    dp_mode = options.dp_mode if build.training or options.dp_mode == "zero3" else None
    build.engine = apply_data_parallel(
        build.module, meshes, dp_mode or "ddp", options.reducer,
        options.zero if dp_mode not in (None, "ddp") else None,
        stage_modules=build.stage_modules or None, communicate=dp_mode is not None, groups=build.dp_groups,
    )
    build.summaries.append(build.engine.summary)
    dims = build.dims
    if build.training and dims.dp_size > 1:
        # The replicas' token-mean losses weighed by their share of the global batch's counted tokens (label masks,
        # padding), so that the dp average is one process's gradient (:mod:`~lightning_par.data_parallel.token_mean`);
        # a pipeline weighs its micro-batches over the dp group too.
        dp_group = dims.group("dp")
        build.step_wrappers.append(dp_token_mean_step(dp_group, dims.group("cp") if dims.cp_enabled else None))
        build.token_groups.append(dp_group)


def _refused_callbacks(dims: Any, options: Any) -> dict[str, str]:
    """Weight averaging under ``zero3`` (DTensor shards); finetuning where the dp gradient reducer (``ddp``,
    ``zero1``, ``zero2``) averages over more than one rank (it is built for the parameters that train at the start, so
    later-unfrozen ones are never averaged); pruning under any dp mode but ``ddp`` (the sharded optimizer state does
    not follow the re-registered ``<name>_orig``)."""
    mode = options.dp_mode
    replicas = dims.size("dp_cp")  # the ranks the dp gradient reducer averages over
    out = {"weight_averaging": "dp_mode='zero3'"} if mode == "zero3" else {}
    if mode != "zero3" and replicas > 1:
        out["finetuning"] = f"dp_mode={mode!r} over {replicas} ranks that average gradients"
    if mode != "ddp":
        out["pruning"] = f"dp_mode={mode!r}"
    return out


#: Data parallelism (ddp, ZeRO-1/2/3) over dp_replicate x dp_shard, HSDP when dp_replicate_size > 1.
DATA_PARALLEL = Axis(
    name="dp",
    size_fields=("dp_size", "dp_replicate_size", "dp_shard_size"),
    option_groups=("reducer", "zero", "fault_tolerance"),
    check=_check,
    steps=(("data", _apply),),
    planner=DATA_PARALLEL_TERMS,
    refused_callbacks=_refused_callbacks,
)
