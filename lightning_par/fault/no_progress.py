"""A run that was asked to train and trained no optimizer step fails instead of exiting 0.

Lightning skips training when the training dataloader is empty on a rank (``len == 0``, or ``limit_train_batches``
rounding to 0) with a warning only, and the job then ends successfully with nothing learned: ``summary.json`` says
``"steps": 0`` and a sweep scores the job as if it had trained. :class:`ProgressGuard` records the optimizer step at
the start of training (after a resume) and raises :class:`NoTrainingStepError` at the end of ``fit`` when it has not
moved although steps remained (a run resumed at ``max_steps`` has none left, and passes; so does a run stopped on
purpose: ``trainer.should_stop``, e.g. a preemption agreed before the first step). Put it first among the callbacks
so that it fails the run before others write their end-of-run files.
"""

from __future__ import annotations

from typing import Any

import lightning as L

__all__ = ["NoTrainingStepError", "ProgressGuard"]


class NoTrainingStepError(RuntimeError):
    """``fit`` returned without one optimizer step although ``max_steps`` had not been reached."""


class ProgressGuard(L.Callback):
    """Fails a ``fit`` that trained no optimizer step (see the module docstring)."""

    def __init__(self) -> None:
        self.start_step: int | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start_step = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start_step = trainer.global_step

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Raise if this ``fit`` trained no step while steps remained.

        Raises:
            NoTrainingStepError: naming the rank, its number of training batches and the step it stayed at.
        """
        if trainer.should_stop or trainer.interrupted:
            return
        start = trainer.global_step if self.start_step is None else self.start_step
        left = trainer.max_steps < 0 or start < trainer.max_steps
        if trainer.global_step > start or not left:
            return
        batches: Any = trainer.num_training_batches
        raise NoTrainingStepError(
            f"the run trained 0 optimizer steps (step {start}, max_steps={trainer.max_steps}): rank "
            f"{trainer.global_rank} had {batches} training batches. The training data gives no full batch to every "
            f"data-parallel rank: give it at least dp_size * batch_size samples (with drop_last), or check "
            f"trainer.limit_train_batches."
        )
