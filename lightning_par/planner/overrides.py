"""A planned layout as Hydra overrides of ``recipes/train.py``: ``parallel=``/``strategy=`` options and their fields.

Each layout maps to the simplest registry name that runs it (``ddp_overlap``, ``zero1``-``zero3``,
``tensor_parallel``, ``gpipe``/``1f1b``/``pipeline``) and to ``parallel_3d`` otherwise (always with context
parallelism, HSDP or expert parallelism, whose sizes ``parallel.cp_size``, ``parallel.dp_replicate_size`` and
``parallel.ep_size`` and ``strategy.context_parallel.method`` are written out), with the
per-replica batch ``data.batch_size = micro_batch_size * num_microbatches`` (the pipeline strategies cut it into
``num_microbatches`` micro-batches); without pipelining (``pp_size == 1``) several micro-batches are Lightning's
gradient accumulation (``trainer.accumulate_grad_batches = num_microbatches``, ``data.batch_size =
micro_batch_size``): no strategy cuts a batch at pp 1. With pipelining, the even layer
split the planner assumed (``strategy.split``), and its activation checkpointing
(``strategy.activation_checkpointing``). What the overrides cannot say is in :func:`layout_notes`.

The strategy field names live in :data:`STRATEGY_FIELDS`, in one place, so a rename of the strategy schema is a
one-line change here.
"""

from __future__ import annotations

from collections.abc import Collection

from lightning_par.planner.layouts import AXIS_OPTIONS, WORLD_SIZE_FIELDS, Layout, size_fields

__all__ = ["STRATEGY_FIELDS", "layout_notes", "layout_overrides", "parallel_option_name", "strategy_name"]

#: Planner choice -> key under ``strategy.`` in the run config (conf/strategy/*.yaml).
STRATEGY_FIELDS: dict[str, str] = {
    "dp_mode": "dp_mode",
    "schedule": "pipeline.schedule",
    "num_microbatches": "pipeline.num_microbatches",
    "virtual_stages": "pipeline.virtual_stages",
    "split": "pipeline.split",
    "sequence_parallel": "tensor_parallel.sequence_parallel",
    "activation_checkpointing": "activation_checkpointing",
    **{option.name: option.strategy_key for option in AXIS_OPTIONS},  # cp_method: context_parallel.method
}


#: Registry names that cut the per-replica batch into ``num_microbatches`` micro-batches.
_PIPELINED = ("parallel_3d", "pipeline", "gpipe", "1f1b")


def parallel_option_name(layout: Layout) -> str:
    """The conf/parallel option name this layout would have by the existing convention (``tp2_pp2_dp2``,
    ``tp2_dp4``, ``pp2``, ``dp8``; ``cp2_dp2``, ``cp2_tp2``): the axes of size > 1 in the order cp, tp, pp, dp; ``dp1``
    for one device."""
    added = [size for size in size_fields() if size in WORLD_SIZE_FIELDS]  # cp_size
    sizes = [*added, "tp_size", "pp_size", "dp_size"]
    parts = [f"{size.removesuffix('_size')}{getattr(layout, size)}" for size in sizes if getattr(layout, size) > 1]
    return "_".join(parts) or "dp1"


def _borrowed_axes(layout: Layout) -> bool:
    """An axis added on the registry in use (context parallelism, HSDP, expert parallelism, ...: a size of
    :func:`~lightning_par.planner.layouts.size_fields` above 1): sizes the conventional option names do not spell."""
    return any(getattr(layout, size) > 1 for size in size_fields())


def strategy_name(layout: Layout) -> str:
    """The registry name that runs ``layout`` most simply (``parallel_3d`` for context parallelism, HSDP and expert
    parallelism: the strategy that has every axis)."""
    if _borrowed_axes(layout):
        return "parallel_3d"
    single_step = layout.num_microbatches == 1 or layout.pp_size == 1  # pp 1: micro-batches are accumulation
    if layout.pp_size == 1 and layout.tp_size == 1 and single_step:
        return "ddp_overlap" if layout.dp_mode == "ddp" else layout.dp_mode
    if layout.pp_size == 1 and layout.tp_size > 1 and single_step and layout.dp_mode == "ddp":
        return "tensor_parallel"
    if layout.pp_size > 1 and layout.tp_size == 1 and layout.dp_mode == "ddp":
        return layout.schedule if layout.schedule in ("gpipe", "1f1b") else "pipeline"
    return "parallel_3d"


