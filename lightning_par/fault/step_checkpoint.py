"""``ModelCheckpoint`` configured for restarts: every N optimizer steps, the latest K kept, and the final step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_par.fault.resume import CHECKPOINT_FILENAME

__all__ = ["StepCheckpoint"]


class StepCheckpoint(ModelCheckpoint):
    """Save ``<dirpath>/step-<N>.ckpt`` every ``every_n_steps`` optimizer steps and at the end of ``fit``; keep the
    latest ``keep_last_k``; ``last.ckpt`` links to the newest.

    A Lightning ``ModelCheckpoint`` with ``monitor="step", mode="max"`` (so "top k" means "latest k"), independent of
    validation, with one addition: the step that ends ``fit`` is saved too, also when it is not a multiple of
    ``every_n_steps``. Nothing is saved when ``fit`` ends with an exception (``save_on_exception=False``): a
    non-finite step (:class:`~lightning_par.fault.nonfinite.NonFiniteGuard`) can never replace the last good
    checkpoint. :func:`~lightning_par.fault.resume.latest_checkpoint` finds the newest complete one.

    Args:
        dirpath: the checkpoint directory.
        every_n_steps: optimizer steps between two saves; ``None``: only at the end.
        keep_last_k: checkpoints kept; ``-1`` keeps all.

    Raises:
        ValueError: ``every_n_steps < 1`` or ``keep_last_k`` neither ``-1`` nor ``>= 1``.
    """

    def __init__(self, dirpath: str | Path, every_n_steps: int | None = None, keep_last_k: int = 2) -> None:
        if every_n_steps is not None and (isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int)
                                          or every_n_steps < 1):
            raise ValueError(f"StepCheckpoint every_n_steps={every_n_steps!r} is not valid: expected an integer >= 1 or None.")
        if isinstance(keep_last_k, bool) or not isinstance(keep_last_k, int) or not (keep_last_k == -1 or keep_last_k >= 1):
            raise ValueError(f"StepCheckpoint keep_last_k={keep_last_k!r} is not valid: expected -1 or an integer >= 1.")
        super().__init__(
            dirpath=str(dirpath),
            filename=CHECKPOINT_FILENAME,
            auto_insert_metric_name=False,
            monitor="step",
            mode="max",
            save_top_k=keep_last_k,
            save_last="link",
            every_n_train_steps=every_n_steps or 0,
            save_on_train_epoch_end=False,
            save_on_exception=False,
        )

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A ``last.ckpt`` link left by an earlier attempt is ours to replace (not a reason for ``last-v1.ckpt``)."""
        super().on_train_start(trainer, pl_module)
        link = Path(str(self.dirpath)) / f"{self.CHECKPOINT_NAME_LAST}{self.FILE_EXTENSION}"
        if link.is_symlink():
            self.last_model_path = str(link)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Nothing: saves follow optimizer steps only (``ModelCheckpoint`` would also save after each validation)."""

    def save_now(self, trainer: L.Trainer) -> str | None:
        """Save the current step (every rank must call it: a sharded save is collective), unless it was saved already.

        Returns:
            The path of the newest checkpoint (this step's), or ``None`` when nothing could be saved (not fitting).
        """
        if not self._should_skip_saving_checkpoint(trainer):
            candidates: dict[str, Any] = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
        if getattr(self, "async_save", False):  # a background save must be committed before the process exits
            trainer.strategy.finish_pending_checkpoint(wait=True)
        return self.best_model_path or None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Save the final step if the last periodic save was earlier; then what ``ModelCheckpoint`` does."""
        self.save_now(trainer)
        super().on_train_end(trainer, pl_module)
