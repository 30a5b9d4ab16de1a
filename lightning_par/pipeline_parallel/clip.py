"""Gradient-norm clipping when the parameters are spread over ranks (pipeline stages).

``torch.nn.utils.clip_grad_norm_`` on one stage would clip by that stage's norm only; the model's norm combines the
stages: ``||g|| = (sum_s ||g_s||^q)^(1/q)`` for a q-norm (``max_s ||g_s||`` for ``q = inf``). Each rank computes its
stage's norm, one all-reduce over the pp group combines them, and every stage scales by the same factor
``min(1, max_norm / (||g|| + 1e-6))``, as ``clip_grad_norm_`` does for one process. Data-parallel replicas hold the same
(already averaged) gradients, so the dp axis takes no part.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["clip_grad_norm_across_ranks", "total_grad_norm"]


def _powered_norm_sum(grads: list[Tensor], q: float, device: torch.device | None = None) -> Tensor:
    """``sum_g ||g||_q^q`` (``max_g ||g||_inf`` for ``q = inf``) over this rank's share of ``grads``, each DTensor
    made whole over its own mesh (a float32 scalar, plain, on the gradients' device; on ``device`` when there are no
    gradients: a collective then sums it, on the group's device)."""
    from torch.distributed.tensor import DTensor

    by_spec: dict[tuple, list[Tensor]] = {}
    plain: list[Tensor] = []
    for g in grads:
        if isinstance(g, DTensor):
            by_spec.setdefault((g.device_mesh, tuple(g.placements)), []).append(g)
        else:
            plain.append(g)
    parts: list[Tensor] = []
    if plain:
        parts.append(torch.nn.utils.get_total_norm(plain, q).detach().float().reshape(()))
    for same in by_spec.values():
        # One mesh and placement: torch stacks the per-tensor norms; full_tensor() reduces over that mesh once.
        norm = torch.nn.utils.get_total_norm(same, q)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        parts.append(norm.detach().float().reshape(()))
    if not parts:
        return torch.zeros((), device=device)
    stacked = torch.stack(parts)
    return stacked.max() if q == float("inf") else stacked.pow(q).sum()


def total_grad_norm(
    params: Iterable[nn.Parameter], groups: Sequence[dist.ProcessGroup | None], norm_type: float = 2.0
) -> Tensor:
    """The ``norm_type``-norm of the gradients of ``params`` on this rank and of the parameters on the other ranks of
    each group in ``groups`` (e.g. ``[pp_group]``), as one vector.

    DTensor gradients count in full, whatever their mesh: tensor-parallel shards (tp mesh), ZeRO shards (dp mesh) and
    FSDP2 + TP shards (``(dp, tp)`` mesh) may be mixed with plain gradients on one stage. The gradients are grouped
    by (mesh, placements); each group's norm is reduced over its own mesh (``full_tensor``), the plain gradients are
    counted once, and the ``q``-th powers are summed (max for ``q = inf``), then summed over ``groups``. This is
    Megatron-LM's global-norm clipping under model parallelism (Shoeybi et al. 2019, the ``clip_grad_norm`` of its
    ``mpu``), with DTensor doing the tp/dp reductions.

    Returns:
        A float32 scalar tensor on the parameters' device, the same on every rank of the groups.
    """
    q = float(norm_type)
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    device = _local_device(params[0]) if params else None
    powered = _powered_norm_sum(grads, q, device)
    if q == float("inf"):
        for group in groups:
            dist.all_reduce(powered, op=dist.ReduceOp.MAX, group=group)
        return powered
    for group in groups:
        dist.all_reduce(powered, op=dist.ReduceOp.SUM, group=group)
    return powered.pow(1.0 / q)


def clip_grad_norm_across_ranks(
    params: Iterable[nn.Parameter],
    max_norm: float,
    groups: Sequence[dist.ProcessGroup | None],
    norm_type: float = 2.0,
) -> Tensor:
    """Clip the gradients of ``params`` in place by the norm over every rank of ``groups``; return that norm.

    Args:
        params: this rank's parameters.
        max_norm: largest allowed total norm.
        groups: process groups whose ranks hold the rest of the model (the pp group; DTensor gradients, tensor-
            or data-parallel shards, already count in full).
        norm_type: ``q`` of the q-norm; ``float("inf")`` for the max norm.
    """
    params = [p for p in params if p.grad is not None]
    total = total_grad_norm(params, groups, norm_type)
    if max_norm == float("inf"):  # the norm only (MeshStrategy.grad_norm): nothing to scale
        return total
    # The coefficient of clip_grad_norm_ (always applied, 1.0 when under the limit), as a float so that it scales
    # plain and DTensor gradients of any mesh alike.
    coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    with torch.no_grad():
        for p in params:
            p.grad.mul_(coef)
    return total


def _local_device(param: Tensor) -> torch.device:
    """The device of ``param``'s local data (a DTensor's shard)."""
    from torch.distributed.tensor import DTensor

    return param.to_local().device if isinstance(param, DTensor) else param.device
