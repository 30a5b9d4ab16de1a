"""Helpers of tests/data/test_exact_resume.py: fits under Lightning's own injected (shuffling)
``DistributedSampler`` over a :class:`~lightning_par.data.ResumableDataLoader`, recording which samples each step
saw, stopped mid-epoch, saved, and resumed under the same or another dp size."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
from torch.utils.data import Dataset

from lightning_par.data import ResumableDataLoader
from tests.support.helpers import QUIET_TRAINER

N, SEQ = 48, 16
#: the global batch: dp2 with 4 samples per replica, or dp4 with 2
GLOBAL_BATCH = 8


class IdTokens(Dataset):
    """``N`` windows ``(x, y)`` whose first input token is the sample's id (``x[0] == i``); deterministic."""

    def __init__(self, n: int = N, seq: int = SEQ) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, 256, (n, seq + 1), generator=g)
        self.data[:, 0] = torch.arange(n)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


class SeenSamples(L.Callback):
    """Per training step on this rank: the ids of the batch's samples and the returned loss."""

    def __init__(self) -> None:
        self.ids: list[list[int]] = []
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.ids.append([int(i) for i in batch[0][:, 0]])
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach()))


class SaveAt(L.Callback):
    """``trainer.save_checkpoint(path)`` at the end of optimizer step ``step`` (where ``ModelCheckpoint`` saves), the
    run going on."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def resume_worker(plan: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each step ``{"steps": max_steps, "resume": path | None, "save": path | None, "save_at": (step, path) | None}``
    (``save``: after ``fit`` ends; ``save_at``: inside the run) on this rank under
    ``ddp_overlap`` (dp = world size) with the per-replica batch ``GLOBAL_BATCH // world``; Lightning injects its
    shuffling sampler (``use_distributed_sampler=True``)."""
    from lightning_par.strategies import DDPOverlapStrategy
    from tests.support.p3d import make_gpt

    env = dict(os.environ)
    world = int(os.environ["WORLD_SIZE"])
    out = []
    for step in plan:
        os.environ.update(env)  # Lightning's teardown deletes WORLD_SIZE after each run
        seen = SeenSamples()
        trainer = L.Trainer(devices=world, strategy=DDPOverlapStrategy(timeout_s=90),
                            **{**QUIET_TRAINER, "use_distributed_sampler": True}, max_steps=step["steps"],
                            limit_val_batches=0,
                            callbacks=[seen, *([SaveAt(*step["save_at"])] if step.get("save_at") else [])])
        loader = ResumableDataLoader(IdTokens(), batch_size=GLOBAL_BATCH // world, shuffle=True, drop_last=True)
        trainer.fit(make_gpt(), loader, ckpt_path=step.get("resume"))
        if step.get("save"):
            trainer.save_checkpoint(step["save"])
        out.append({"rank": int(os.environ.get("RANK", 0)), "ids": seen.ids, "losses": seen.losses,
                    "global_step": trainer.global_step})
    return out


def run_resume(world: int, plan: list[dict[str, Any]], timeout_s: float = 600) -> list[list[dict[str, Any]]]:
    """Per plan step, the result of each rank."""
    from lightning_par.launcher import run_distributed

    per_rank = run_distributed(resume_worker, world, (plan,), timeout_s=timeout_s)
    return [[per_rank[r][i] for r in range(world)] for i in range(len(plan))]


def global_steps(ranks: list[dict[str, Any]]) -> list[list[int]]:
    """Per step, the sorted ids of the global batch (every rank is a dp replica here)."""
    return [sorted(i for r in ranks for i in r["ids"][k]) for k in range(len(ranks[0]["ids"]))]
