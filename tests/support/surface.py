"""Helpers of tests/core/test_user_surface.py: a user's modules that log, gather and look at gradients from
their own hooks, and the per-rank workers that run them under Lightning with a lightning_par strategy."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from tests.support.helpers import TokenDataset, quiet_trainer
from tests.support.user_models import AttentionLM, ResidualMLP


class LoggingMLP(ResidualMLP):
    """The user's regression model whose evaluation steps log with and without ``sync_dist`` and gather."""

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        loss = self.loss_fn(out, y)
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_mae", (out - y).abs().mean())  # rank-local, as under Lightning's ddp
        gathered = self.all_gather(loss)  # (world,) on every rank
        self.log("val_gathered", gathered.mean())
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        loss = self.loss_fn(out, y)
        self.log("train_loss", loss)
        self.log_dict({"train_mae": (out - y).abs().mean(), "train_max": out.abs().max().item()})
        self.log("train_mae_sync", (out - y).abs().mean(), sync_dist=True)
        if self.gather_in_training:
            self.all_gather(loss)
        return loss

    gather_in_training = False

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss_fn(self.model(x), y)
        self.log_dict({"test_loss": loss}, sync_dist=True)
        return loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


def make_logging_mlp() -> LoggingMLP:
    torch.manual_seed(0)
    return LoggingMLP(depth=3)


class LoggingLM(AttentionLM):
    """The user's causal LM logging its training loss itself."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


def make_logging_lm() -> LoggingLM:
    torch.manual_seed(0)
    return LoggingLM("sgd")


class MaskedTokens(TokenDataset):
    """:class:`tests.support.helpers.TokenDataset` with the targets of the first ``masked`` positions set to ``-100`` (ignored
    by the loss): under cp2 the two ranks then hold different numbers of counted tokens."""

    def __init__(self, n: int, masked: int = 6, seed: int = 0) -> None:
        super().__init__(n=n, seed=seed)
        self.masked = masked

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = super().__getitem__(i)
        y = y.clone()
        y[: self.masked] = -100
        return x, y


class UnevenMaskedTokens(TokenDataset):
    """:class:`tests.support.helpers.TokenDataset` with the targets of the first ``2 + 3 * (i % 4)`` positions of sample ``i``
    set to ``-100``: the samples, so the micro-batches of a pipeline, hold different numbers of counted tokens (an
    answer-only label mask)."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = super().__getitem__(i)
        y = y.clone()
        y[: 2 + 3 * (i % 4)] = -100
        return x, y


class FinalParameters(L.Callback):
    """The whole model's parameters (one-process names, gathered over every axis) at the end of training."""

    def __init__(self) -> None:
        self.params: dict[str, torch.Tensor] = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.params = trainer.strategy.parallel.full_state_dict()


class LoggedLosses(L.Callback):
    """Per training step: the loss the step returned and the ``train_loss`` it logged (Lightning's step value), and
    every value logged in the step (``metrics``: ``{name: [per step]}``)."""

    def __init__(self) -> None:
        self.returned: list[float] = []
        self.logged: list[float] = []
        self.metrics: dict[str, list[float]] = {}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.returned.append(float(loss.detach()))
        self.logged.append(float(trainer.callback_metrics["train_loss"]))
        for name, value in trainer.callback_metrics.items():
            if name.startswith("train_"):
                self.metrics.setdefault(name, []).append(float(value))


class GradProbe(L.Callback):
    """In ``on_before_optimizer_step``: the strategy's global norm and Lightning-style per-parameter norms, and how
    many of the module's parameters hold a ``.grad``."""

    def __init__(self) -> None:
        self.total: list[float] = []
        self.norms: list[dict[str, float]] = []
        self.with_grad: list[int] = []

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.total.append(float(trainer.strategy.grad_norm(2)))
        self.norms.append(trainer.strategy.grad_norms(2))
        self.with_grad.append(sum(p.grad is not None for p in pl_module.parameters()))


class RecordedSummary(L.pytorch.callbacks.ModelSummary):
    """Lightning's ModelSummary callback keeping what it prints (on global rank 0)."""

    def __init__(self) -> None:
        super().__init__(max_depth=1)
        self.printed: dict[str, Any] = {}

    def summarize(self, summary_data: Any, total_parameters: int, trainable_parameters: int, *args: Any,
                  **kwargs: Any) -> None:
        rows = dict(summary_data)
        self.printed = {"total": total_parameters, "trainable": trainable_parameters,
                        "rows": dict(zip(rows["Name"], rows["Params"]))}


