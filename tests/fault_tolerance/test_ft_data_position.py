"""Moving a Trainer's training data to a replica group's place (epoch, batches already read): what a rejoining group
does under fault tolerance (:func:`~lightning_par.fault_tolerance.move_train_data`), in one process,
with the index-skipping path (one ``DataLoader`` with a ``BatchSampler``) and the read-through path (a batch sampler
of the user's own); and the loops it refuses (:func:`~lightning_par.fault_tolerance.check_train_data`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

from lightning_par.data.resumable import ResumableDataLoader
from lightning_par.fault_tolerance import check_train_data, move_train_data

N, B = 40, 4  # 10 batches an epoch


class IndexModule(L.LightningModule):
    """Trains on a dataset of indices; remembers the indices of each batch it trained on."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[list[int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (idx,) = batch
        self.seen.append(idx.tolist())
        return self.layer(idx.float()[:, None]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


class CountingDataset(TensorDataset):
    """Indices ``0 .. N-1``; counts the samples loaded."""

    def __init__(self) -> None:
        super().__init__(torch.arange(N))
        self.loaded = 0

    def __getitem__(self, i: int) -> Any:
        self.loaded += 1
        return super().__getitem__(i)


class OwnBatchSampler:
    """A batch sampler of the user's own (not a ``BatchSampler``): the read-through path."""

    def __init__(self, sampler: DistributedSampler) -> None:
        self.sampler = sampler
        self.inner = BatchSampler(sampler, B, drop_last=True)

    def __iter__(self) -> Any:
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)


def _order(epoch: int) -> list[int]:
    s = DistributedSampler(range(N), num_replicas=1, rank=0, shuffle=True, seed=0)
    s.set_epoch(epoch)
    return list(s)


class Move(L.Callback):
    """``take``: move when training starts (before the first fetch) and keep the batch taken; else move after the
    first batch (as inside a DiLoCo sync's optimizer step), the loop's next fetch reading the place."""

    def __init__(self, epoch: int, ready: int, take: bool) -> None:
        self.epoch, self.ready, self.take = epoch, ready, take
        self.taken: Any = "not moved"

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.take:
            self.taken = move_train_data(trainer, self.epoch, self.ready, take=True)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if not self.take and trainer.global_step == 1:
            self.taken = move_train_data(trainer, self.epoch, self.ready, take=False)


@pytest.mark.parametrize("kind", ["batch_sampler", "own_batch_sampler", "resumable"])
@pytest.mark.parametrize("take", [True, False])
def test_move_train_data_reads_the_batch_at_the_place(kind: str, take: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Moved to 3 batches into epoch 2: the batch taken (``take``) or the next batch Lightning's loop fetches is
    batch 3 of epoch 2 of the shuffling sampler (``set_epoch(2)``: another order than epoch 0's), and the ones after
    it follow in order. A :class:`~lightning_par.data.resumable.ResumableDataLoader` is moved by its own
    ``load_state_dict`` and passes over the 3 batches by index (no sample loaded), taken now or read by the loop's next
    fetch; with the batch taken now, one ``DataLoader`` with a ``BatchSampler`` passes over them by index too; a batch
    sampler of the user's own, and a plain loader without ``take``, is read through. The ``ResumableDataLoader``
    counts the batches passed over in its ``state_dict`` (a checkpoint saved later holds the position from the epoch's
    start), and its move reaches none of the fit loop's private data objects (the register's accessors raise here)."""
    if kind == "resumable":
        import lightning_par.compat.lightning as register

        def refused(*args: Any) -> Any:
            raise AssertionError("a loader moved by its state reached the fit loop's data fetcher")

        for name in ("restart_training_fetch", "combined_loader", "data_fetcher"):
            monkeypatch.setattr(register, name, refused)
    dataset = CountingDataset()
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    if kind == "own_batch_sampler":
        loader = DataLoader(dataset, batch_sampler=OwnBatchSampler(sampler))
    elif kind == "resumable":
        loader = ResumableDataLoader(dataset, batch_size=B, sampler=sampler, drop_last=True)
    else:
        loader = DataLoader(dataset, batch_size=B, sampler=sampler, drop_last=True)
    move = Move(epoch=2, ready=3, take=take)
    module = IndexModule()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                        callbacks=[move])
    trainer.fit(module, loader)
    order = _order(2)
    batches = [order[i * B:(i + 1) * B] for i in range(N // B)]
    if take:
        assert move.taken[0].tolist() == batches[3]
        # the loop's own fetches go on from batch 4 (its first fetch came after the move)
        assert module.seen == batches[4:7]
    else:
        assert move.taken is None
        assert module.seen[0] == _order(0)[:B]  # the first batch, before the move
        assert module.seen[1:] == batches[3:5]
    assert order[:B] != _order(0)[:B]  # the epochs' shuffles differ, so the place's epoch took effect
    # skipped by index (no sample loaded) by a loader moved by its state, and where the batch is taken now from a
    # plain loader that can: else read through
    passed_over = 0 if kind == "resumable" or (take and kind != "own_batch_sampler") else 3
    assert dataset.loaded == B * (passed_over + take + len(module.seen)), dataset.loaded
    if kind == "resumable":  # every batch of the pass counted: the 3 passed over, the one taken, the loop's
        assert loader.state_dict()["batches"] == 3 + take + len(module.seen) - (not take)


def test_loops_a_rejoining_group_cannot_move_in_are_refused() -> None:
    from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher, _PrefetchDataFetcher

    def trainer(fetcher: Any, reload: int = 0) -> Any:
        loop = SimpleNamespace(_data_fetcher=fetcher)
        return SimpleNamespace(reload_dataloaders_every_n_epochs=reload, fit_loop=loop)

    check_train_data(trainer(_PrefetchDataFetcher()))
    with pytest.raises(ValueError, match="training_step that takes `dataloader_iter`"):
        check_train_data(trainer(_DataLoaderIterDataFetcher()))
    with pytest.raises(ValueError, match="reload_dataloaders_every_n_epochs=2"):
        check_train_data(trainer(_PrefetchDataFetcher(), reload=2))
