"""docs/adding-an-optimizer.md's demonstration: an optimizer outside the package (:mod:`tests.support.demo_optimizer`,
scaled sign-SGD, which reads each whole matrix like Muon) trains the tiny GPT under a Trainer at dp2, equal to one
process, with no file of ``lightning_par`` naming it.

Two cells, one launch each: ``ddp_overlap`` (whole gradients on every rank) and ``zero2`` (each rank steps its chunk
of every parameter; the optimizer reads the whole matrix through the engine's ``set_global_views``). 3 optimizer
steps, fp32, losses at ``rtol=1e-5`` and parameters at :func:`~tests.support.helpers.assert_params_close`.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

import lightning_par
from lightning_par.models import GPTLightningModule
from lightning_par.strategies import DDPOverlapStrategy, ZeroStrategy
from tests.support.helpers import assert_params_close, reference_fit, run_fit
from tests.support.p3d import CONFIG, token_data
from tests.support.demo_optimizer import ScaledSignSGD

pytestmark = pytest.mark.distributed

STEPS, MICRO, WORLD = 3, 4, 2
#: the demo optimizer, named by its import path, and its one option.
DEMO = {"optimizer": "tests.support.demo_optimizer:SIGN_SGD", "sign_sgd_lr": 0.05}


def make_module(optimizer: dict | None = None) -> GPTLightningModule:
    torch.manual_seed(0)
    return GPTLightningModule(CONFIG, learning_rate=3e-3, adam_eps=1e-6, **(DEMO if optimizer is None else optimizer))


def _strategy(name: str):  # module level: it travels to the ranks by pickling
    if name == "zero2":
        return ZeroStrategy(stage=2, timeout_s=90)
    return DDPOverlapStrategy(timeout_s=90)


def _state(module: GPTLightningModule, strategy) -> dict:
    optimizer = module.trainer.optimizers[0]
    return {"params": strategy.full_state_dict(), "optimizer": type(optimizer).__name__,
            "steps": optimizer.steps_taken, "whole_matrix_reads": optimizer.whole_matrix_reads}


def test_the_demo_optimizer_is_named_by_no_package_file():
    package = Path(lightning_par.__file__).parent
    assert not [p for p in package.rglob("*.py") if "demo_optimizer" in p.read_text() or "sign_sgd" in p.read_text()]
    assert isinstance(make_module().configure_optimizers()["optimizer"], ScaledSignSGD)
    with pytest.raises(ValueError, match="GPTLightningModule sign_sgd_lr=0 is not valid: expected a positive float"):
        make_module({**DEMO, "sign_sgd_lr": 0})


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp_overlap", "zero2"])
def test_the_demo_optimizer_at_dp2_matches_one_process(strategy):
    data = token_data(WORLD * MICRO * STEPS)
    ref_losses, ref_params = reference_fit(make_module, data, WORLD * MICRO, STEPS)
    adamw_losses, _ = reference_fit(functools.partial(make_module, {}), data, WORLD * MICRO, STEPS)
    assert abs(ref_losses[-1] - adamw_losses[-1]) > 1e-3  # the optimizer decides the run (it is not AdamW's)
    results = run_fit(WORLD, functools.partial(_strategy, strategy), make_module, data, MICRO, STEPS, None, _state,
                      timeout_s=300)
    losses = [sum(v) / WORLD for v in zip(*(r["losses"] for r in results))]  # equal micro-batches: the global mean
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for r in results:
        assert r["state"]["optimizer"] == "ScaledSignSGD" and r["state"]["steps"] == STEPS
        assert_params_close(r["state"]["params"], ref_params)
    # zero2: every parameter's scale came from its whole matrix (each rank holds a chunk), ddp_overlap: none needed
    reads = [r["state"]["whole_matrix_reads"] for r in results]
    assert reads == ([len(ref_params)] * WORLD if strategy == "zero2" else [0] * WORLD)
