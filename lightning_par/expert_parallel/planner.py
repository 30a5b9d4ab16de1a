"""The ep axis in the layout planner: its rules (shared with the runtime's check) and its token all-to-alls.

Expert parallelism borrows its ranks from ``dp_shard x cp`` (:class:`~lightning_par.parallel_dims.ParallelDims`): each
MoE block's experts are split over ``ep`` ranks (each holds ``E / ep``), their gradients and optimizer state are
sharded over ``edp_shard = dp_shard * cp / ep`` ranks and averaged over ``edp`` (``dp_replicate x edp_shard``), and each
MoE block moves its routed tokens to their experts' ranks and back: two all-to-alls forward and two backward
(GShard, Lepikhin et al. 2020, §2.2), each rank sending ``(ep-1)/ep`` of its ``b s k`` routed copies of ``h`` elements.

Pure Python: no torch import.
"""

from __future__ import annotations

from typing import Any

from lightning_par.axis_registry import PlannerTerms
from lightning_par.comm_cost import all_to_all_bytes, collective_time, ring_steps
from lightning_par.state_cost import model_state_bytes, rank_param_groups

__all__ = [
    "EXPERT_PARALLEL_TERMS", "check", "check_num_experts", "expert_shard_ranks", "layer_all_to_all_bytes", "slot_comm_s",
    "state_bytes",
]


def check_num_experts(where: str, num_experts: int, ep_size: int, borrowed: int) -> None:
    """Each ep rank holds ``num_experts / ep_size`` experts (the runtime's check and the planner's).

    Args:
        where: how the experts are named in the message (a module path, or ``"num_experts"``).
        num_experts: experts of the layer.
        ep_size: ep ranks.
        borrowed: ``dp_shard_size * cp_size``, the ranks ep borrows from (the valid sizes divide it too).

    Raises:
        ValueError: ``num_experts`` not divisible by ``ep_size``, naming both and the valid ep sizes.
    """
    if num_experts % ep_size:
        valid = [d for d in range(1, num_experts + 1) if num_experts % d == 0 and borrowed % d == 0]
        raise ValueError(
            f"ep_size={ep_size} is not valid for {where} with num_experts={num_experts}: each ep rank holds "
            f"num_experts / ep_size experts; expected ep_size in {valid}."
        )


def expert_shard_ranks(num_experts: int, ep_size: int, edp_shard: int) -> float:
    """The ``N`` that the ZeRO formulas divide an ep rank's expert state by, on its fullest ``edp_shard`` rank.

    The dp modes shard each expert tensor ``(E / ep, ...)`` on dim 0, so a shard holds whole experts: the first ranks
    of ``edp_shard`` hold ``ceil((E / ep) / edp_shard)`` experts each, later ones fewer or none (measured at world 8:
    ``E / ep = 2`` experts over ``edp_shard = 4`` ranks put one expert on each of two ranks). The fullest rank holds
    ``ceil(E_l / N) / E_l`` of them, i.e. ``N_eff = E_l / ceil(E_l / N)`` (``= N`` when ``N`` divides ``E_l``).

    Args:
        num_experts: experts ``E`` of a MoE block.
        ep_size: ep ranks.
        edp_shard: ranks the experts' state is sharded over (``dp_shard * cp / ep``).

    Returns:
        ``N_eff`` (``>= 1``).
    """
    local = max(1, num_experts // ep_size)
    return local / -(-local // edp_shard)


def check(layout: Any, model: Any) -> None:
    """``ep_size > 1`` only for a model with experts, whose count it divides (the sizes themselves:
    :class:`~lightning_par.parallel_dims.ParallelDims`).

    Raises:
        ValueError: naming the field, its value and what would be valid.
    """
    ep = layout.ep_size
    if ep == 1:
        return
    if not model.num_experts:
        raise ValueError(f"ep_size={ep} is not valid for a dense model (num_experts=0): expected 1.")
    check_num_experts("the model", model.num_experts, ep, layout.dims().size("dp_shard_cp"))


def layer_all_to_all_bytes(micro_batch_size: int, seq_len: int, hidden_size: int, top_k: int, ep_size: int,
                           element_bytes: int) -> float:
    """Bytes one rank sends in *one* token all-to-all of one MoE block: its ``b s k`` routed copies of ``h`` elements
    (``s`` the tokens this rank holds), ``(ep-1)/ep`` of them to other ranks (:func:`~lightning_par.comm_cost.
    all_to_all_bytes`); balanced routing assumed."""
    return all_to_all_bytes(micro_batch_size * seq_len * top_k * hidden_size * element_bytes, ep_size)


def slot_comm_s(ctx: Any) -> float:
    """Seconds of one micro-batch's token exchanges on a rank: per MoE block two all-to-alls forward and two backward
    (one more forward pair with full recomputation) over the ep group's link, not overlapped (the dispatch is
    blocking)."""
    lay, model = ctx.layout, ctx.model
    if lay.ep_size == 1:
        return 0.0
    bw, lat = ctx.link("ep", op="all_to_all")
    sent = layer_all_to_all_bytes(lay.micro_batch_size, ctx.sequence_tokens, model.hidden_size,
                                  model.moe_top_k, lay.ep_size, ctx.element_bytes)
    n_ops = 6 if ctx.recompute == "full" else 4
    moe_layers = model.moe_layer_count() / lay.pp_size
    return moe_layers * collective_time(n_ops * sent, bw, lat, n_ops, ring_steps("all_to_all", lay.ep_size))


def state_bytes(ctx: Any, pp_rank: int) -> float:
    """Bytes of the experts' state on the fullest rank of pipeline rank ``pp_rank``: its ``E / ep`` experts of each of
    its MoE blocks, the ZeRO formula (:func:`~lightning_par.state_cost.model_state_bytes`) over
    :func:`expert_shard_ranks` (0 for a dense model)."""
    experts = rank_param_groups(ctx.model, ctx.layout, pp_rank)[1]
    if not experts:
        return 0.0
    n = expert_shard_ranks(ctx.model.num_experts, ctx.layout.ep_size, ctx.dims.size("edp_shard"))
    return model_state_bytes(experts, ctx.layout.dp_mode, n, ctx.precision)


#: The ep axis's terms (declared on its registry entry).
EXPERT_PARALLEL_TERMS = PlannerTerms(check=check, slot_comm_s=slot_comm_s, state_bytes=state_bytes)
