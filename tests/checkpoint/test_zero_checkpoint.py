"""Sharded ZeRO checkpoints: resume with the same loss trajectory, and reshard into other stages, dp sizes and one
process with the same validation loss.

One epoch is 3 optimizer steps (24 samples, global batch 8). The uninterrupted run saves a checkpoint after step 3
(from ``on_train_batch_end``, as ``ModelCheckpoint`` does), at an epoch boundary, so the resumed run sees the same
batches as the uninterrupted one. The learning rate warms up over all 6 steps, so the resumed run also needs the
optimizer's param-group hyper-parameters and the LR scheduler back.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_par.checkpoint import is_sharded_checkpoint, load_model_weights
from tests.support.helpers import TokenDataset, global_losses
from tests.support.zero import CONFIG, make_gpt_warmup, run_cases

pytestmark = pytest.mark.distributed

EPOCH, MICRO = 3, 4
OTHER = {1: 3, 2: 1, 3: 2}  # the stage each checkpoint is loaded into at dp 4


@pytest.fixture(scope="module")
def data():
    seq = CONFIG["block_size"]
    return TokenDataset(n=EPOCH * MICRO * 2, seq=seq), TokenDataset(n=16, seq=seq, seed=1)


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    train, val = data
    root = tmp_path_factory.mktemp("zero_ckpt")
    ckpt = {k: str(root / f"z{k}") for k in (1, 2, 3)}
    gpt = {"module": "gpt-warmup"}
    dp2 = []
    for k in (1, 2, 3):
        dp2 += [
            {"name": f"full-z{k}", "stage": k, "steps": 2 * EPOCH, "micro_batch": MICRO, "save_at": (EPOCH, ckpt[k]),
             **gpt},
            {"name": f"resume-z{k}", "stage": k, "steps": 2 * EPOCH, "micro_batch": MICRO, "resume": ckpt[k], **gpt},
        ]
    results = run_cases(2, dp2, train, val)
    dp4 = [
        # Same global batch (4 x 2), other dp size and stage: the optimizer state must reshard too.
        {"name": "resume-z1-as-z3", "stage": 3, "steps": 2 * EPOCH, "micro_batch": 2, "resume": ckpt[1], **gpt},
        {"name": "resume-z3-as-z2", "stage": 2, "steps": 2 * EPOCH, "micro_batch": 2, "resume": ckpt[3], **gpt},
    ]
    for k in (1, 2, 3):
        dp4 += [
            {"name": f"val-z{k}-as-z{OTHER[k]}", "stage": OTHER[k], "micro_batch": 2, "validate": ckpt[k], **gpt},
            {"name": f"val-z{k}-as-z{k}", "stage": k, "micro_batch": 2, "validate": ckpt[k], **gpt},
        ]
    results.update(run_cases(4, dp4, train, val))
    return results, ckpt


def _single_process_val_loss(path: str, val: TokenDataset) -> tuple[float, dict[str, torch.Tensor]]:
    module = make_gpt_warmup()
    load_model_weights(path, module)
    with torch.no_grad():
        losses = [float(module.loss_fn(module(x), y)) for x, y in DataLoader(val, batch_size=2)]
    return sum(losses) / len(losses), {n: p.detach().clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_resume_same_loss_trajectory(runs, stage):
    results, ckpt = runs
    assert is_sharded_checkpoint(ckpt[stage])
    full = global_losses(results[f"full-z{stage}"])
    resumed = global_losses(results[f"resume-z{stage}"])
    assert len(resumed) == EPOCH
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(full[EPOCH:]), rtol=1e-5, atol=0)
    for a, b in zip(results[f"resume-z{stage}"], results[f"full-z{stage}"]):
        torch.testing.assert_close(a["state"], b["state"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("name", "source"), [("resume-z1-as-z3", 1), ("resume-z3-as-z2", 3)])
def test_resume_into_other_stage_and_dp_size(runs, name, source):
    """Model and optimizer state saved at dp 2 continue at dp 4 under another stage on the same trajectory."""
    results, _ = runs
    full = global_losses(results[f"full-z{source}"])
    resumed = torch.tensor(global_losses(results[name]))
    torch.testing.assert_close(resumed, torch.tensor(full[EPOCH:]), rtol=1e-5, atol=0)
    torch.testing.assert_close(results[name][0]["state"], results[f"full-z{source}"][0]["state"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_reshard_into_other_stage_dp_size_and_single_process(runs, data, stage):
    results, ckpt = runs
    single, weights = _single_process_val_loss(ckpt[stage], data[1])
    # The single process loads exactly the weights the dp-2 run had when it saved.
    torch.testing.assert_close(weights, results[f"full-z{stage}"][0]["saved_state"], rtol=0, atol=0)
    for name in (f"val-z{stage}-as-z{OTHER[stage]}", f"val-z{stage}-as-z{stage}"):
        for r in results[name]:
            assert r["val_loss"] == pytest.approx(single, rel=1e-5), name
