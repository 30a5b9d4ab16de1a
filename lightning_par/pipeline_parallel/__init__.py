"""Pipeline parallelism: stage splitting and balancing, schedules as plain lists of operations, the runner that executes
them between ranks, bubble accounting, and the cross-stage pieces Lightning needs (norm clipping, checkpoints).

The functions here take the modules and process groups explicitly, so the pipeline strategy and the 3-D strategy
(tensor parallelism inside each stage) share them.
"""

from lightning_par.pipeline_parallel.bubble import OpEvent, StepRecord, StepTimer, summarize_bubble
from lightning_par.pipeline_parallel.clip import clip_grad_norm_across_ranks, total_grad_norm
from lightning_par.pipeline_parallel.runner import PipelineRunner, split_microbatches
from lightning_par.pipeline_parallel.schedules import (
    SCHEDULES,
    Action,
    bubble_formula,
    build_order,
    forward_only_order,
    peak_in_flight,
    stage_ids,
    validate_schedule,
)
from lightning_par.pipeline_parallel.simulate import SimulatedStep, simulate
from lightning_par.pipeline_parallel.split import (
    SPLIT_METHODS,
    balance_costs,
    cut_network,
    layer_costs,
    network_layers,
    plan_split,
    validate_split,
)

__all__ = [
    "SCHEDULES",
    "SPLIT_METHODS",
    "Action",
    "OpEvent",
    "PipelineRunner",
    "SimulatedStep",
    "StepRecord",
    "StepTimer",
    "balance_costs",
    "bubble_formula",
    "build_order",
    "clip_grad_norm_across_ranks",
    "cut_network",
    "forward_only_order",
    "layer_costs",
    "network_layers",
    "peak_in_flight",
    "plan_split",
    "simulate",
    "split_microbatches",
    "stage_ids",
    "summarize_bubble",
    "total_grad_norm",
    "validate_schedule",
    "validate_split",
]
