"""``ModelCheckpoint`` configured for restarts: every N optimizer steps, the latest K kept, and the final step."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_par.checkpoint.atomic import remove_leftovers
from lightning_par.compat.lightning import save_model_checkpoint
from lightning_par.fault.resume import CHECKPOINT_FILENAME

log = logging.getLogger(__name__)

__all__ = ["StepCheckpoint"]


def _replace_link(filepath: str, linkpath: str) -> None:
    """``linkpath`` -> ``filepath`` (relative), replacing what was there in one rename: no moment without a link."""
    import os

    tmp = f"{linkpath}.tmp-link"
    if os.path.lexists(tmp):
        os.remove(tmp)
    os.symlink(os.path.relpath(filepath, os.path.dirname(linkpath)), tmp)
    os.replace(tmp, linkpath)


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
        async_save: write each checkpoint in the background (``torch.distributed.checkpoint.async_save``, see
            :mod:`lightning_par.checkpoint.async_save`): training goes on after the tensors are copied to memory; the
            checkpoint is committed (and counts as the newest) at the first step boundary after every rank's writes
            finished, at the next save, or at the end of ``fit``. Older checkpoints are removed, and ``last.ckpt`` is
            pointed at it, only after that: a failed or killed background save leaves ``last.ckpt`` on the newest
            committed checkpoint. Needs a lightning_par strategy.

    Raises:
        ValueError: ``every_n_steps < 1``, ``keep_last_k`` neither ``-1`` nor ``>= 1``, ``async_save`` not a bool;
            at ``setup``, ``async_save=True`` under a strategy that is not a lightning_par one.
    """

    def __init__(
        self, dirpath: str | Path, every_n_steps: int | None = None, keep_last_k: int = 2, async_save: bool = False
    ) -> None:
        if not isinstance(async_save, bool):
            raise ValueError(f"StepCheckpoint async_save={async_save!r} is not valid: expected true or false.")
        self.async_save = async_save
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

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Rank 0 removes what interrupted saves of earlier attempts left (``*.tmp-staging``; see
        :func:`lightning_par.checkpoint.atomic.remove_leftovers`) before this run saves anything."""
        super().setup(trainer, pl_module, stage)
        if self.async_save and not hasattr(trainer.strategy, "save_next_checkpoint_async"):
            raise ValueError(
                f"trainer.async_checkpoint=true is not valid with strategy {type(trainer.strategy).__name__}: "
                f"background saves need a lightning_par strategy (ddp_overlap, zero1/2/3, tensor_parallel, pipeline, "
                f"parallel_3d). Expected trainer.async_checkpoint=false."
            )
        if trainer.is_global_zero and self.dirpath is not None:
            for path in remove_leftovers(self.dirpath):
                log.warning("Removed %s, left by a checkpoint save that did not finish.", path)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A ``last.ckpt`` link left by an earlier attempt is ours to replace (not a reason for ``last-v1.ckpt``)."""
        super().on_train_start(trainer, pl_module)
        link = Path(str(self.dirpath)) / f"{self.CHECKPOINT_NAME_LAST}{self.FILE_EXTENSION}"
        if link.is_symlink():
            self.last_model_path = str(link)

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        """Lightning's save, in the background when ``async_save``."""
        if self.async_save:
            trainer.strategy.save_next_checkpoint_async()
        super()._save_checkpoint(trainer, filepath)

    def _link_checkpoint(self, trainer: L.Trainer, filepath: str, linkpath: str) -> None:  # type: ignore[override]
        """Lightning's ``last.ckpt`` link, made only once ``filepath`` is committed: a background save still pending
        gets the link when it commits (never, if it fails), so ``last.ckpt`` never names a checkpoint not in place."""
        pending = getattr(trainer.strategy, "_pending_save", None)
        if pending is not None and Path(pending.path) == Path(filepath):  # the same on every rank
            rank0 = trainer.is_global_zero

            def link() -> None:
                if rank0:
                    _replace_link(filepath, linkpath)

            pending.after_commit(link)
            return
        super()._link_checkpoint(trainer, filepath, linkpath)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any, **kwargs: Any) -> None:
        """Lightning's (a save every ``every_n_steps``); then commit a background save once every rank's writes are
        done (one all-reduce of a flag per step while one is pending)."""
        super().on_train_batch_end(trainer, pl_module, *args, **kwargs)
        if self.async_save:
            trainer.strategy.finish_pending_checkpoint(wait=False)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Nothing: saves follow optimizer steps only (``ModelCheckpoint`` would also save after each validation)."""

    def save_now(self, trainer: L.Trainer) -> str | None:
        """Save the current step (every rank must call it: a sharded save is collective), unless it was saved already.

        Returns:
            The path of the newest checkpoint (this step's), or ``None`` when nothing could be saved (not fitting).
        """
        save_model_checkpoint(self, trainer)
        if self.async_save:  # a background save must be committed before the process exits
            trainer.strategy.finish_pending_checkpoint(wait=True)
        return self.best_model_path or None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Save the final step if the last periodic save was earlier; then what ``ModelCheckpoint`` does."""
        self.save_now(trainer)
        super().on_train_end(trainer, pl_module)
