"""Pipeline parallelism: options and schedules (torch's ``torch.distributed.pipelining``), stage splitting and
balancing for any network meeting :mod:`lightning_par.contract`, the engine that runs torch's schedules inside
Lightning's step, bubble accounting, and the analysis of schedules (orders, simulation, formulas).

Everything here takes modules and process groups explicitly; nothing knows a particular model.
"""

from lightning_par.pipeline_parallel.bubble import OpEvent, StepRecord, StepTimer, summarize_bubble
from lightning_par.pipeline_parallel.clip import clip_grad_norm_across_ranks, total_grad_norm
from lightning_par.pipeline_parallel.engine import PipelineEngine, split_tree
from lightning_par.pipeline_parallel.options import SCHEDULES, SPLIT_METHODS, PipelineOptions, ScheduleSpec
from lightning_par.pipeline_parallel.schedules import (
    Action,
    bubble_formula,
    build_order,
    forward_only_order,
    peak_in_flight,
    stage_ids,
)
from lightning_par.pipeline_parallel.simulate import SimulatedStep, simulate, simulate_actions
from lightning_par.pipeline_parallel.split import (
    balance_costs,
    cut_network,
    layer_costs,
    plan_split,
    prune_to,
    validate_split,
)

__all__ = [
    "SCHEDULES",
    "SPLIT_METHODS",
    "Action",
    "OpEvent",
    "PipelineEngine",
    "PipelineOptions",
    "ScheduleSpec",
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
    "peak_in_flight",
    "plan_split",
    "prune_to",
    "simulate",
    "simulate_actions",
    "split_tree",
    "stage_ids",
    "summarize_bubble",
    "total_grad_norm",
    "validate_split",
]