def layout_overrides(
    layout: Layout, parallel_options: Collection[str] | None = None, num_layers: int | None = None
) -> list[str]:
    """Hydra overrides that run ``layout`` with ``recipes/train.py``.

    Args:
        layout: the layout.
        parallel_options: option names of the ``parallel`` config group (``conf/parallel/*.yaml``); a layout whose
            conventional name is among them is given as ``parallel=<name>``, any other as its four fields (plus
            ``parallel.cp_size``, ``parallel.dp_replicate_size``, ``parallel.ep_size`` where > 1, always written out).
        num_layers: the model's layers; with pipelining, the even split ``strategy.split=[L/(p v), ...]`` is added.

    Returns:
        Overrides such as ``["parallel=tp2_pp2_dp2", "strategy=parallel_3d", "strategy.dp_mode=zero1", ...]``.
    """
    out: list[str] = []
    name = parallel_option_name(layout)
    # A cp / HSDP / ep layout states every size rather than trusting an option file by its name.
    if not _borrowed_axes(layout) and parallel_options is not None and name in parallel_options:
        out.append(f"parallel={name}")
    else:
        out += [f"parallel.world_size={layout.world_size}", f"parallel.dp_size={layout.dp_size}",
                f"parallel.tp_size={layout.tp_size}", f"parallel.pp_size={layout.pp_size}"]
        for size in size_fields():
            if getattr(layout, size) > 1:
                out.append(f"parallel.{size}={getattr(layout, size)}")
    strategy = strategy_name(layout)
    out.append(f"strategy={strategy}")
    f = STRATEGY_FIELDS
    if strategy == "parallel_3d":
        out.append(f"strategy.{f['dp_mode']}={layout.dp_mode}")
    for option in AXIS_OPTIONS:  # the cp method
        if getattr(layout, option.size) > 1:
            out.append(f"strategy.{f[option.name]}={getattr(layout, option.name)}")
    if strategy in ("parallel_3d", "pipeline") and layout.pp_size > 1:
        out.append(f"strategy.{f['schedule']}={layout.schedule}")
    pipelined = layout.pp_size > 1 and strategy in _PIPELINED
    if pipelined:
        out.append(f"strategy.{f['num_microbatches']}={layout.num_microbatches}")
        if layout.virtual_stages > 1:
            out.append(f"strategy.{f['virtual_stages']}={layout.virtual_stages}")
    if layout.pp_size > 1 and num_layers is not None:
        stages = layout.pp_size * layout.virtual_stages  # the even split the planner assumed
        out.append(f"strategy.{f['split']}=[{','.join([str(num_layers // stages)] * stages)}]")
    if layout.sequence_parallel:
        out.append(f"strategy.{f['sequence_parallel']}=true")
    if layout.activation_checkpointing != "none":
        out.append(f"strategy.{f['activation_checkpointing']}={layout.activation_checkpointing}")
    if not pipelined and layout.num_microbatches > 1:
        out.append(f"trainer.accumulate_grad_batches={layout.num_microbatches}")
    out.append(f"data.batch_size={layout.micro_batch_size * (layout.num_microbatches if pipelined else 1)}")
    return out


def layout_notes(layout: Layout) -> list[str]:
    """What the emitted overrides cannot express for ``layout`` exactly."""
    notes = []
    if layout.activation_checkpointing == "selective":
        # The planner counts Korthikanti et al.'s selective recomputation (attention cores only); the strategy
        # option recomputes the attention module the model names (projections included): a little more compute.
        notes.append("ckpt=selective: the strategy recomputes whole attention modules, the plan only their cores")
    return notes
