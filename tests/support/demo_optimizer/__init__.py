"""A demonstration optimizer added the way docs/adding-an-optimizer.md describes, from outside the package.

Scaled sign-SGD: each parameter matrix ``W`` with gradient ``G`` steps ``W -= lr * s * tanh(G / s)`` with
``s = mean(|G|)`` over the **whole** matrix: signSGD (Bernstein et al. 2018, "signSGD: compressed optimisation for
non-convex problems", §2) with a per-matrix scale, the sign smoothed by ``tanh`` so that the update is continuous in
``G`` (a parity test at 1e-5 cannot hold across a discontinuity: dp ranks sum gradients in another order than one
process). Like Muon it needs something of the whole matrix, here one number, so it must handle each layout:

* a DTensor gradient (tensor parallelism, ZeRO-3): ``G.abs().mean()`` is a DTensor over the whole matrix;
* a ZeRO-1/2 chunk (a plain tensor, one rank's piece): the engine announces a view of the whole matrix through
  ``set_global_views`` (the same protocol Muon uses), the mean is taken on it;
* a whole tensor (ddp, one process): the mean is local.

Nothing in ``lightning_par`` names this optimizer: a module selects it with
``optimizer="tests.support.demo_optimizer:SIGN_SGD"`` and its one option as ``sign_sgd_lr``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_par.optim.registry import BaseHParams, OptimizerEntry

__all__ = ["SIGN_SGD", "ScaledSignSGD", "SignSGDOptions"]


@dataclass(frozen=True)
class SignSGDOptions:
    """The optimizer's options, declared once (keywords ``sign_sgd_<field>``).

    Attributes:
        lr: the step size, in units of the matrix's mean absolute gradient.

    Raises:
        ValueError: ``lr`` not a positive number.
    """

    lr: float = 0.01

    def __post_init__(self) -> None:
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not self.lr > 0:
            raise ValueError(f"sign_sgd_lr={self.lr!r} is not valid: expected a positive float.")


class ScaledSignSGD(torch.optim.Optimizer):
    """``W -= lr * s * tanh(G / s)``, ``s = mean |G|`` over the whole parameter, on every layout (module docstring).

    ``step`` is collective when parameters are sharded (every rank holding a piece must step, in the same order).
    """

    def __init__(self, params: Iterable[Any], lr: float = SignSGDOptions.lr) -> None:
        super().__init__(params, {"lr": lr})
        #: id(chunk this optimizer steps) -> chunk-shaped tensor -> DTensor of the whole parameter (ZeRO-1/2).
        self._global_views: dict[int, Callable[[Tensor], DTensor]] = {}
        #: steps taken, and how many parameters were scaled through a view or a DTensor in the last one.
        self.steps_taken, self.whole_matrix_reads = 0, 0

    def set_global_views(self, views: dict[int, Callable[[Tensor], DTensor]]) -> None:
        """The ZeRO-1/2 engine's views of the whole parameters behind this optimizer's chunks."""
        self._global_views.update(views)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = closure() if closure is not None else None
        reads = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                whole = grad if isinstance(grad, DTensor) else self._global_views.get(id(p), lambda t: None)(grad)
                if whole is None:
                    scale = float(grad.abs().mean())
                else:
                    reads += 1
                    scale = float(whole.abs().mean().full_tensor())
                if scale > 0:
                    p.add_(torch.tanh(grad / scale), alpha=-group["lr"] * scale)
        self.steps_taken += 1
        self.whole_matrix_reads = reads
        return loss


def build_sign_sgd(module: nn.Module, options: SignSGDOptions, base: BaseHParams) -> ScaledSignSGD:
    """Every trainable parameter of ``module`` on :class:`ScaledSignSGD` (the host's AdamW settings are unused)."""
    return ScaledSignSGD([p for p in module.parameters() if p.requires_grad], lr=options.lr)


#: The entry a module names by import path: ``optimizer="tests.support.demo_optimizer:SIGN_SGD"``.
SIGN_SGD = OptimizerEntry("sign_sgd", SignSGDOptions, build_sign_sgd)
