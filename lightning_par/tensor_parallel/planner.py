"""The tp axis in the layout planner: its rules and its per-layer all-reduces (Megatron-LM, Shoeybi et al. 2019, §3).

Pure Python: no torch import.
"""

from __future__ import annotations

from typing import Any

from lightning_par.axis_registry import PlannerTerms
from lightning_par.comm_cost import collective_time, megatron_layer_bytes, ring_steps

__all__ = ["TENSOR_PARALLEL_TERMS", "check", "slot_comm_s"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check(layout: Any, model: Any) -> None:
    """Whole heads per tp rank; sequence parallelism only with ``tp_size > 1``, a sequence length divisible by
    ``tp_size`` (a sequence split over other ranks, context parallelism's, checks its per-rank share in its own
    ``planner.py``), and no MoE block (the GPT's MoE blocks run the whole sequence on every tp rank:
    :func:`~lightning_par.models.gpt_tp_plan.validate_gpt_tp`).

    Raises:
        ValueError: naming the field, its value and what would be valid.
    """
    t = layout.tp_size
    if model.num_heads % t:
        raise ValueError(
            f"tp_size={t} is not valid for num_heads={model.num_heads}: tensor parallelism splits whole heads; "
            f"expected one of {_divisors(model.num_heads)}."
        )
    if not layout.sequence_parallel:
        return
    if t == 1:
        raise ValueError("sequence_parallel=True is not valid with tp_size=1: expected False.")
    if model.seq_len % t:
        raise ValueError(
            f"sequence_parallel=True is not valid with tp_size={t} and seq_len={model.seq_len}: expected a sequence "
            f"length divisible by tp_size."
        )
    if model.num_experts:
        raise ValueError(
            f"sequence_parallel=True is not valid with tp_size={t} for a model with num_experts={model.num_experts}: "
            f"its MoE blocks keep the router and experts whole on every tp rank; expected False."
        )


def slot_comm_s(ctx: Any) -> float:
    """Seconds of one micro-batch's tensor-parallel all-reduces on a rank: per dense block four of ``b s h`` elements
    (two forward, two backward; six with full recomputation), per MoE block two (three) — its MLP is whole on every
    tp rank; ``8 b s h (t-1)/t`` elements sent per dense block (Narayanan et al. 2021, §3.2), not overlapped."""
    lay, model = ctx.layout, ctx.model
    t = lay.tp_size
    if t == 1:
        return 0.0
    s_rank = ctx.sequence_tokens  # s / cp under context parallelism
    op = "all_gather" if lay.sequence_parallel else "all_reduce"  # sp: all-gather / reduce-scatter pairs
    bw, lat = ctx.link("tp", op=op, payload_bytes=lay.micro_batch_size * s_rank * model.hidden_size * ctx.element_bytes)
    full = ctx.recompute == "full"
    sent = megatron_layer_bytes(lay.micro_batch_size, s_rank, model.hidden_size, t, ctx.element_bytes,
                                recompute_forward=full)
    per_dense = collective_time(sent, bw, lat, 6 if full else 4, ring_steps("all_reduce", t))
    moe_share = model.moe_layer_count() / model.num_layers  # MoE blocks: half the all-reduces, half the bytes
    return ctx.layers * per_dense * (1.0 - moe_share / 2)


#: The tp axis's terms (declared on its registry entry).
TENSOR_PARALLEL_TERMS = PlannerTerms(check=check, slot_comm_s=slot_comm_s)
