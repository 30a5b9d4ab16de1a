"""The pp axis in the registry: its checks, the cut and the schedule in ``parallelize()``, and its step hooks."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_par import contract
from lightning_par.axis_registry import Axis, Build
from lightning_par.parallel_dims import ParallelDims
from lightning_par.pipeline_parallel.engine import PipelineEngine
from lightning_par.pipeline_parallel.options import PipelineOptions
from lightning_par.pipeline_parallel.planner import PIPELINE_PARALLEL_TERMS
from lightning_par.pipeline_parallel.split import cut_network, plan_split, validate_split
from lightning_par.pipeline_parallel.steps import PipelinedSteps

__all__ = ["PIPELINE_PARALLEL"]


def _check(module: nn.Module, network: nn.Module, dims: ParallelDims, options: Any) -> None:
    if not dims.pp_enabled:
        return
    contract.check_not_compiled(module, f"pipelining (pp_size={dims.pp_size})",
                                "cuts the network into stages between its layers and runs the stages on their own")
    if getattr(module, "automatic_optimization", True) is False:
        raise ValueError(
            f"{type(module).__name__}.automatic_optimization=False is not valid under pipelining (pp_size > 1): the "
            f"schedule runs forward and backward micro-batch by micro-batch with loss_fn, so the LightningModule's "
            f"training_step (and its manual_backward / opt.step()) is never called. Use automatic optimization (the "
            f"strategy steps the optimizers Lightning configures, with clipping, accumulation and schedulers), or "
            f"pp_size=1."
        )
    contract.pipeline_loss(module)
    names = contract.pipeline_layers(network)
    split = options.pipeline.split
    validate_split(split, len(names), options.pipeline.num_stages(dims.pp_size), dims.pp_size)


def _layer_counts(module: nn.Module, network: nn.Module, dims: ParallelDims, options: PipelineOptions,
                  device: torch.device) -> list[int]:
    num_stages = options.num_stages(dims.pp_size)
    split = options.split
    if not isinstance(split, str) or split == "params":
        return plan_split(network, num_stages, split)
    counts: list[Any] = [None]
    if dist.get_rank() == 0:  # profile once: timings differ between ranks, and every rank must cut alike
        sample = tuple(t.to(device) for t in contract.pipeline_sample(module, network))
        counts[0] = plan_split(
            network, num_stages, split, sample, timeout_s=options.split_timeout_s, device=device,
            num_microbatches=options.num_microbatches,
        )
    dist.broadcast_object_list(counts, src=0)
    return counts[0]


def _cut(build: Build) -> None:
    """This rank's virtual stage(s) of the network; the LightningModule keeps only their parameters, under their
    whole-model names."""
    dims = build.dims
    if not dims.pp_enabled:
        return
    options = build.options.pipeline
    assert build.network is not None
    build.layer_counts = _layer_counts(build.module, build.network, dims, options, build.device)
    build.stage_ids = options.stage_ids(dims.coordinates(dist.get_rank())["pp"], dims.pp_size)
    build.network, build.stage_modules = cut_network(build.network, build.layer_counts, build.stage_ids)
    setattr(build.module, build.options.module_attr, build.network)  # type: ignore[arg-type]
    build.norm_groups.append(dims.group("pp"))  # the other stages hold the rest of the model


def _schedule(build: Build) -> None:
    """torch's ``PipelineStage`` + schedule over the stage modules; the steps become the pipelined ones."""
    dims = build.dims
    if not dims.pp_enabled:
        return
    build.pipeline = PipelineEngine(
        build.stage_modules, build.stage_ids, build.options.pipeline, dims.group("pp"), dims.pp_size,  # type: ignore[arg-type]
        build.device, contract.pipeline_loss(build.module), build.step_context, token_groups=build.token_groups,
        token_mean=getattr(build.module, "token_mean_loss", True) is not False,
    )
    build.steps = PipelinedSteps


def _refused_callbacks(dims: Any, options: Any) -> dict[str, str]:
    """Every callback kind (:data:`~lightning_par.axis_registry.CALLBACK_KINDS`): each stage holds part of the model and
    steps its own optimizer, so an averaged copy, a late-unfrozen module or a pruning mask is not the whole model's
    (measured: SWA and finetuning hung until the collective timeout)."""
    if dims.pp_size == 1:
        return {}
    return dict.fromkeys(("weight_averaging", "finetuning", "pruning"), f"pp_size={dims.pp_size}")


#: GPipe / 1F1B / interleaved pipelining across stages (torch.distributed.pipelining).
PIPELINE_PARALLEL = Axis(
    name="pp",
    size_fields=("pp_size",),
    option_groups=("pipeline",),
    check=_check,
    steps=(("cut", _cut), ("schedule", _schedule)),
    planner=PIPELINE_PARALLEL_TERMS,
    refused_callbacks=_refused_callbacks,
)
