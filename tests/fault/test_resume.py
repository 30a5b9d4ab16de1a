"""Which checkpoint a run resumes from, and the DataLoader that resumes mid-epoch (no processes)."""

from __future__ import annotations

import os
import re

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from lightning_par.data import ResumableDataLoader
from lightning_par.fault.resume import checkpoint_step, is_complete_checkpoint, latest_checkpoint, resolve_ckpt_path
from lightning_par.fault.step_checkpoint import StepCheckpoint


def _file_ckpt(path, step: int) -> None:
    torch.save({"global_step": step}, path)


def _dir_ckpt(path, complete: bool = True) -> None:
    path.mkdir()
    (path / "__0_0.distcp").write_bytes(b"shard")
    if complete:
        from lightning_par.checkpoint import METADATA_FILENAME

        import pickle

        from torch.distributed.checkpoint.metadata import Metadata

        (path / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={})))  # DCP's, empty
        torch.save({}, path / METADATA_FILENAME)
        from lightning_par.checkpoint import FORMAT_VERSION, RECORD_FILENAME

        (path / RECORD_FILENAME).write_text(f'{{"format_version": {FORMAT_VERSION}}}')


def test_step_names_parse_with_versions():
    assert checkpoint_step("step-12.ckpt") == (12, 0)
    assert checkpoint_step("/x/step-12-v3.ckpt") == (12, 3)
    for other in ("last.ckpt", "epoch=0-step=12.ckpt", "step-12.ckpt.tmp-staging", "step-x.ckpt"):
        assert checkpoint_step(other) is None


def test_the_latest_complete_checkpoint_wins(tmp_path):
    _dir_ckpt(tmp_path / "step-2.ckpt")
    _dir_ckpt(tmp_path / "step-4.ckpt")
    _dir_ckpt(tmp_path / "step-4-v1.ckpt")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-4-v1.ckpt"
    # Newer but not loadable: a single file (not a lightning_par checkpoint), a directory without DCP's .metadata, a
    # staging directory, a link.
    _file_ckpt(tmp_path / "step-6.ckpt", 6)
    _dir_ckpt(tmp_path / "step-8.ckpt", complete=False)
    _dir_ckpt(tmp_path / "step-10.ckpt.tmp-staging")
    os.symlink("step-2.ckpt", tmp_path / "last.ckpt")
    assert not is_complete_checkpoint(tmp_path / "step-6.ckpt")
    assert not is_complete_checkpoint(tmp_path / "step-8.ckpt")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-4-v1.ckpt"
    _dir_ckpt(tmp_path / "step-12.ckpt")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-12.ckpt"


