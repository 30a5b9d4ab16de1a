"""The progress bar of a step-based run.

Lightning's ``RichProgressBar`` (its default when ``rich`` is installed) labels the training bar ``Epoch 0/-2`` when a
run is bounded by ``max_steps`` alone: Lightning sets ``max_epochs`` to ``-1`` ("no limit") and the bar prints
``max_epochs - 1``. :class:`StepProgressBar` prints ``Epoch 0`` then, as Lightning's ``TQDMProgressBar`` does, and
``Epoch 0/N`` when the run has an epoch limit.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks.progress.rich_progress import RichProgressBar

from lightning_par.compat.lightning import RICH_AVAILABLE

__all__ = ["StepProgressBar", "default_progress_bar"]


class StepProgressBar(RichProgressBar):
    """``RichProgressBar`` whose training description has no ``/-2`` without an epoch limit."""

    def _get_train_description(self, current_epoch: int) -> str:
        description = f"Epoch {current_epoch}"
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs >= 0:
            description += f"/{max_epochs - 1}"
        if len(self.validation_description) > len(description):  # as Lightning: equal widths do not flicker
            description = f"{description:{len(self.validation_description)}}"
        return description


def default_progress_bar() -> Any | None:
    """:class:`StepProgressBar` where Lightning would pick ``RichProgressBar`` (``rich`` installed), else ``None``
    (Lightning's ``TQDMProgressBar`` labels step-based runs correctly)."""
    return StepProgressBar() if RICH_AVAILABLE else None
