"""The cp axis in the layout planner: its rules (the runtime's own checks) and its attention exchanges per layer.

Pure Python: no torch import at call time beyond what the cp axis's checks need.
"""

from __future__ import annotations

from typing import Any

from lightning_par.axis_registry import PlannerTerms
from lightning_par.comm_cost import collective_time, ring_steps
from lightning_par.context_parallel.comm_cost import ring_attention_layer_bytes, ulysses_layer_bytes
from lightning_par.context_parallel.attention import _check_seq_len, check_ulysses_heads
from lightning_par.context_parallel.options import CP_METHODS

__all__ = ["CONTEXT_PARALLEL_TERMS", "check", "layer_comm", "point_to_point", "slot_comm_s", "token_split"]


def check(layout: Any, model: Any) -> None:
    """The cp axis's rules: ``cp_method`` one of :data:`~lightning_par.context_parallel.options.CP_METHODS` (``"ring"``
    when ``cp_size == 1``: one spelling per layout); causal load balancing cuts the sequence into ``2 cp_size`` equal
    chunks; ``all_to_all`` (Ulysses) needs whole heads per rank, ``num_heads % (cp_size * tp_size) == 0``; sequence
    parallelism shards each cp rank's ``seq_len / cp_size`` tokens over the tp ranks, so ``tp_size`` divides them.

    Raises:
        ValueError: naming the field, its value and what would be valid.
    """
    if layout.cp_method not in CP_METHODS:
        raise ValueError(f"cp_method={layout.cp_method!r} is not valid: expected one of {list(CP_METHODS)}.")
    cp = layout.cp_size
    if cp == 1:
        if layout.cp_method != "ring":
            raise ValueError(
                f"cp_method={layout.cp_method!r} is not valid with cp_size=1: expected 'ring' (nothing to split)."
            )
        return
    _check_seq_len(model.seq_len, cp)  # the runtime's own rule (split_sequence calls it on tensors)
    if layout.cp_method == "all_to_all":
        check_ulysses_heads(model.num_heads, cp, layout.tp_size)
    t = layout.tp_size
    if layout.sequence_parallel and t > 1 and (model.seq_len // cp) % t:
        raise ValueError(
            f"sequence_parallel=True is not valid with tp_size={t}, cp_size={cp} and seq_len={model.seq_len}: "
            f"expected the tokens per cp rank, seq_len / cp_size = {model.seq_len // cp}, divisible by tp_size."
        )


def token_split(layout: Any) -> int:
    """Ranks each sequence is split over: ``cp_size`` (each cp rank holds ``seq_len / cp_size`` of its tokens)."""
    return layout.cp_size


def point_to_point(layout: Any) -> bool:
    """Ring attention's steps are point-to-point sends (each rank to the next); Ulysses' all-to-alls are
    collectives."""
    return layout.cp_method == "ring"


def layer_comm(method: str, micro_batch_size: int, seq_len: int, hidden_size: int, cp_size: int, tp_size: int,
               element_bytes: int, recompute_forward: bool = False) -> tuple[float, int, int]:
    """What one rank sends per attention layer per micro-batch on the cp axis, as lightning_par's cp methods run.

    * ``"ring"``: :func:`~lightning_par.context_parallel.comm_cost.ring_attention_layer_bytes`; ``cp - 1`` point-to-point sends of
      the K/V block forward and as many of its gradient backward (one more forward pass with recomputation);
    * ``"all_to_all"``: :func:`~lightning_par.context_parallel.comm_cost.ulysses_layer_bytes`; q, k and v go as one all-to-all, so two
      all-to-alls forward (q/k/v, output) and two backward (three forward passes' worth, six, with recomputation),
      each of ``cp - 1`` pairwise steps.

    Returns:
        ``(bytes, operations, steps per operation)``, for :func:`~lightning_par.comm_cost.collective_time`.

    Raises:
        ValueError: an unknown ``method``.
    """
    args = (micro_batch_size, seq_len, hidden_size, cp_size, tp_size, element_bytes, recompute_forward)
    passes = 3 if recompute_forward else 2
    if method == "ring":
        return ring_attention_layer_bytes(*args), passes * (cp_size - 1), ring_steps("p2p", cp_size)
    if method == "all_to_all":
        return ulysses_layer_bytes(*args), 2 * passes, ring_steps("all_to_all", cp_size)
    raise ValueError(f"method={method!r} is not valid: expected one of {list(CP_METHODS)}.")


def slot_comm_s(ctx: Any) -> float:
    """Seconds of one micro-batch's cp exchanges on a rank: :func:`layer_comm` per layer over the cp group's link,
    not overlapped (lightning_par's exchanges are blocking); recomputation (selective or full) reruns them forward."""
    lay, model = ctx.layout, ctx.model
    if lay.cp_size == 1:
        return 0.0
    bw, lat = ctx.link("cp", op="p2p" if point_to_point(lay) else "all_to_all")
    sent, n_ops, steps = layer_comm(lay.cp_method, lay.micro_batch_size, model.seq_len, model.hidden_size,
                                    lay.cp_size, lay.tp_size, ctx.element_bytes, ctx.recompute != "none")
    return ctx.layers * collective_time(sent, bw, lat, n_ops, steps)


#: The cp axis's terms (declared on its registry entry).
CONTEXT_PARALLEL_TERMS = PlannerTerms(check=check, slot_comm_s=slot_comm_s, token_split=token_split,
                                      point_to_point=point_to_point)
