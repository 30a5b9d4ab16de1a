"""Bytes per parameter and per activation element under each training precision.

The ZeRO paper's accounting (Rajbhandari et al. 2020, §3.1): mixed-precision Adam keeps 16-bit parameters and
gradients (``2 + 2`` bytes) and ``K = 12`` bytes of fp32 optimizer state (master copy, momentum, variance) per
parameter. Full fp32 training keeps ``4 + 4`` bytes and ``K = 8`` (momentum, variance). PyTorch autocast
(Lightning's ``"bf16-mixed"``) keeps fp32 parameters, gradients and state and computes activations in bf16.

Pure Python: no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LIGHTNING_PRECISIONS", "PRECISIONS", "Precision", "get_precision"]


@dataclass(frozen=True)
class Precision:
    """Storage sizes of one training precision.

    Args:
        name: label.
        param_bytes: bytes per parameter of the working copy.
        grad_bytes: bytes per gradient element (also the element size of the gradient reduction).
        optimizer_bytes: bytes of optimizer state per parameter ``K`` (Adam moments, plus an fp32 master copy
            under mixed precision).
        activation_bytes: bytes per activation element.
    """

    name: str
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int

    @property
    def state_bytes(self) -> int:
        """Bytes of model state per parameter without sharding: ``param + grad + optimizer``."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


#: Named precisions (Adam-family optimizer).
PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", 4, 4, 8, 4),
    "amp-bf16": Precision("amp-bf16", 4, 4, 8, 2),
    "mixed-bf16": Precision("mixed-bf16", 2, 2, 12, 2),
}

#: Lightning ``Trainer(precision=...)`` -> planner precision.
LIGHTNING_PRECISIONS: dict[str, str] = {
    "32-true": "fp32",
    "32": "fp32",
    "bf16-mixed": "amp-bf16",
    "16-mixed": "amp-bf16",
}


def get_precision(precision: str | Precision) -> Precision:
    """Resolve a precision name (a key of :data:`PRECISIONS` or :data:`LIGHTNING_PRECISIONS`) or pass a spec through.

    Raises:
        ValueError: an unknown name; the message lists the valid ones.
    """
    if isinstance(precision, Precision):
        return precision
    if precision in PRECISIONS:
        return PRECISIONS[precision]
    if precision in LIGHTNING_PRECISIONS:
        return PRECISIONS[LIGHTNING_PRECISIONS[precision]]
    raise ValueError(
        f"precision={precision!r} is not valid: expected one of {sorted(PRECISIONS) + sorted(LIGHTNING_PRECISIONS)}."
    )