def test_resolve_null_last_and_path(tmp_path):
    ckpts = tmp_path / "checkpoints"
    assert resolve_ckpt_path(None, ckpts) is None  # nothing yet: a fresh start
    with pytest.raises(ValueError, match=re.escape("ckpt_path='last' is not valid here: there is no complete checkpoint")):
        resolve_ckpt_path("last", ckpts)
    ckpts.mkdir()
    _dir_ckpt(ckpts / "step-3.ckpt")
    assert resolve_ckpt_path(None, ckpts) == ckpts / "step-3.ckpt"
    assert resolve_ckpt_path("last", ckpts) == ckpts / "step-3.ckpt"
    assert resolve_ckpt_path(str(ckpts / "step-3.ckpt"), tmp_path / "elsewhere") == (ckpts / "step-3.ckpt").resolve()
    with pytest.raises(ValueError, match=re.escape("ckpt_path='/no/such.ckpt' is not valid: it does not exist")):
        resolve_ckpt_path("/no/such.ckpt", ckpts)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"every_n_steps": 0}, "every_n_steps=0 is not valid"),
    ({"keep_last_k": 0}, "keep_last_k=0 is not valid"),
    ({"async_save": "yes"}, "async_save='yes' is not valid: expected true or false"),
])
def test_step_checkpoint_rejects_bad_options(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StepCheckpoint(tmp_path, **kwargs)


def _dataset(n: int = 40) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def _take(it, k):
    return [int(b[0][0]) for _, b in zip(range(k), it)]


@pytest.mark.parametrize("kind", ["generator", "distributed"])
def test_a_resumed_loader_continues_with_the_next_batch(kind):
    """Stop a pass after k batches, save, load into a fresh loader: the rest of the pass and the next pass are what
    the uninterrupted loader yields."""

    def make():
        if kind == "generator":
            return ResumableDataLoader(_dataset(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7))
        sampler = DistributedSampler(_dataset(), num_replicas=2, rank=1, shuffle=True, seed=3)
        return ResumableDataLoader(_dataset(), batch_size=4, sampler=sampler)

    def set_epoch(loader, epoch):
        if isinstance(loader.sampler, DistributedSampler):
            loader.sampler.set_epoch(epoch)

    ref = make()
    passes = []
    for epoch in range(2):
        set_epoch(ref, epoch)
        passes.append(_take(iter(ref), len(ref)))
    assert passes[0] != passes[1]  # the order changes between passes

    first = make()
    set_epoch(first, 0)
    assert _take(iter(first), 3) == passes[0][:3]
    state = first.state_dict()
    assert state["batches"] == 3

    resumed = make()
    resumed.load_state_dict(state)
    assert len(resumed) == len(ref)
    set_epoch(resumed, 0)
    # Take what Lightning takes (it counts the skipped batches as fetched and never asks for one past the end).
    assert _take(iter(resumed), len(ref) - 3) == passes[0][3:]  # the skipped batches are not yielded again
    set_epoch(resumed, 1)
    assert _take(iter(resumed), len(ref)) == passes[1]


def test_a_finished_pass_resumes_at_the_next_one():
    ref = ResumableDataLoader(_dataset(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7))
    passes = [_take(iter(ref), len(ref)) for _ in range(2)]
    first = ResumableDataLoader(_dataset(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7))
    _take(iter(first), len(first))
    state = first.state_dict()
    assert state["batches"] == 0
    resumed = ResumableDataLoader(_dataset(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7))
    resumed.load_state_dict(state)
    assert _take(iter(resumed), len(resumed)) == passes[1]


def test_skipped_batches_are_never_loaded():
    loaded = []

    class Recording(TensorDataset):
        def __getitem__(self, i):
            loaded.append(i)
            return super().__getitem__(i)

    loader = ResumableDataLoader(Recording(torch.arange(40)), batch_size=4, shuffle=False)
    loader.load_state_dict({"batches": 8, "generator": None, "epoch": None})
    assert _take(iter(loader), 10) == [32, 36]
    assert sorted(loaded) == list(range(32, 40))


def test_skipping_works_with_persistent_workers():
    """With worker processes the indices are still skipped in the main process; a persistent iterator is rebuilt."""
    loader = ResumableDataLoader(_dataset(), batch_size=4, shuffle=False, num_workers=1, persistent_workers=True)
    assert _take(iter(loader), 2) == [0, 4]
    loader.load_state_dict({"batches": 7, "generator": None, "epoch": None})
    assert _take(iter(loader), 10) == [28, 32, 36]


def test_a_resume_inside_an_epoch_with_another_batch_size_or_replica_count_is_refused():
    """The position is counted in batches of one size and replicas: another would replay or skip samples."""
    def make(batch_size, replicas=2):
        sampler = DistributedSampler(_dataset(), num_replicas=replicas, rank=0, shuffle=True, seed=3)
        return ResumableDataLoader(_dataset(), batch_size=batch_size, sampler=sampler)

    first = make(4)
    first.sampler.set_epoch(0)
    _take(iter(first), 2)
    state = first.state_dict()
    assert (state["batches"], state["samples"], state["batch_size"], state["replicas"]) == (2, 8, 4, 2)
    with pytest.raises(ValueError, match=re.escape("global batch (batch_size * data-parallel replicas)=8 * 2 is not "
                                                   "valid for this resume: the checkpoint is 2 batches into an epoch "
                                                   "with global batch (batch_size * data-parallel replicas)=4 * 2")):
        make(8).load_state_dict(state)
    with pytest.raises(ValueError, match=re.escape("global batch (batch_size * data-parallel replicas)=4 * 4 is not")):
        make(4, replicas=4).load_state_dict(state)
    make(4).load_state_dict(state)  # the same: fine
    make(2, replicas=4).load_state_dict(state)  # more replicas, the same global batch: the rest is re-split
    _take(iter(first), len(first))  # at an epoch boundary either may change
    make(8, replicas=4).load_state_dict(first.state_dict())


def test_the_resumable_sampler_orders_as_torch_and_resplits_the_rest():
    """From the start, what torch's DistributedSampler yields; started after ``s`` samples of the global order, the
    rest split over another number of replicas: every sample of the epoch exactly once, the global batches in order."""
    from lightning_par.data.sampler import ResumableDistributedSampler

    data = _dataset(40)
    for replicas, drop_last in ((2, False), (3, False), (3, True)):
        for rank in range(replicas):
            torch_s = DistributedSampler(data, num_replicas=replicas, rank=rank, shuffle=True, seed=5,
                                         drop_last=drop_last)
            ours = ResumableDistributedSampler(data, num_replicas=replicas, rank=rank, shuffle=True, seed=5,
                                               drop_last=drop_last)
            for epoch in (0, 1):
                torch_s.set_epoch(epoch)
                ours.set_epoch(epoch)
                assert list(ours) == list(torch_s) and len(ours) == len(torch_s)
    # dp2, batch 4: 2 global batches of 8 consumed; then dp4, batch 2
    order = ResumableDistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=5).global_order()
    rest = []
    for rank in range(4):
        s = ResumableDistributedSampler(data, num_replicas=4, rank=rank, shuffle=True, seed=5)
        s.set_start(16, epoch=0)
        rest.append(list(s))
        assert len(s) == 6
    for k in range(3):  # global batch k after the resume: the next 8 of the global order
        assert sorted(i for r in rest for i in r[2 * k: 2 * k + 2]) == sorted(order[16 + 8 * k: 24 + 8 * k])
    s.set_epoch(1)  # the start applies to its epoch only
    assert len(s) == 10
    with pytest.raises(ValueError, match=r"start=41 is not valid: expected 0 <= start <= 40"):
        s.set_start(41, epoch=0)


