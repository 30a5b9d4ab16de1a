"""The pp axis in the layout planner: its rules (the runtime's schedule checks) and its point-to-point sends.

Pure Python: no torch import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_par.axis_registry import PlannerTerms
from lightning_par.comm_cost import all_gather_bytes, collective_time, ring_steps
from lightning_par.pipeline_parallel.options import SCHEDULES, PipelineOptions

__all__ = ["PIPELINE_PARALLEL_TERMS", "PLANNED_SCHEDULES", "check", "pp_message_time", "slot_comm_s"]

#: The runtime's schedules whose step time the planner models (``"none"`` when ``pp_size == 1``: micro-batches are
#: gradient accumulation).
PLANNED_SCHEDULES: tuple[str, ...] = ("none", *(s for s in ("gpipe", "1f1b", "interleaved_1f1b") if s in SCHEDULES))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check(layout: Any, model: Any) -> None:
    """The layers split evenly over ``pp_size * virtual_stages`` (as Megatron-LM requires; the emitted runs pass the
    split explicitly); a schedule of :data:`PLANNED_SCHEDULES` (``"none"`` exactly when ``pp_size == 1``); the
    runtime's schedule rules (:meth:`~lightning_par.pipeline_parallel.options.PipelineOptions.check_layout`: virtual
    stages and micro-batches against ``pp_size``); ``interleaved_1f1b`` with ``num_microbatches % pp_size == 0``
    (Megatron-LM's rule, which the bubble formula assumes).

    Raises:
        ValueError: naming the field, its value and what would be valid.
    """
    p, v = layout.pp_size, layout.virtual_stages
    if layout.schedule not in PLANNED_SCHEDULES:
        raise ValueError(f"schedule={layout.schedule!r} is not valid: expected one of {list(PLANNED_SCHEDULES)}.")
    stages = p * v
    if model.num_layers % stages:
        raise ValueError(
            f"pp_size * virtual_stages = {p} * {v} = {stages} is not valid for num_layers={model.num_layers}: "
            f"expected a divisor of the layers, one of {_divisors(model.num_layers)}."
        )
    if p == 1:
        if layout.schedule != "none":
            raise ValueError(f"schedule={layout.schedule!r} is not valid with pp_size=1: expected 'none'.")
        if v != 1:
            raise ValueError(f"virtual_stages={v} is not valid with pp_size=1: expected 1.")
        return
    if layout.schedule == "none":
        raise ValueError(
            f"schedule='none' is not valid with pp_size={p}: expected one of {list(PLANNED_SCHEDULES[1:])}."
        )
    PipelineOptions(schedule=layout.schedule, num_microbatches=layout.num_microbatches,
                    virtual_stages=v).check_layout(p, layout.dp_mode)
    if layout.schedule == "interleaved_1f1b" and layout.num_microbatches % p:
        raise ValueError(
            f"num_microbatches={layout.num_microbatches} is not valid for schedule='interleaved_1f1b' with "
            f"pp_size={p}: expected a multiple of pp_size (Megatron-LM's rule, which the planner's bubble formula "
            f"assumes)."
        )


def pp_message_time(message_bytes: float, layout: Any, link: Callable[..., tuple[float, float]],
                    scatter_gather: bool = False) -> float:
    """Seconds of one pipeline send between neighbouring stages (one micro-batch's activation or its gradient).

    Every tp rank of a stage sends to its counterpart in the next stage, all at once, each over its own link
    (:func:`~lightning_par.planner.comm.group_link`, axis ``"pp"``: across nodes, one network adapter per device).

    * default: each tp rank sends the whole ``b s h`` activation, replicated over tp (Narayanan et al. 2021, §3.2:
      ``b s h`` per micro-batch between consecutive devices);
    * sequence parallelism: each tp rank holds and sends only its ``1/t`` of the sequence;
    * ``scatter_gather`` (Megatron-LM, Narayanan et al. 2021, §4.1 and Figure 9; on in its Table 1 runs, §5.1):
      each tp rank sends ``1/t`` of the replicated activation, then the receiving stage all-gathers it over its
      node's links (the tp group is inside a node): ``b s h / t`` on the pipeline link plus an all-gather of ``b s h``.

    Args:
        message_bytes: ``b s h`` elements times the activation element size.
        layout: the layout (``tp_size``, ``sequence_parallel``).
        link: ``link(axis, op=, payload_bytes=) -> (bytes/s, seconds per message)`` of a group of ``axis``
            (``PlanContext.link``; :func:`lightning_par.planner.comm.pp_message_time` binds a device to it).
        scatter_gather: see above.

    Returns:
        Seconds.
    """
    t = layout.tp_size
    bw, lat = link("pp", op="p2p")
    if layout.sequence_parallel:
        return collective_time(message_bytes / t, bw, lat, 1, ring_steps("p2p", 2))
    if scatter_gather and t > 1:
        tp_bw, tp_lat = link("tp", op="all_gather", payload_bytes=message_bytes)
        gather = collective_time(all_gather_bytes(message_bytes, t), tp_bw, tp_lat, 1, ring_steps("all_gather", t))
        return collective_time(message_bytes / t, bw, lat, 1, ring_steps("p2p", 2)) + gather
    return collective_time(message_bytes, bw, lat, 1, ring_steps("p2p", 2))


def slot_comm_s(ctx: Any) -> float:
    """Seconds of one micro-batch's pipeline sends on a rank: one activation forward and one gradient backward per
    chunk, ``b s h`` elements each (``v`` times as many with ``v`` chunks per rank: Narayanan et al. 2021, §2.2.2)."""
    lay = ctx.layout
    if lay.pp_size == 1:
        return 0.0
    message = ctx.tokens * ctx.model.hidden_size * ctx.element_bytes
    return 2 * lay.virtual_stages * pp_message_time(message, lay, ctx.link, ctx.pp_scatter_gather)


#: The pp axis's terms (declared on its registry entry).
PIPELINE_PARALLEL_TERMS = PlannerTerms(check=check, slot_comm_s=slot_comm_s)
