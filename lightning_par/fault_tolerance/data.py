"""A replica group that rejoins is moved to the live group's place in the training data
(:mod:`lightning_par.fault_tolerance`): the checks on the training loop, and the move itself.

A stateful loader that a ``load_state_dict`` moves while it is read
(:class:`~lightning_par.data.resumable.ResumableDataLoader`, the recipe's) is moved through its own
``load_state_dict``: nothing of Lightning's loop is touched. Lightning 2.6.6 has no public way to start an epoch's data
at a batch other than 0 for any other loader; that one is moved by restarting the fit loop's data fetcher, reached
through the register (:func:`lightning_par.compat.lightning.restart_training_fetch`).
"""

from __future__ import annotations

import itertools
from typing import Any

__all__ = ["check_train_data", "mark_last_batch", "moves_by_state", "move_train_data"]


class _SkipOnce:
    """Stands in for a batch sampler's ``sampler`` for one iteration: the first ``n`` indices of the sampler's order
    are skipped (indices only: no sample is loaded), then the batch sampler gets its own sampler back."""

    def __init__(self, batch_sampler: Any, n: int) -> None:
        self.batch_sampler, self.sampler, self.n = batch_sampler, batch_sampler.sampler, n

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Any:
        self.batch_sampler.sampler = self.sampler
        return itertools.islice(iter(self.sampler), self.n, None)


def _set_epoch(loader: Any, epoch: int) -> None:
    """``set_epoch(epoch)`` on the loader's sampler and its batch sampler's sampler, where they have one (Lightning's
    injected ``DistributedSampler``: the epoch seeds its shuffle), as Lightning's fit loop does at an epoch's start."""
    for sampler in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(epoch)


def check_train_data(trainer: Any) -> None:
    """Refuse, before the first step, a training loop whose data a rejoining group could not be moved in.

    Raises:
        ValueError: a ``training_step`` that takes ``dataloader_iter`` (it fetches its own batches, after the point
            where a joining group learns its place in the data); ``reload_dataloaders_every_n_epochs > 0`` (a
            restarted group's loader would come from ``train_dataloader()`` at another epoch than the live group's).
    """
    from lightning_par.compat.lightning import data_fetcher, is_dataloader_iter_fetcher

    if trainer.reload_dataloaders_every_n_epochs:
        raise ValueError(
            f"Trainer(reload_dataloaders_every_n_epochs={trainer.reload_dataloaders_every_n_epochs}) is not supported "
            f"with fault_tolerance.enabled=True: a replica group that rejoins takes the live group's epoch, but its "
            f"loader is the one train_dataloader() returned when it started, not the one the live group reloaded. "
            f"Use reload_dataloaders_every_n_epochs=0."
        )

    if is_dataloader_iter_fetcher(data_fetcher(trainer)):
        raise ValueError(
            "fault_tolerance.enabled=True does not support a training_step that takes `dataloader_iter`: a replica "
            "group that rejoins learns its place in the data (the live group's epoch and batch) when a batch goes to "
            "the device, and a step that fetches its own batches would read from the wrong place. Take `batch` (and "
            "`batch_idx`) in training_step."
        )


def moves_by_state(loader: Any) -> bool:
    """Whether ``loader`` is moved through its own state: a stateful loader that gives the state of a place
    (``state_at(batches)``), goes there at its next batch when ``load_state_dict`` is called while it is read, and
    hands out that batch (``next_batch()``), as :class:`~lightning_par.data.resumable.ResumableDataLoader`."""
    return all(callable(getattr(loader, name, None)) for name in ("state_at", "load_state_dict", "next_batch"))


def mark_last_batch(trainer: Any) -> None:
    """Set the epoch loop's ``is_last_batch`` for the batch just fetched from the loop's own count of the epoch's
    batches and the loader's length. Lightning sets it from its data fetcher's count, which starts where the fetcher's
    iterator started: after a loader moved by its state that is the epoch's start, not the place moved to."""
    from lightning.fabric.utilities.data import sized_len

    progress = trainer.fit_loop.epoch_loop.batch_progress
    length = sized_len(trainer.train_dataloader)
    if length is not None:  # called before the loop counts this batch as ready
        progress.is_last_batch = progress.current.ready + 1 >= length


def move_train_data(trainer: Any, epoch: int, ready: int, take: bool) -> Any:
    """Move the Trainer's training data to ``ready`` batches into epoch ``epoch``: the sampler's epoch set (its
    shuffle), a new iterator of Lightning's data fetcher, the first ``ready`` batches of the epoch passed over; then,
    with ``take``, the next batch fetched and returned (the one to train on now), else ``None`` (the next fetch of
    Lightning's loop reads it).

    One training loader that is moved by its state (:func:`moves_by_state`: the recipe's
    :class:`~lightning_par.data.resumable.ResumableDataLoader`) is moved by its own ``load_state_dict`` (the state of
    the place, ``state_at(ready)``: indices skipped, no sample loaded, the batches counted in its ``state_dict``), with
    or without ``take``; Lightning's loop then reads on from the loaded place, and nothing of it is touched.

    Any other loader is moved by restarting Lightning's data fetcher: Lightning 2.6.6 has no public way to start an
    epoch's data at a batch other than 0 for a loader without such a state (its own mid-epoch resume warns that a
    loader without ``state_dict`` starts again from the beginning of its epoch), and keeps the fetcher and the
    combined loader only in ``fit_loop._data_fetcher`` / ``fit_loop._combined_loader``, reached and restarted only
    through the register (:func:`lightning_par.compat.lightning.combined_loader`,
    :func:`~lightning_par.compat.lightning.restart_training_fetch`). With ``take``, a ``DataLoader`` with a
    ``BatchSampler`` and no ``state_dict`` (Lightning's injected sampler) skips the indices only; any other (several
    loaders, an iterable dataset, a custom batch sampler, a loader with a state of its own that a skip behind its back
    would falsify), and every such loader without ``take``, is read through and its batches dropped, which costs their
    loading time (no forward or backward). (Without ``take`` the new iterator may not be read before ``fit`` ends, and
    a skip left armed would apply to a later ``fit``.)
    """
    from lightning.fabric.utilities.data import sized_len
    from torch.utils.data import BatchSampler

    from lightning_par.compat.lightning import combined_loader, restart_training_fetch

    data = trainer.train_dataloader  # the loaders as given (one, or a collection)
    if moves_by_state(data):
        _set_epoch(data, epoch)
        data.load_state_dict(data.state_at(ready))
        return data.next_batch() if take else None
    combined = combined_loader(trainer)
    loaders = combined.flattened
    for loader in loaders:
        _set_epoch(loader, epoch)
    length = sized_len(combined)
    loader = loaders[0] if len(loaders) == 1 else None
    batch_sampler = getattr(loader, "batch_sampler", None)
    by_index = take and loader is not None and length is not None and 0 < ready < length
    if by_index and isinstance(batch_sampler, BatchSampler) and not callable(getattr(loader, "state_dict", None)):
        batch_sampler.sampler = _SkipOnce(batch_sampler, ready * batch_sampler.batch_size)
    else:
        by_index = False
    fetcher = restart_training_fetch(trainer, ready if by_index else None)  # a new iterator: the epoch's order
    if not by_index:
        for _ in range(ready):
            next(fetcher)
    if not take:
        return None
    batch, _, _ = next(fetcher)
    return batch
