"""Scale any LightningModule's learning rate with the global batch, warm it up per sample, log both.

The rule lives in :mod:`lightning_par.lr_scaling` (Goyal et al. 2017). This callback applies it to whatever
``configure_optimizers`` built (any optimizer, any scheduler), so it works for the reference GPT and for a user's
model alike; nothing in the model changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning as L
import torch

from lightning_par.callbacks.metrics import parallel_sizes
from lightning_par.lr_scaling import check_lr_scaling, lr_scale_factor, warmup_multiplier, warmup_steps

__all__ = ["LRScalingCallback"]

#: Param-group key recording the factor already applied (kept in optimizer checkpoints, so a resumed run is not
#: scaled twice).
SCALE_KEY = "lp_lr_scale"


def _batch_samples(batch: Any) -> int | None:
    """Samples in a batch: dim 0 of its first tensor (a tensor, a tuple/list, or a mapping of them)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else ()
    for value in values:
        found = _batch_samples(value)
        if found is not None:
            return found
    return None


class LRScalingCallback(L.Callback):
    """Multiply the learning rate of every param group by the scaling rule's factor, warm it up over
    ``warmup_samples`` samples, and log ``global_batch`` and ``lr_effective`` (the rate of the first param group as the
    optimizer uses it, after scaling, warm-up and the module's own scheduler).

    When the first batch arrives, ``global_batch = micro_batch * dp_size * accumulate_grad_batches`` is known (the
    micro-batch read from the batch, ``dp_size`` from the strategy's layout, or the world size for other strategies):
    each param group's ``lr`` (and ``initial_lr``) and each scheduler's ``base_lrs`` are multiplied by the factor once.
    Schedulers that recompute the rate from ``base_lrs`` (``LambdaLR``, cosine, step) and those that chain on the
    group's rate both keep the factor. The warm-up multiplies the rate by :func:`~lightning_par.lr_scaling.
    warmup_multiplier` just for each optimizer step (torch's optimizer step pre- and post-hooks) and restores it right
    after, before Lightning steps the scheduler, so it composes with any scheduler (a module's own warm-up would
    multiply with it: the recipe refuses both at once).

    Args:
        rule: ``"none"``, ``"linear"`` or ``"sqrt"``.
        reference_batch: the global batch (samples per optimizer step) the configured rate was tuned for; ``None``:
            one replica's micro-batch (the global batch of a dp 1 run without accumulation).
        warmup_samples: samples of linear warm-up (0: none).

    Raises:
        ValueError: an invalid option (see :func:`lightning_par.lr_scaling.check_lr_scaling`).
    """

    def __init__(self, rule: str = "none", reference_batch: int | None = None, warmup_samples: int = 0) -> None:
        check_lr_scaling(rule, reference_batch, warmup_samples)
        self.rule = rule
        self.reference_batch = reference_batch
        self.warmup_samples = warmup_samples
        self.global_batch: int | None = None
        self.micro_batch: int | None = None
        self.factor: float | None = None
        self.num_warmup_steps = 0
        self.last_lrs: list[float] = []
        self.peak_lrs: list[float] = []
        self._trainer: Any = None
        self._saved: list[tuple[dict[str, Any], Any]] = []
        self._handles: list[Any] = []

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.factor is not None:
            return
        micro = _batch_samples(batch)
        if micro is None:
            raise ValueError(
                f"LRScalingCallback cannot count the samples of a batch of type {type(batch).__name__}: expected a "
                f"tensor, or a tuple/list/mapping holding one (samples along dim 0)."
            )
        self.micro_batch = micro
        self._trainer = trainer
        self.global_batch = micro * parallel_sizes(trainer)["dp_size"] * trainer.accumulate_grad_batches
        reference = self.reference_batch or micro
        self.factor = lr_scale_factor(self.rule, self.global_batch, reference)
        self.num_warmup_steps = warmup_steps(self.warmup_samples, self.global_batch)
        for optimizer in trainer.optimizers:
            ratios = []
            for group in optimizer.param_groups:
                ratio = self.factor / group.get(SCALE_KEY, 1.0)
                ratios.append(ratio)
                group["lr"] = group["lr"] * ratio
                if "initial_lr" in group:
                    group["initial_lr"] = group["initial_lr"] * ratio
                group[SCALE_KEY] = self.factor
            for config in trainer.lr_scheduler_configs:
                scheduler = config.scheduler
                if getattr(scheduler, "optimizer", None) is optimizer and hasattr(scheduler, "base_lrs"):
                    scheduler.base_lrs = [b * r for b, r in zip(scheduler.base_lrs, ratios)]
            if self.num_warmup_steps:
                self._handles += [optimizer.register_step_pre_hook(self._warm), optimizer.register_step_post_hook(
                    self._restore)]

    def _warm(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # Lightning runs the closure (training_step, backward) inside optimizer.step: this hook comes first, and the
        # step counter is the one of the update being made.
        m = warmup_multiplier(self._trainer.global_step, self.num_warmup_steps)
        if m != 1.0:
            self._saved = [(group, group["lr"]) for group in optimizer.param_groups]
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * m

    def _restore(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group, lr in self._saved:  # right after the step: Lightning steps the scheduler next
            group["lr"] = lr
        self._saved = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        m = warmup_multiplier(trainer.global_step, self.num_warmup_steps)
        self.last_lrs = [float(group["lr"]) for group in optimizer.param_groups]  # warmed up already (see _warm)
        if m == 1.0 and not self.peak_lrs:
            self.peak_lrs = list(self.last_lrs)
        pl_module.log("lr_effective", self.last_lrs[0], on_step=True, on_epoch=False, batch_size=1)
        pl_module.log("global_batch", float(self.global_batch or 0), on_step=True, on_epoch=False, batch_size=1)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def summary_extras(self) -> dict[str, Any]:
        """``global_batch``, ``micro_batch``, ``lr_scaling`` (rule), ``lr_reference_batch``, ``lr_scale_factor``,
        ``lr_warmup_samples``, ``lr_warmup_steps``, ``lr_after_warmup`` (per param group, at the first step
        with the full rate: the warm-up's last step; ``None`` if it was not reached) and ``lr_last`` (per param group,
        at the last step)."""
        return {
            "global_batch": self.global_batch,
            "micro_batch": self.micro_batch,
            "lr_scaling": self.rule,
            "lr_reference_batch": self.reference_batch or self.micro_batch,
            "lr_scale_factor": self.factor,
            "lr_warmup_samples": self.warmup_samples,
            "lr_warmup_steps": self.num_warmup_steps,
            "lr_after_warmup": self.peak_lrs or None,
            "lr_last": self.last_lrs,
        }
