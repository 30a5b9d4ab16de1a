"""A replica group that rejoins is moved to the live group's place in the training data
(:mod:`lightning_par.fault_tolerance`): the checks on the training loop, and the move itself.

Lightning 2.6.6 has no public way to start an epoch's data at a batch other than 0 for a loader without
``state_dict``; the move reaches the fit loop's data fetcher and combined loader through the register
(:func:`lightning_par.compat.lightning.data_fetcher`, :func:`~lightning_par.compat.lightning.combined_loader`).
"""

from __future__ import annotations

import itertools
from typing import Any

__all__ = ["check_train_data", "move_train_data"]


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


def move_train_data(trainer: Any, epoch: int, ready: int, take: bool) -> Any:
    """Move the Trainer's training data to ``ready`` batches into epoch ``epoch``: the sampler's epoch set (its
    shuffle), a new iterator of Lightning's data fetcher, the first ``ready`` batches of the epoch passed over; then,
    with ``take``, the next batch fetched and returned (the one to train on now), else ``None`` (the next fetch of
    Lightning's loop reads it).

    With ``take``, a single loader skips the indices only (no sample is loaded) where it can: one with a
    ``start_pass_at(batches)`` method of its own (:class:`~lightning_par.data.resumable.ResumableDataLoader`, which
    then also counts the skipped batches in its ``state_dict``), or a ``DataLoader`` with a ``BatchSampler`` and no
    ``state_dict`` (Lightning's injected sampler). Any other loader (several loaders, an iterable dataset, a custom
    batch sampler, a loader with a state of its own that a skip behind its back would falsify), and every loader
    without ``take``, is read through and its batches dropped, which costs their loading time (no forward or
    backward). (Without ``take`` the new iterator may not be read before ``fit`` ends, and a skip left armed would
    apply to a later ``fit``.)

    Lightning 2.6.6 keeps the training data fetcher and the combined loader only in the private
    ``fit_loop._data_fetcher`` / ``fit_loop._combined_loader`` and has no public way to start an epoch's data at a
    batch other than 0 for a loader without ``state_dict`` (its own mid-epoch resume warns that such a loader starts
    again from the beginning of its epoch); these are the objects its epoch loop fetches from, reached and restarted
    only through the register (:func:`lightning_par.compat.lightning.combined_loader`,
    :func:`~lightning_par.compat.lightning.restart_training_fetch`).
    """
    from lightning.fabric.utilities.data import sized_len
    from torch.utils.data import BatchSampler

    from lightning_par.compat.lightning import combined_loader, restart_training_fetch

    combined = combined_loader(trainer)
    loaders = combined.flattened
    for loader in loaders:
        _set_epoch(loader, epoch)
    length = sized_len(combined)
    loader = loaders[0] if len(loaders) == 1 else None
    batch_sampler = getattr(loader, "batch_sampler", None)
    by_index = take and loader is not None and length is not None and 0 < ready < length
    if by_index and callable(getattr(loader, "start_pass_at", None)):
        loader.start_pass_at(ready)
    elif by_index and isinstance(batch_sampler, BatchSampler) and not callable(getattr(loader, "state_dict", None)):
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
