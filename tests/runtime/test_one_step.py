"""The Trainer and Fabric run one step: the runtime's (:mod:`lightning_par.runtime.step`).

Replacing the runtime's forward-and-loss function (:func:`lightning_par.runtime.step.forward`) by one that triples
the loss changes what BOTH hosts train: a ``Trainer.fit`` of one step under ``strategy="ddp_overlap"`` and a Fabric
loop under ``Fabric(strategy="ddp_overlap")`` (``lightning_par.fabric.train_step``). With plain SGD the update is
linear in the gradient, so each host's patched update is exactly 3x its own unpatched one, and the two hosts' updates
are equal, patched or not. One process (a gloo group of 1), in a forked child: the launchers set environment
variables and the process group outlives a ``fit``.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.support.helpers import in_a_forked_child

pytestmark = pytest.mark.distributed

VOCAB, WIDTH, BATCH, SEQ, LR, FACTOR = 32, 16, 8, 12, 0.5, 3.0


def _network() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Tanh(), nn.Linear(WIDTH, VOCAB))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


class _Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = _network()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return _loss(self.model(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


class _Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = _network()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


def _trainer_step() -> dict[str, torch.Tensor]:
    """One ``Trainer.fit`` step; the network's parameters after it."""
    module = _Module()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy="ddp_overlap", max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, use_distributed_sampler=False)
    trainer.fit(module, DataLoader(TensorDataset(*_batch()), batch_size=BATCH))
    return {n: p.detach().clone() for n, p in trainer.strategy.parallel.full_state_dict().items()}


def _fabric_step() -> dict[str, torch.Tensor]:
    """One step of a Fabric loop through ``lightning_par.fabric.train_step``; the parameters after it."""
    from lightning_par.fabric import train_step

    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="ddp_overlap")
    fabric.launch()
    model = _Plain()
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    train_step(model, _batch(), loss_fn=_loss)
    opt.step()
    opt.zero_grad()
    return {n: p.detach().clone() for n, p in fabric.strategy.parallel.full_state_dict().items()}


def _update(after: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([(after[n] - before[n]).flatten() for n in sorted(before)])


def _both_hosts() -> None:
    from lightning_par.runtime import step

    start = {f"model.{n}": p.detach().clone() for n, p in _network().named_parameters()}
    plain = {"trainer": _trainer_step(), "fabric": _fabric_step()}
    original = step.forward
    calls: list[int] = []

    def tripled(parallel: Any, call: Any, batch: Any, loss_scale: float = 1.0) -> Any:
        calls.append(1)
        return FACTOR * original(parallel, call, batch, loss_scale)

    step.forward = tripled  # the runtime's step function, as both adapters look it up
    try:
        patched = {"trainer": _trainer_step(), "fabric": _fabric_step()}
    finally:
        step.forward = original
    assert len(calls) == 2, calls  # one training step per host went through it
    assert set(start) == set(plain["trainer"]) == set(plain["fabric"]), (sorted(start), sorted(plain["trainer"]))
    trainer = _update(plain["trainer"], start)
    assert trainer.abs().max() > 1e-2  # the step moved the parameters (the patch's change is 2x that)
    # unpatched: the two hosts compute the same step, and so the same parameters
    for n in start:
        torch.testing.assert_close(plain["fabric"][n], plain["trainer"][n], rtol=1e-5, atol=1e-6)
    # patched: both compute the patched step (3x their unpatched update), and the same parameters. An update is a
    # difference of fp32 parameters of magnitude ~1, exact to their rounding (~1.2e-7 each): atol 1e-6 for it.
    for host in ("trainer", "fabric"):
        torch.testing.assert_close(_update(patched[host], start), FACTOR * _update(plain[host], start),
                                   rtol=1e-5, atol=1e-6)
    for n in start:
        torch.testing.assert_close(patched["fabric"][n], patched["trainer"][n], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(patched["trainer"][n], plain["trainer"][n], rtol=1e-3, atol=1e-4), n


def test_replacing_the_runtime_step_changes_both_hosts():
    status, _, output = in_a_forked_child(_both_hosts, timeout_s=180)
    assert status == 0, output
