"""Helpers of the tests of a module fitted again: a second, new Trainer on the same module, or ``fit`` twice on one
Trainer, as a Lightning user runs them (Lightning's own shuffling ``DistributedSampler``, no sampler of the test's).

A *case* is a picklable dict: ``"name"``; ``"strategy"`` (a Lightning registry name) and ``"options"`` (its keyword
arguments); ``"optimizer"`` (``"sgd"``: SGD with momentum, or ``"adamw"``); ``"fits"``: a list of ``(how, steps)`` or
``(how, steps, layout)``, ``how`` being ``"new"`` (a new Trainer) or ``"same"`` (the previous Trainer's ``fit`` again,
``steps`` more optimizer steps), ``layout`` a dict with another ``"strategy"`` / ``"options"`` for that fit's new
Trainer; ``"evaluate"``: after the fits, ``trainer.validate`` and ``trainer.test`` on new Trainers of the last fit's
strategy; ``"clip_value"``: Lightning's ``gradient_clip_val`` with ``gradient_clip_algorithm="value"``; ``"dp"``: the dp size of the case's layout (and of each fit's ``layout``), for the reference. At the end the module is put back to its plain form
(:meth:`~lightning_par.parallelize.ParallelModel.unparallelize`): its parameters and structure are compared with the
reference's plain module.

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

from lightning_par.parallelize import parallel_model_of
from tests.support.helpers import LossRecorder, TokenDataset
from tests.support.user_models import AttentionLM

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
    dp_ranks: list[int] = []
    layout = case
    for how, steps, *other in case["fits"]:
        if how == "new":
            layout = {**case, **other[0]} if other else case
            recorder = LossRecorder()
            clip = {"gradient_clip_val": case["clip_value"], "gradient_clip_algorithm": "value"} \
                if case.get("clip_value") else {}
            trainer = _trainer(layout, world, max_steps=steps, limit_val_batches=0, callbacks=[recorder], **clip)
        else:
            assert trainer is not None
            trainer.fit_loop.epoch_loop.max_steps += steps
        seen = len(recorder.losses)
        trainer.fit(module, DataLoader(train, batch_size=MICRO, drop_last=True))
        losses.append(recorder.losses[seen:])
        dp_ranks.append(trainer.strategy.parallel_dims.coordinates(rank)["dp"])
    assert trainer is not None
    out: dict[str, Any] = {"rank": rank, "dp_ranks": dp_ranks, "losses": losses}
    if case.get("evaluate"):
        loader = DataLoader(evaluation, batch_size=MICRO, drop_last=True)
        out["val"] = _trainer(layout, world).validate(module, loader, verbose=False)[0]["val_loss"]
        out["test"] = _trainer(layout, world).test(module, loader, verbose=False)[0]["test_loss"]
    owner = parallel_model_of(module)
    assert owner is not None
    owner.unparallelize()
    out["params"] = {n: p.detach().clone() for n, p in module.named_parameters()}
    out["structure"] = structure(module)
    out["owned"] = parallel_model_of(module) is not None
    return out


def structure(module: torch.nn.Module) -> list[tuple[str, str, int, tuple[str, ...]]]:
    """Every sub-module's name, class, number of module hooks, and its parameters' tensor classes."""
    hooks = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
             "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")
    return [
        (name, type(m).__qualname__, sum(len(getattr(m, h)) for h in hooks),
         tuple(type(p).__name__ + ("/" + type(p.data).__name__ if type(p.data) is not torch.Tensor else "")
               for p in m.parameters(recurse=False)))
        for name, m in module.named_modules()
    ]


def worker(cases: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every case on this rank, one after the other (one launch for all)."""
    # Lightning's environment deletes WORLD_SIZE at the end of a fit: read it once.
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return {case["name"]: run_case(case, rank, world) for case in cases}


def global_losses(results: list[dict[str, Any]]) -> list[list[float]]:
    """Per fit, per step: the loss of the global batch (the mean over the dp replicas of that fit's layout)."""
    out = []
    for f in range(len(results[0]["losses"])):
        by_dp: dict[int, list[float]] = {}
        for r in results:
            by_dp.setdefault(r["dp_ranks"][f], r["losses"][f])
        replicas = list(by_dp.values())
        out.append([sum(rep[i] for rep in replicas) / len(replicas) for i in range(len(replicas[0]))])
    return out


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


def reference(case: dict[str, Any]) -> dict[str, Any]:
    """The case in one process (see the module docstring): per-fit losses, final parameters, evaluation losses."""
    train, evaluation = datasets()
    module = make_lm(case["optimizer"])
    losses: list[list[float]] = []
    epoch, dp_size = 0, case["dp"]
    for how, steps, *other in case["fits"]:
        if how == "new":
            dp_size = other[0].get("dp", case["dp"]) if other else case["dp"]
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
            if case.get("clip_value"):
                torch.nn.utils.clip_grad_value_(module.parameters(), case["clip_value"])
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(fit_losses)
    out: dict[str, Any] = {"losses": losses, "params": {n: p.detach().clone() for n, p in module.named_parameters()},
                           "structure": structure(module)}
    if case.get("evaluate"):
        out["val"] = out["test"] = _eval_loss(module, evaluation, dp_size)
    return out
