"""Helpers of the tests of a module fitted again: a second, new Trainer on the same module, or ``fit`` twice on one
Trainer, as a Lightning user runs them (Lightning's own shuffling ``DistributedSampler``, no sampler of the test's).

A *case* is a picklable dict: ``"name"``; ``"strategy"`` (a Lightning registry name) and ``"options"`` (its keyword
arguments); ``"optimizer"`` (``"sgd"``: SGD with momentum, or ``"adamw"``); ``"fits"``: a list of ``(how, steps)``,
``how`` being ``"new"`` (a new Trainer) or ``"same"`` (the previous Trainer's ``fit`` again, ``steps`` more optimizer
steps); ``"evaluate"``: after the fits, ``trainer.validate`` and ``trainer.test`` on a new Trainer of the same
strategy.

:func:`reference` replays a case in one process with plain torch on the samples Lightning hands the dp replicas: each
fit of a new Trainer walks epoch 0 of ``DistributedSampler(shuffle=True, seed=0)`` over the dp ranks, and each further
``fit`` of the same Trainer the next epoch (Lightning starts a new epoch at every ``fit``); the global batch of a step
is the union of the replicas' micro-batches, and each fit starts with a fresh optimizer (``configure_optimizers``).
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from tests.helpers import LossRecorder, TokenDataset
from tests.user_models import AttentionLM

#: Samples of the training set (divisible by dp x micro-batch for dp in 1, 2), of the validation / test set, tokens per
#: sample, samples per micro-batch.
TRAIN_SAMPLES, EVAL_SAMPLES, SEQ, MICRO = 48, 16, 16, 4


class EvalLM(AttentionLM):
    """The user's causal LM with a validation and a test step logging the loss over every rank (``sync_dist``)."""

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.training_step(batch, batch_idx)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.training_step(batch, batch_idx)
        self.log("test_loss", loss, sync_dist=True)
        return loss


def make_lm(optimizer: str) -> EvalLM:
    """Seeded: every rank and the reference build the same initial model."""
    torch.manual_seed(0)
    return EvalLM(optimizer)


def datasets() -> tuple[Dataset, Dataset]:
    return TokenDataset(n=TRAIN_SAMPLES, seq=SEQ), TokenDataset(n=EVAL_SAMPLES, seq=SEQ, seed=1)


def _strategy(case: dict[str, Any]) -> Any:
    from lightning.pytorch.strategies import StrategyRegistry

    entry = StrategyRegistry[case["strategy"]]
    return entry["strategy"](**{**entry["init_params"], "timeout_s": 90, **case.get("options", {})})


def _trainer(case: dict[str, Any], world: int, **kwargs: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=world, strategy=_strategy(case), logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **kwargs,
    )


def run_case(case: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """Body of one rank: the case's fits on one module, then its evaluation (see the module docstring)."""
    train, evaluation = datasets()
    module = make_lm(case["optimizer"])
    trainer: L.Trainer | None = None
    recorder = LossRecorder()
    losses: list[list[float]] = []
    for how, steps in case["fits"]:
        if how == "new":
            recorder = LossRecorder()
            trainer = _trainer(case, world, max_steps=steps, limit_val_batches=0, callbacks=[recorder])
        else:
            assert trainer is not None
            trainer.fit_loop.epoch_loop.max_steps += steps
        seen = len(recorder.losses)
        trainer.fit(module, DataLoader(train, batch_size=MICRO, drop_last=True))
        losses.append(recorder.losses[seen:])
    assert trainer is not None
    strategy = trainer.strategy
    dp_rank = strategy.parallel_dims.coordinates(rank)["dp"]
    params = strategy.parallel.full_state_dict()
    out: dict[str, Any] = {"rank": rank, "dp_rank": dp_rank, "losses": losses, "params": params}
    if case.get("evaluate"):
        loader = DataLoader(evaluation, batch_size=MICRO, drop_last=True)
        out["val"] = _trainer(case, world).validate(module, loader, verbose=False)[0]["val_loss"]
        out["test"] = _trainer(case, world).test(module, loader, verbose=False)[0]["test_loss"]
    return out


def worker(cases: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every case on this rank, one after the other (one launch for all)."""
    # Lightning's environment deletes WORLD_SIZE at the end of a fit: read it once.
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return {case["name"]: run_case(case, rank, world) for case in cases}


def global_losses(results: list[dict[str, Any]]) -> list[list[float]]:
    """Per fit, per step: the loss of the global batch (the mean over the dp replicas)."""
    by_dp: dict[int, list[list[float]]] = {}
    for r in results:
        by_dp.setdefault(r["dp_rank"], r["losses"])
    replicas = list(by_dp.values())
    return [
        [sum(rep[f][i] for rep in replicas) / len(replicas) for i in range(len(replicas[0][f]))]
        for f in range(len(replicas[0]))
    ]


def _epoch_batches(dataset: Dataset, dp_size: int, epoch: int) -> list[list[int]]:
    """The global batches (sample indices) of one epoch: step ``k`` is every dp replica's ``k``-th micro-batch of
    Lightning's injected ``DistributedSampler(shuffle=True, seed=0)``."""
    per_rank = []
    for r in range(dp_size):
        sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=r, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        per_rank.append(list(sampler))
    steps = len(per_rank[0]) // MICRO
    return [[i for r in range(dp_size) for i in per_rank[r][k * MICRO:(k + 1) * MICRO]] for k in range(steps)]


def _eval_loss(module: EvalLM, dataset: Dataset, dp_size: int) -> float:
    """What ``sync_dist`` logs: the mean over the dp ranks of each rank's mean batch loss (Lightning's evaluation
    sampler does not shuffle: rank ``r`` takes samples ``r, r + dp, ...``)."""
    losses = []
    with torch.no_grad():
        for r in range(dp_size):
            idx = list(range(r, len(dataset), dp_size))
            for k in range(len(idx) // MICRO):
                x, y = zip(*(dataset[i] for i in idx[k * MICRO:(k + 1) * MICRO]))
                losses.append(float(module.training_step((torch.stack(x), torch.stack(y)), 0)))
    return sum(losses) / len(losses)


def reference(case: dict[str, Any], dp_size: int) -> dict[str, Any]:
    """The case in one process (see the module docstring): per-fit losses, final parameters, evaluation losses."""
    train, evaluation = datasets()
    module = make_lm(case["optimizer"])
    losses: list[list[float]] = []
    epoch = 0
    for how, steps in case["fits"]:
        epoch = 0 if how == "new" else epoch + 1
        batches = _epoch_batches(train, dp_size, epoch)
        assert steps <= len(batches), "a fit of the reference stays within one epoch"
        opt = module.configure_optimizers()
        fit_losses = []
        for idx in batches[:steps]:
            x, y = zip(*(train[i] for i in idx))
            loss = module.training_step((torch.stack(x), torch.stack(y)), 0)
            fit_losses.append(float(loss.detach()))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(fit_losses)
    out: dict[str, Any] = {"losses": losses, "params": {n: p.detach().clone() for n, p in module.named_parameters()}}
    if case.get("evaluate"):
        out["val"] = out["test"] = _eval_loss(module, evaluation, dp_size)
    return out
