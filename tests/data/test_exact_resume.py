"""Exact resume (issue 35, item 4): a run stopped mid-epoch and resumed from its checkpoint sees exactly the samples
of the uninterrupted run, under Lightning's own injected shuffling ``DistributedSampler`` (turned by
``ResumableDataLoader`` into :class:`~lightning_par.data.sampler.ResumableDistributedSampler`), at the same layout and
after dp2 -> dp4 with the same global batch (the rest of the epoch re-split over the four replicas).

48 samples, global batch 8: an epoch is 6 steps. The run stops after step 3 of epoch 0 and resumes to step 9 (into
epoch 1, which starts at its beginning again). Two checkpoints at step 3: one written inside the run (where
``ModelCheckpoint`` and the recipe's step checkpoints save), one by ``Trainer.save_checkpoint`` after ``fit`` stopped
at ``max_steps=3`` (Lightning then counts epoch 0 as finished and resumes at epoch 1 with 3 batches counted done: the
loader continues epoch 0's order, see ``ResumableDataLoader``).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.resume import N, global_steps, run_resume

pytestmark = pytest.mark.distributed

STOP, END = 3, 9


@pytest.fixture(scope="module")
def dp2_runs(tmp_path_factory):
    """One world-2 launch: the uninterrupted run (saving at step 3 on the way), the run stopped at step 3 (saved
    after ``fit``), and the resumes from both checkpoints at dp2."""
    tmp = tmp_path_factory.mktemp("resume")
    ckpt, inside = str(tmp / "mid.ckpt"), str(tmp / "inside.ckpt")
    full, stopped, resumed, resumed_inside = run_resume(2, [
        {"steps": END, "save_at": (STOP, inside)}, {"steps": STOP, "save": ckpt},
        {"steps": END, "resume": ckpt}, {"steps": END, "resume": inside}])
    return {"full": full, "stopped": stopped, "resumed": resumed, "resumed_inside": resumed_inside, "ckpt": ckpt}


def test_uninterrupted_run_covers_each_epoch_once(dp2_runs):
    steps = global_steps(dp2_runs["full"])
    assert len(steps) == END
    assert sorted(i for s in steps[:6] for i in s) == list(range(N))  # epoch 0: every sample once
    assert steps[:6] != sorted(steps[:6])  # shuffled (Lightning's injected sampler)
    assert steps[6:] != steps[:3]  # epoch 1 draws another order


@pytest.mark.parametrize("which", ["resumed", "resumed_inside"])
def test_resume_at_the_same_layout_sees_the_same_samples_and_losses(dp2_runs, which):
    full, stopped, resumed = dp2_runs["full"], dp2_runs["stopped"], dp2_runs[which]
    assert global_steps(stopped) == global_steps(full)[:STOP]
    assert all(r["global_step"] == END for r in resumed)
    for rank in range(2):
        assert resumed[rank]["ids"] == full[rank]["ids"][STOP:]  # each replica's batches, step by step
        torch.testing.assert_close(torch.tensor(resumed[rank]["losses"]), torch.tensor(full[rank]["losses"][STOP:]),
                                   rtol=1e-5, atol=0)


def test_resume_with_more_replicas_sees_the_rest_of_the_epoch_once(dp2_runs):
    """dp2 -> dp4, per-replica batch 4 -> 2: every later global batch is the uninterrupted run's (none seen twice or
    skipped), and the losses (the mean of the replicas' means: no label mask) are its own."""
    (resumed,) = run_resume(4, [{"steps": END, "resume": dp2_runs["ckpt"]}])
    full_steps = global_steps(dp2_runs["full"])
    assert global_steps(resumed) == full_steps[STOP:]
    seen = [i for s in global_steps(dp2_runs["stopped"]) + global_steps(resumed)[: 6 - STOP] for i in s]
    assert sorted(seen) == list(range(N))
    losses = [sum(r["losses"][k] for r in resumed) / 4 for k in range(END - STOP)]
    full_losses = [sum(r["losses"][k] for r in dp2_runs["full"]) / 2 for k in range(STOP, END)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(full_losses), rtol=1e-5, atol=0)
