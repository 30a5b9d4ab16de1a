"""Parity of ``ddp_overlap`` at world size 2 against one process on the same global batch, and its overlap."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import pytest
import torch

from lightning_par.models import GPTConfig, GPTLightningModule
from lightning_par.launcher import run_distributed
from lightning_par.strategies import DDPOverlapStrategy
from tests.support.helpers import (
    TIMEOUT_S,
    TokenDataset,
    assert_params_close,
    global_losses,
    quiet_trainer,
    reference_fit,
    run_fit,
)
from tests.support.user_models import make_mlp

pytestmark = pytest.mark.distributed

CONFIG = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=256, dropout=0.0)
STEPS, MICRO, WORLD = 4, 4, 2


def make_module() -> GPTLightningModule:
    torch.manual_seed(0)
    return GPTLightningModule(GPTConfig(**CONFIG), learning_rate=3e-3, adam_eps=1e-6)


def make_strategy(**kw):
    return lambda: DDPOverlapStrategy(bucket_cap_mb=0.02, timeout_s=60, **kw)


@pytest.fixture(scope="module")
def dataset() -> TokenDataset:
    return TokenDataset(n=128, seq=CONFIG["block_size"])


@pytest.fixture(scope="module")
def reference(dataset):
    return reference_fit(make_module, dataset, MICRO * WORLD, STEPS)


@pytest.mark.parametrize("options", [{"gradient_as_bucket_view": False}, {"static_graph": True}])
def test_parity_fp32(dataset, reference, options):
    ref_losses, ref_params = reference
    results = run_fit(WORLD, make_strategy(**options), make_module, dataset, MICRO, STEPS)
    torch.testing.assert_close(torch.tensor(global_losses(results)), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for r in results:
        assert_params_close(r["state"], ref_params)
    extras = results[0]["extras"]
    assert extras["num_buckets"] > 1  # the small cap splits the model, so overlap is possible at all


def test_first_bucket_launches_before_backward_ends(dataset):
    """Bucket 0 is all-reduced while backward still computes: it launches before the last gradient hook runs."""
    results = run_fit(WORLD, make_strategy(), make_module, dataset, MICRO, 2)
    for r in results:
        assert r["extras"]["first_bucket_launched_before_backward_end"] is True
        assert 0.0 <= r["extras"]["comm_overlap_fraction"] <= 1.0


def test_gradient_accumulation_parity(dataset):
    ref_losses, ref_params = reference_fit(make_module, dataset, MICRO * WORLD, 2, accumulate=2)
    results = run_fit(WORLD, make_strategy(), make_module, dataset, MICRO, 2, {"accumulate_grad_batches": 2})
    torch.testing.assert_close(torch.tensor(global_losses(results)), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for r in results:
        assert_params_close(r["state"], ref_params)
        assert r["extras"]["synchronised_backwards"] == 2  # 4 backward passes, all-reduce only on the last of each 2


@pytest.mark.parametrize("hook", ["fp16", "bf16"])
def test_cast_hooks_within_their_precision(dataset, reference, hook):
    """The wire dtype rounds each averaged gradient: fp16 keeps 11 significant bits, bf16 8."""
    ref_losses, ref_params = reference
    results = run_fit(WORLD, make_strategy(comm_hook=hook), make_module, dataset, MICRO, STEPS)
    rtol = {"fp16": 1e-3, "bf16": 1e-2}[hook]
    torch.testing.assert_close(torch.tensor(global_losses(results)), torch.tensor(ref_losses), rtol=rtol, atol=0)
    torch.testing.assert_close(results[0]["state"], results[1]["state"], rtol=0, atol=0)  # replicas agree exactly


def test_powersgd_replicas_agree_and_match_before_compression(dataset, reference):
    """PowerSGD is exact during its plain all-reduce warm-up and lossy after; replicas always agree bit for bit."""
    ref_losses, _ = reference
    results = run_fit(WORLD, make_strategy(comm_hook="powersgd", powersgd_rank=2, powersgd_start_iter=2), make_module,
                      dataset, MICRO, STEPS)
    losses = global_losses(results)
    torch.testing.assert_close(torch.tensor(losses[:3]), torch.tensor(ref_losses[:3]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=5e-2, atol=0)
    torch.testing.assert_close(results[0]["state"], results[1]["state"], rtol=0, atol=0)


class _GradsAtHooks(L.Callback):
    """Copies every parameter's gradient at ``on_after_backward`` and at ``on_before_optimizer_step``."""

    def __init__(self) -> None:
        self.after_backward: list[dict[str, torch.Tensor]] = []
        self.before_step: list[dict[str, torch.Tensor]] = []

    @staticmethod
    def _grads(module: L.LightningModule) -> dict[str, torch.Tensor]:
        return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.after_backward.append(self._grads(pl_module))

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.before_step.append(self._grads(pl_module))


def _grads_at_hooks_worker(strategy_name: str) -> dict:
    from torch.utils.data import DataLoader, TensorDataset

    rank = int(os.environ["RANK"])
    g = torch.Generator().manual_seed(rank)  # each rank its own data: unreduced gradients differ between ranks
    loader = DataLoader(TensorDataset(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)), batch_size=4)
    hooks = _GradsAtHooks()
    trainer = quiet_trainer(strategy_name, WORLD, max_steps=2, limit_val_batches=0, callbacks=[hooks])
    trainer.fit(make_mlp("sgd"), loader)
    return {"after_backward": hooks.after_backward, "before_step": hooks.before_step}


@pytest.mark.parametrize("strategy_name", ["ddp_overlap", "zero1"])
def test_on_after_backward_sees_the_averaged_gradients(strategy_name):
    """As under Lightning's DDPStrategy (whose reduction ends inside backward), a user's ``on_after_backward`` sees
    gradients already averaged over dp: the same on every rank, and the ones the optimizer then steps with."""
    results = run_distributed(_grads_at_hooks_worker, WORLD, (strategy_name,), timeout_s=TIMEOUT_S)
    for r in results:
        assert len(r["after_backward"]) == len(r["before_step"]) == 2
        for after, before in zip(r["after_backward"], r["before_step"]):
            assert after.keys() == before.keys() and len(after) == len(list(make_mlp().parameters()))
            torch.testing.assert_close(after, before, rtol=0, atol=0)
    for step in range(2):
        torch.testing.assert_close(results[0]["after_backward"][step], results[1]["after_backward"][step],
                                   rtol=1e-6, atol=1e-7)
