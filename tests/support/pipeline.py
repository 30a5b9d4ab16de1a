"""Helpers of the pipeline tests: several Lightning fits in one process-group launch, and whole-model parameters
gathered from the stages."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from lightning_par.aux_loss import set_aux_loss_scale
from lightning_par.launcher import run_distributed
from tests.support.helpers import TIMEOUT_S, fit_worker, quiet_trainer, update_expert_biases


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one thread inside the block (the ranks do too). On a loaded two-core machine a multi-threaded
    reference fit of a tiny model can take seconds instead of milliseconds."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def gathered_params(module: L.LightningModule, strategy: Any) -> dict[str, torch.Tensor]:
    """Every parameter of the whole model, gathered over the pp group (a ``state_fn`` for ``fit_worker``)."""
    return strategy.full_state_dict()


def _cases_worker(cases: list[tuple]) -> list[dict]:
    env = dict(os.environ)
    results = []
    for case in cases:
        os.environ.update(env)  # Lightning's environment teardown deletes WORLD_SIZE after each fit
        results.append(fit_worker(*case))
    return results


def run_fit_cases(world_size: int, cases: list[tuple], timeout_s: float = TIMEOUT_S) -> list[list[dict]]:
    """Run several fits one after another on the same ``world_size`` ranks (one launch, one process group).

    Args:
        cases: argument tuples of :func:`tests.support.helpers.fit_worker`.

    Returns:
        ``results[case][rank]``: what ``fit_worker`` returned.
    """
    per_rank = run_distributed(_cases_worker, world_size, (cases,), timeout_s=timeout_s)
    return [[per_rank[r][c] for r in range(world_size)] for c in range(len(cases))]


class SequentialModule(L.LightningModule):
    """A LightningModule whose network is an ``nn.Sequential`` (uneven widths), for splitting and parity tests."""

    def __init__(self, widths: tuple[int, ...] = (8, 32, 16, 16, 32, 8, 4), lr: float = 1e-2) -> None:
        super().__init__()
        layers: list[tuple[str, nn.Module]] = []
        for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
            layers.append((str(i), nn.Sequential(nn.Linear(a, b), nn.Tanh())))
        self.model = nn.Sequential(OrderedDict(layers))
        self.example_input_array = torch.zeros(2, widths[0])  # the sample split="time" profiles with
        self.lr = lr

    @staticmethod
    def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(outputs, targets)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss_fn(self.model(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class RegressionDataset(torch.utils.data.Dataset):
    """``n`` fixed random ``(x, y)`` pairs of widths ``d_in``, ``d_out``."""

    def __init__(self, n: int = 64, d_in: int = 8, d_out: int = 4, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, d_in, generator=g)
        self.y = torch.randn(n, d_out, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def seeded(factory: Callable[[], L.LightningModule]) -> Callable[[], L.LightningModule]:
    """``factory`` run under ``torch.manual_seed(0)``, so every rank builds the same initial model."""

    def make() -> L.LightningModule:
        torch.manual_seed(0)
        return factory()

    return make


def _replica_loader(dataset: Any, micro_batch: int, dp_size: int, rank: int) -> torch.utils.data.DataLoader:
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=dp_size, rank=rank, shuffle=False)
    return torch.utils.data.DataLoader(dataset, batch_size=micro_batch, sampler=sampler, drop_last=True)


def _epochs(loader: torch.utils.data.DataLoader) -> Any:
    while True:
        yield from loader


def reference_eval(
    make_module: Callable[[], L.LightningModule],
    params: dict[str, torch.Tensor],
    dataset: Any,
    micro_batch: int,
    dp_size: int,
    batches: int,
) -> float:
    """Mean loss of the first ``batches`` batches of every replica, with ``params`` loaded (what Lightning logs as
    ``val_loss`` with ``sync_dist=True``)."""
    module = make_module()
    module.load_state_dict(params, strict=False)
    losses = []
    with torch.no_grad():
        for r in range(dp_size):
            for b, (x, y) in enumerate(_replica_loader(dataset, micro_batch, dp_size, r)):
                if b == batches:
                    break
                losses.append(float(module.loss_fn(module.model(x), y)))
    return sum(losses) / len(losses)


def reference_fit_microbatched(
    make_module: Callable[[], L.LightningModule],
    dataset: torch.utils.data.Dataset,
    micro_batch: int,
    steps: int,
    num_microbatches: int,
    dp_size: int = 1,
    accumulate: int = 1,
    clip_norm: float | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, plain torch, the same arithmetic as the pipeline on the same global batches.

    Each dp replica's batch (the samples a non-shuffling ``DistributedSampler`` gives it) is cut into
    ``num_microbatches`` micro-batches whose ``loss / (m * accumulate)`` gradients accumulate in order; replicas are
    then averaged as the all-reduce does (each divided by ``dp_size``, then summed). Unlike
    :func:`tests.support.helpers.reference_fit` it sums gradients in the pipeline's order, so it agrees with the pipeline
    even on gradient entries that are rounding noise (which AdamW with a small ``eps`` turns into full-size updates
    of either sign), and it cycles over epochs (for resumed runs).

    Returns:
        Per-batch losses (mean over micro-batches, then over replicas) and the final parameters.
    """
    torch.manual_seed(0)
    module = make_module()
    opt_cfg = module.configure_optimizers()
    opt = opt_cfg["optimizer"] if isinstance(opt_cfg, dict) else opt_cfg
    sched = opt_cfg.get("lr_scheduler") if isinstance(opt_cfg, dict) else None
    if isinstance(sched, dict):
        sched = sched["scheduler"]
    loaders = [_epochs(_replica_loader(dataset, micro_batch, dp_size, r)) for r in range(dp_size)]
    params = [p for p in module.parameters() if p.requires_grad]
    losses: list[float] = []
    scale = 1.0 / (num_microbatches * accumulate)
    for _ in range(steps):
        replica_grads = []
        window_losses: list[list[float]] = [[] for _ in range(accumulate)]
        for r in range(dp_size):
            for p in params:
                p.grad = None
            for a in range(accumulate):
                x, y = next(loaders[r])
                mb_losses = []
                for xs, ys in zip(x.split(micro_batch // num_microbatches), y.split(micro_batch // num_microbatches)):
                    set_aux_loss_scale(scale)  # a MoE layer's own losses get the micro-batch loss's factor
                    loss = module.loss_fn(module.model(xs), ys)
                    mb_losses.append(loss.detach())
                    (loss * scale).backward()
                window_losses[a].append(float(torch.stack(mb_losses).mean()))
            replica_grads.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params])
        for i, p in enumerate(params):
            total = replica_grads[0][i] / dp_size
            for r in range(1, dp_size):
                total = total + replica_grads[r][i] / dp_size
            p.grad = total
        set_aux_loss_scale(1.0)
        losses += [sum(v) / len(v) for v in window_losses]
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, clip_norm)
        opt.step()
        update_expert_biases(module)
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
    return losses, {n: p.detach().clone() for n, p in module.named_parameters()}


