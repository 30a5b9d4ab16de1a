"""Learning rate scaled with the global batch, with a linear warm-up measured in samples.

Goyal et al. 2017 ("Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour", §2.1): when the global batch grows
by ``k``, multiply the learning rate by ``k`` (the *linear* rule), and warm it up gradually over the first samples
(§2.2), because the scaled rate is too large while the weights change fast. For adaptive optimizers the *sqrt* rule
(multiply by ``sqrt(k)``; Krizhevsky 2014, "One weird trick", §5; Malladi et al. 2022 for Adam) is the usual choice.

Here ``k = global_batch / reference_batch``, where ``global_batch = micro_batch * dp_size * accumulate_grad_batches``
(samples per optimizer step) and ``reference_batch`` is the batch the configured learning rate was tuned for. The
warm-up is given in samples (``warmup_samples``) and lasts ``ceil(warmup_samples / global_batch)`` optimizer steps,
so runs at different dp sizes warm up over the same samples: a sweep over dp sizes keeps the per-sample schedule.
During warm-up the rate is multiplied by ``(step + 1) / warmup_steps`` (linear from near 0, as GPT training does;
Goyal et al. start from the unscaled rate instead). :class:`~lightning_par.callbacks.LRScalingCallback` applies this
on top of any optimizer and scheduler a LightningModule configures.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["LR_SCALING_RULES", "check_lr_scaling", "lr_scale_factor", "warmup_multiplier", "warmup_steps"]

#: Scaling rules: ``none`` keeps the configured rate, ``linear`` multiplies it by ``k``, ``sqrt`` by ``sqrt(k)``.
LR_SCALING_RULES: tuple[str, ...] = ("none", "linear", "sqrt")


def check_lr_scaling(rule: Any, reference_batch: Any, warmup_samples: Any, prefix: str = "") -> None:
    """Validate the three options (``prefix`` is put before each field name in the messages, e.g. ``"lr_scaling."``).

    Raises:
        ValueError: an unknown rule, a ``reference_batch`` that is not ``None`` or an integer >= 1, or a
            ``warmup_samples`` that is not an integer >= 0.
    """
    if rule not in LR_SCALING_RULES:
        raise ValueError(f"{prefix}rule={rule!r} is not valid: expected one of {list(LR_SCALING_RULES)}.")
    if reference_batch is not None and (
        isinstance(reference_batch, bool) or not isinstance(reference_batch, int) or reference_batch < 1
    ):
        raise ValueError(
            f"{prefix}reference_batch={reference_batch!r} is not valid: expected None (one replica's micro-batch) or "
            f"an integer >= 1 (samples per optimizer step the learning rate was tuned for)."
        )
    if isinstance(warmup_samples, bool) or not isinstance(warmup_samples, int) or warmup_samples < 0:
        raise ValueError(f"{prefix}warmup_samples={warmup_samples!r} is not valid: expected an integer >= 0 (samples).")


def lr_scale_factor(rule: str, global_batch: int, reference_batch: int) -> float:
    """The factor on the configured learning rate: ``k``, ``sqrt(k)`` or 1 with ``k = global_batch / reference_batch``.

    Raises:
        ValueError: an unknown rule or a batch < 1.
    """
    check_lr_scaling(rule, reference_batch, 0)
    if global_batch < 1:
        raise ValueError(f"global_batch={global_batch!r} is not valid: expected an integer >= 1.")
    k = global_batch / reference_batch
    return {"none": 1.0, "linear": k, "sqrt": math.sqrt(k)}[rule]


def warmup_steps(warmup_samples: int, global_batch: int) -> int:
    """Optimizer steps of a warm-up over ``warmup_samples`` samples: ``ceil(warmup_samples / global_batch)``."""
    return -(-warmup_samples // global_batch)


def warmup_multiplier(step: int, num_warmup_steps: int) -> float:
    """Factor on the learning rate at optimizer step ``step`` (0-based): ``(step + 1) / num_warmup_steps`` during the
    warm-up, then 1."""
    if num_warmup_steps <= 0 or step >= num_warmup_steps:
        return 1.0
    return (step + 1) / num_warmup_steps
