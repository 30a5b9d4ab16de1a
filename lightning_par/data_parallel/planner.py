"""The dp axis in the layout planner: its rules and the communication of one optimizer step over the data-parallel
ranks (ddp, ZeRO-1/2/3, HSDP), for the dense parameters and, under expert parallelism, the experts.

Groups, from the runtime's :class:`~lightning_par.parallel_dims.ParallelDims`: ddp all-reduces over ``dp_cp`` (every
data-parallel and cp rank: "ddp treats the product as one group"); the ZeRO modes shard and reduce over
``dp_shard_cp`` and, with HSDP (``dp_replicate_size = R > 1``), all-reduce each reduced shard over the ``R`` replicas
(:class:`~lightning_par.data_parallel.sharded_comm.ShardedGradientComm`, FSDP2's 2-D mesh); the experts do the same
over ``edp_shard`` (``dp_shard_cp / ep``) and ``dp_replicate``.

Pure Python: no torch import.
"""

from __future__ import annotations

import math
from typing import Any

from lightning_par.axis_registry import PlannerTerms
from lightning_par.comm_cost import all_reduce_bytes, collective_time, ring_steps, zero_step_comm_bytes
from lightning_par.data_parallel.options import DP_MODES
from lightning_par.parallel_dims import DERIVED_MESHES, SIZE_FIELDS
from lightning_par.state_cost import model_state_bytes, rank_param_groups

__all__ = ["DATA_PARALLEL_TERMS", "canonical", "check", "state_bytes", "step_comm_s"]

_BUCKET_BYTES = 25 * (1 << 20)  # the reducers' bucket_cap_mb default


def check(layout: Any, model: Any) -> None:
    """``dp_mode`` one of :data:`~lightning_par.data_parallel.options.DP_MODES`; a ZeRO mode only with something to
    shard (the runtime's ``dp_shard_cp`` mesh, ``dp_shard_size * cp_size``, above 1).

    Raises:
        ValueError: naming the field, its value and what would be valid.
    """
    if layout.dp_mode not in DP_MODES:
        raise ValueError(f"dp_mode={layout.dp_mode!r} is not valid: expected one of {list(DP_MODES)}.")
    if layout.dims().size("dp_shard_cp") == 1 and layout.dp_mode != "ddp":
        shard_sizes = " * ".join(SIZE_FIELDS[axis] for axis in DERIVED_MESHES["dp_shard_cp"])
        what = "dp_size=1" if layout.dp_replicate_size == 1 else (
            f"{shard_sizes} = 1 (dp_replicate_size={layout.dp_replicate_size} = dp_size)")
        raise ValueError(f"dp_mode={layout.dp_mode!r} is not valid with {what}: expected 'ddp' (nothing to shard).")


def canonical(layout: Any) -> bool:
    """HSDP only under a ZeRO mode: ``ddp`` all-reduces over ``dp_replicate x dp_shard`` as one group, so HSDP under
    ``ddp`` is the same run as ``ddp`` at ``dp_replicate_size=1`` (enumerated once)."""
    return layout.dp_replicate_size == 1 or layout.dp_mode != "ddp"


def _group_time(ctx: Any, params: float, shard: int, replicas: int) -> float:
    """Seconds of one optimizer step's dp collectives for ``params`` sharded over ``shard`` ranks (the ZeRO modes)
    with ``replicas`` HSDP replicas; ``ddp`` all-reduces over ``shard * replicas`` ranks."""
    lay, prec = ctx.layout, ctx.precision
    m, mode = lay.num_microbatches, lay.dp_mode
    n = shard * replicas if mode == "ddp" else shard
    if params == 0 or shard * replicas == 1:
        return 0.0
    total = 0.0
    if n > 1:
        bucket = min(params * prec.grad_bytes, _BUCKET_BYTES)  # the reducer's buckets (zero3: per block)
        bw, lat = ctx.link("dp_cp" if mode == "ddp" else "dp_shard_cp",
                           op="all_reduce" if mode in ("ddp", "zero1") else "reduce_scatter",
                           payload_bytes=bucket if mode != "zero3" else None)
        sent = zero_step_comm_bytes(mode, params, n, prec.param_bytes, prec.grad_bytes, m)
        buckets = max(1, math.ceil(params * prec.grad_bytes / _BUCKET_BYTES))
        steps = {  # ring steps per step: reductions and gathers over the buckets, or per block for zero3
            "ddp": buckets * ring_steps("all_reduce", n),
            "zero1": buckets * (ring_steps("all_reduce", n) + ring_steps("all_gather", n)),
            "zero2": buckets * (ring_steps("reduce_scatter", n) + ring_steps("all_gather", n)),
            "zero3": math.ceil(m * ctx.layers) * 3 * ring_steps("all_gather", n),
        }[mode]
        total += collective_time(sent, bw, lat, 1, steps)
    if mode != "ddp" and replicas > 1:  # HSDP: each reduced shard all-reduced over the replicas
        bw, lat = ctx.link("dp_replicate", op="all_reduce")
        times = m if mode == "zero3" else 1  # FSDP2 reduces every micro-batch's gradients
        buckets = max(1, math.ceil(params * prec.grad_bytes / _BUCKET_BYTES))
        sent = times * all_reduce_bytes(params * prec.grad_bytes / shard, replicas)
        total += collective_time(sent, bw, lat, times * buckets, ring_steps("all_reduce", replicas))
    return total


def step_comm_s(ctx: Any, window_s: float) -> float:
    """Exposed seconds of one optimizer step's dp collectives (:func:`~lightning_par.comm_cost.
    zero_step_comm_bytes` per group, the HSDP all-reduce of each shard over the replicas), for the dense parameters
    over ``dp_shard_cp`` (``dp_cp`` for ddp) and the experts over ``edp_shard`` (``edp``) — the experts' groups are
    taken at the dense groups' link, a subset of their ranks. ``device.comm_overlap`` of the part that fits in
    ``window_s`` (the compute it overlaps) is hidden."""
    lay, dims = ctx.layout, ctx.dims
    first, last = (rank_param_groups(ctx.model, lay, r) for r in (0, lay.pp_size - 1))
    dense, experts = max(first, last, key=sum)
    replicas = dims.dp_replicate_size
    total = _group_time(ctx, dense, dims.size("dp_shard_cp"), replicas)
    total += _group_time(ctx, experts, dims.size("edp_shard"), replicas)
    return total - ctx.device.comm_overlap * min(total, window_s)


def state_bytes(ctx: Any, pp_rank: int) -> float:
    """Bytes of the dense parameters' state on a rank of pipeline rank ``pp_rank``: the ZeRO formula
    (:func:`~lightning_par.state_cost.model_state_bytes`) with ``N`` the runtime's ``dp_shard_cp`` mesh (HSDP's
    replicas each hold a whole sharded copy; ddp a whole copy on every rank)."""
    dense = rank_param_groups(ctx.model, ctx.layout, pp_rank)[0]
    return model_state_bytes(dense, ctx.layout.dp_mode, ctx.dims.size("dp_shard_cp"), ctx.precision)


#: The dp axis's terms (declared on its registry entry).
DATA_PARALLEL_TERMS = PlannerTerms(check=check, step_comm_s=step_comm_s, state_bytes=state_bytes,
                                   canonical=canonical)