def checkpoint_worker(
    make_strategy: Callable[[], Any],
    make_module: Callable[[], L.LightningModule],
    dataset: torch.utils.data.Dataset,
    micro_batch: int,
    steps: int,
    ckpt_path: str,
) -> dict:
    """Fit ``steps`` steps with a validation at the end, save a checkpoint, then resume from it in a new Trainer for
    ``steps`` more steps. Returns the validation loss, the whole-model parameters after each fit and the losses of
    the resumed fit."""
    from tests.support.helpers import LossRecorder

    env = dict(os.environ)
    rank = int(os.environ["RANK"])
    results: dict[str, Any] = {"rank": rank}
    for phase in ("first", "resumed"):
        os.environ.update(env)
        strategy = make_strategy()
        dims = strategy.resolve_parallel_dims(int(os.environ["WORLD_SIZE"]))
        dp_rank = dims.coordinates(rank)["dp"]
        loader = _replica_loader(dataset, micro_batch, dims.dp_size, dp_rank)
        val_loader = _replica_loader(dataset, micro_batch, dims.dp_size, dp_rank)
        recorder = LossRecorder()
        module = make_module()
        trainer = quiet_trainer(
            strategy,
            dims.world_size,
            max_steps=steps if phase == "first" else 2 * steps,
            limit_val_batches=2,
            val_check_interval=steps,
            callbacks=[recorder],
        )
        if phase == "first":
            trainer.fit(module, loader, val_loader)
            results["val_loss"] = float(trainer.callback_metrics["val_loss"])
            trainer.save_checkpoint(ckpt_path)
        else:
            # Skip the batches the first fit consumed, as a resumed epoch would.
            trainer.fit(module, loader, val_loader, ckpt_path=ckpt_path)
        results[f"{phase}_losses"] = recorder.losses
        results[f"{phase}_state"] = gathered_params(module, strategy)
    return results