def _loader(dataset: Dataset, batch: int, dp_size: int, dp_rank: int) -> DataLoader:
    sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=False)
    return DataLoader(dataset, batch_size=batch, sampler=sampler, drop_last=True)


def _strategy(name: str, options: dict[str, Any]) -> Any:
    from lightning.pytorch.strategies import StrategyRegistry

    entry = StrategyRegistry[name]
    return entry["strategy"](**{**entry["init_params"], "timeout_s": 90, **options})


def _model(name: str) -> L.LightningModule:
    if name == "mlp":
        return make_logging_mlp()
    if name == "mlp-gather":
        module = make_logging_mlp()
        module.gather_in_training = True
        return module
    if name == "mlp-plain":
        from tests.support.user_models import make_mlp

        return make_mlp("sgd")
    if name == "hf-llama":
        from tests.hf.test_hf_pipeline_distributed import make_hf

        return make_hf("llama-sgd")
    if name == "lm":
        return make_logging_lm()
    from tests.support.p3d import make_gpt

    return make_gpt()


def _dataset(name: str, n: int) -> Dataset:
    if name == "mlp":
        from tests.support.pipeline import RegressionDataset

        return RegressionDataset(n=n, d_in=8, d_out=4)
    if name == "masked":
        return MaskedTokens(n)
    if name == "uneven":
        return UnevenMaskedTokens(n=n, seq=16)
    return TokenDataset(n=n, seq=16)


def case_worker(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case on this rank: ``{"kind": "eval" | "fit", "strategy", "options", "model", "data", "batch", ...}``."""
    env = dict(os.environ)
    rank = int(os.environ["RANK"])
    results = []
    for case in cases:
        os.environ.update(env)  # Lightning's teardown deletes WORLD_SIZE after each run
        strategy = _strategy(case["strategy"], case["options"])
        dims = strategy.resolve_parallel_dims(int(os.environ["WORLD_SIZE"]))
        dp_rank = dims.coordinates(rank)["dp"]
        data = _dataset(case["data"], case["n"])
        loader = _loader(data, case["batch"], dims.dp_size, dp_rank)
        module = _model(case["model"])
        out: dict[str, Any] = {"rank": rank, "dp_rank": dp_rank}
        if case["kind"] == "eval":
            trainer = quiet_trainer(strategy, dims.world_size)
            val = trainer.validate(module, loader, verbose=False)[0]
            # a fresh module: re-parallelizing one a previous Trainer cut is another issue's (a second Trainer)
            test = {} if case["model"] in ("gpt", "hf-llama") else quiet_trainer(
                _strategy(case["strategy"], case["options"]), dims.world_size).test(
                _model(case["model"]), loader, verbose=False)[0]
            out.update({k: float(v) for k, v in {**val, **test}.items()})
        elif case["kind"] == "summary":
            from lightning_par.callbacks.model_summary import whole_model_summary

            recorded = RecordedSummary()
            trainer = quiet_trainer(strategy, dims.world_size, max_steps=1, limit_val_batches=0,
                                    enable_model_summary=True, callbacks=[recorded])
            trainer.fit(module, loader)
            whole = whole_model_summary(trainer)
            out.update({"printed": recorded.printed, "total": whole.total_parameters,
                        "trainable": whole.trainable_parameters})
        elif case["kind"] == "grads":
            probe = GradProbe()
            trainer = quiet_trainer(strategy, dims.world_size, max_steps=case["steps"], limit_val_batches=0,
                                    callbacks=[probe])
            trainer.fit(module, loader)
            out.update({"total": probe.total, "norms": probe.norms, "with_grad": probe.with_grad})
        else:
            recorder, final = LoggedLosses(), FinalParameters()
            trainer = quiet_trainer(strategy, dims.world_size, max_steps=case["steps"], limit_val_batches=0,
                                    callbacks=[recorder, final])
            trainer.fit(module, loader)
            out.update({"returned": recorder.returned, "logged": recorder.logged, "metrics": recorder.metrics})
            if case.get("params"):
                out["params"] = final.params
        results.append(out)
    return results


def run_cases(world: int, cases: list[dict[str, Any]], timeout_s: float = 600) -> dict[str, list[dict[str, Any]]]:
    """``{case name: [result of each rank]}``."""
    from lightning_par.launcher import run_distributed

    per_rank = run_distributed(case_worker, world, (cases,), timeout_s=timeout_s)
    return {case["name"]: [per_rank[r][i] for r in range(world)] for i, case in enumerate(cases)}
