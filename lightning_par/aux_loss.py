"""Auxiliary losses that reach backward from inside the model, wherever the main loss is computed.

A mixture-of-experts router adds a load-balancing loss and a z-loss at every MoE layer. Under pipelining the layer may
run on a stage that never sees the loss, so the loss cannot simply be summed into it. As Megatron-core's
``MoEAuxLossAutoScaler`` does, :func:`attach_aux_loss` ties the auxiliary loss to an activation the main loss depends
on: the forward returns the activation unchanged, and backward gives the auxiliary loss the gradient it would get had
it been added to the loss — the factor the step multiplies its loss by before backward (``1 / accumulate_grad_batches``,
and ``1 / num_microbatches`` per micro-batch under a pipeline schedule). The steps set that factor for the step's
forward with :func:`aux_loss_scaled` (a :class:`~lightning_par.step_context.StepVar`, back to the outer value when the
step's forward ends); in one process without accumulation it is 1.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from lightning_par.step_context import StepVar

__all__ = ["attach_aux_loss", "aux_loss_scale", "aux_loss_scaled", "set_aux_loss_scale"]

#: The factor of the step running now (1.0 outside every step).
_SCALE: StepVar[float] = StepVar("aux_loss_scale", 1.0)


@contextmanager
def aux_loss_scaled(scale: float) -> Generator[float, None, None]:
    """Run the enclosed forward with ``scale``, the factor the step multiplies its loss by before backward (the outer
    factor is back on exit). Backward needs no scope: :func:`attach_aux_loss` keeps the factor of its forward, also
    for a recomputation by activation checkpointing, which rebuilds saved tensors only."""
    with _SCALE.scoped(float(scale)) as value:
        yield value


def set_aux_loss_scale(scale: float) -> None:
    """Set the factor until set again on this thread (for a loop that runs its own steps; the package's steps use
    :func:`aux_loss_scaled`, which cannot leave a step's factor behind)."""
    _SCALE.set(float(scale))


def aux_loss_scale() -> float:
    """The factor of the step running now (:func:`aux_loss_scaled`, :func:`set_aux_loss_scale`; 1.0 outside)."""
    return _SCALE.get()


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, aux: Tensor, scale: float) -> Tensor:
        ctx.aux_shape, ctx.aux_dtype, ctx.scale = aux.shape, aux.dtype, scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


def attach_aux_loss(x: Tensor, aux: Tensor) -> Tensor:
    """``x`` unchanged, such that backward through it also backpropagates ``aux`` (a scalar loss, already weighted) as
    if ``aux`` had been added to the step's loss.

    Args:
        x: an activation the step's loss depends on (e.g. a MoE layer's output ``(batch, seq, d)``).
        aux: a scalar tensor with a graph to the parameters it depends on.

    Returns:
        ``x`` (a view), whose backward also sends ``aux_loss_scale()`` into ``aux``.
    """
    if not (torch.is_grad_enabled() and aux.requires_grad):
        return x
    return _AttachAuxLoss.apply(x, aux, _SCALE.get())
