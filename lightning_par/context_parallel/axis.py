"""The cp axis in the registry: its checks, its step in ``parallelize()`` and what it adds to a run."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from lightning_par import contract
from lightning_par.axis_registry import Axis, Build
from lightning_par.compile import refuse_fullgraph
from lightning_par.context_parallel.attention import CPAttentionMode, check_ulysses_heads
from lightning_par.context_parallel.batch import SequenceSplit
from lightning_par.context_parallel.contract import (
    check_context_parallel,
    context_parallel_attention,
    context_parallel_positions,
)
from lightning_par.context_parallel.planner import CONTEXT_PARALLEL_TERMS
from lightning_par.context_parallel.report import cp_mean_step
from lightning_par.parallel_dims import ParallelDims

__all__ = ["CONTEXT_PARALLEL"]


def _check(module: nn.Module, network: nn.Module, dims: ParallelDims, options: Any) -> None:
    if not dims.cp_enabled:
        return
    contract.check_not_compiled(module, f"context parallelism (cp_size={dims.cp_size})",
                                "replaces each attention call by a context-parallel one while a step runs")
    refuse_fullgraph(options, f"cp_size={dims.cp_size}", "context-parallel attention sends K/V between the cp ranks "
                     "inside each block's attention (CPAttentionMode runs it eagerly)")
    context_parallel_positions(network)
    check_context_parallel(network, dims.cp_size)
    if options.context_parallel.method == "all_to_all":
        heads = contract.attention_heads(network)
        if heads is None:
            raise ValueError(
                f"context_parallel.method='all_to_all' needs the number of attention heads: define attention_heads() "
                f"on {type(network).__name__}, or use method='ring'."
            )
        check_ulysses_heads(heads, dims.cp_size, dims.tp_size)


def _apply(build: Build) -> None:
    """Split each batch's sequence over the cp ranks and run every ``scaled_dot_product_attention`` of a step as
    context-parallel attention over the cp group (gradients are averaged over ``dp_cp`` by the dp axis; the losses and
    values a step logs become the mean over the cp ranks' tokens, :mod:`~lightning_par.context_parallel.report`)."""
    dims = build.dims
    if not dims.cp_enabled:
        return
    rank = dims.coordinates(dist.get_rank())["cp"]
    method, group = build.options.context_parallel.method, dims.group("cp")
    split = SequenceSplit(rank, dims.cp_size)
    build.batch_transforms.append(split)
    # What a step logs and returns is its rank's share of the sequence: report the mean over the cp ranks' tokens.
    build.step_wrappers.append(cp_mean_step(group))
    build.token_groups.append(group)
    build.refused_stages["predict"] = (
        f"predict is not supported with cp_size={dims.cp_size}: each rank's predict_step would see only its "
        f"1/{dims.cp_size} piece of every sequence and return outputs for that piece. Predict under a strategy with "
        f"cp_size=1 (a checkpoint saved under any layout loads into it)."
    )  # a pipeline's micro-batch weights count the tokens of the whole sequence
    attention = context_parallel_attention(build.network)
    if attention is not None:  # e.g. a Hugging Face model's attention without its position-built mask
        build.step_contexts.append(attention)
    # A fresh mode per step: the positions of the batch the split last cut.
    build.step_contexts.append(lambda: CPAttentionMode(method, group, split.positions))
    build.summaries.append(lambda: {
        "cp_method": method,
        "cp_tokens_per_sequence": None if split.positions is None else int(split.positions.numel()),
    })


#: Context parallelism: one sequence split over the cp ranks (ring or all-to-all attention).
CONTEXT_PARALLEL = Axis(
    name="cp",
    size_fields=("cp_size",),
    option_groups=("context_parallel",),
    check=_check,
    steps=(("context", _apply),),
    planner=CONTEXT_PARALLEL_TERMS,
)
