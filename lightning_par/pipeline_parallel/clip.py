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


def total_grad_norm(
    params: Iterable[nn.Parameter], groups: Sequence[dist.ProcessGroup | None], norm_type: float = 2.0
) -> Tensor:
    """The ``norm_type``-norm of the gradients of ``params`` on this rank and of the parameters on the other ranks of
    each group in ``groups`` (e.g. ``[pp_group]``), as one vector. DTensor gradients count in full.

    Returns:
        A float32 scalar tensor, the same on every rank of the groups.
    """
    q = float(norm_type)
    grads = [p.grad for p in params if p.grad is not None]
    local = torch.nn.utils.get_total_norm(grads, q) if grads else torch.tensor(0.0)
    if hasattr(local, "full_tensor"):
        local = local.full_tensor()
    local = local.detach().float().reshape(())
    if q == float("inf"):
        for group in groups:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        return local
    powered = local.pow(q)
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
        groups: process groups whose ranks hold the rest of the model (the pp group; with tensor parallelism the
            DTensor gradients already count in full).
        norm_type: ``q`` of the q-norm; ``float("inf")`` for the max norm.
    """
    params = [p for p in params if p.grad is not None]
    total = total_grad_norm(params, groups, norm_type)
    if params:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total.to(params[0].grad.device))
    return total