def test_a_loader_resumed_with_more_replicas_takes_the_rest_of_the_epoch_once():
    """dp2 -> dp4 inside an epoch with the same global batch: the 4 resumed loaders yield, batch by batch, the global
    batches the 2 uninterrupted ones would have; none seen twice or skipped, and len is the full pass."""
    data = _dataset(48)

    def loader(replicas, rank):
        sampler = DistributedSampler(data, num_replicas=replicas, rank=rank, shuffle=True, seed=3)
        return ResumableDataLoader(data, batch_size=8 // replicas, sampler=sampler)

    def ids(batch):
        return [int(i) for i in batch[0]]

    ref = [loader(2, r) for r in range(2)]
    for dl in ref:
        dl.sampler.set_epoch(0)
    ref_batches = [list(map(ids, dl)) for dl in ref]  # per rank, per step
    ref_global = [sorted(ref_batches[0][k] + ref_batches[1][k]) for k in range(len(ref[0]))]
    first = loader(2, 0)
    first.sampler.set_epoch(0)
    _take(iter(first), 2)
    state = first.state_dict()
    assert state["consumed"] == 16
    resumed = [loader(4, r) for r in range(4)]
    got = []
    for dl in resumed:
        dl.load_state_dict(state)
        dl.sampler.set_epoch(0)
        assert len(dl) == len(ref[0])  # Lightning counts the 2 batches as fetched
        got.append(list(map(ids, dl)))
    resumed_global = [sorted(sum((g[k] for g in got), [])) for k in range(len(got[0]))]
    assert resumed_global == ref_global[2:]
    assert resumed[0].state_dict()["batches"] == 0  # the pass ended: the next starts at the beginning
    mid = loader(4, 1)
    mid.load_state_dict(state)
    mid.sampler.set_epoch(0)
    _take(iter(mid), 1)
    assert mid.state_dict()["consumed"] == 24  # 16 before, then one global batch of 8
