"""LR scaling under real strategies (one launch of 2 ranks): the scaled, warmed-up rate reaches the optimizer step of a
sharded optimizer (zero2, a user's MLP with SGD + momentum) and of the reference GPT's AdamW with its own scheduler
(ddp_overlap): parameters match one process stepping the global batch at the rate the rule gives (rtol=1e-5)."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_par.launcher import run_distributed
from lightning_par.lr_scaling import lr_scale_factor, warmup_multiplier, warmup_steps
from tests.support.helpers import TIMEOUT_S, LossRecorder, assert_params_close, global_losses, quiet_trainer
from tests.support.p3d import _loader, make_gpt, token_data
from tests.support.pipeline import RegressionDataset, one_thread
from tests.support.user_models import make_mlp

pytestmark = pytest.mark.distributed

STEPS, MICRO, DP = 3, 4, 2
#: name: (strategy, model, rule, warmup_samples)
CASES = {
    "zero2-mlp-sgd-linear": ("zero2", "mlp", "linear", 2 * MICRO * DP),
    "ddp-gpt-adamw-sqrt": ("ddp_overlap", "gpt", "sqrt", 3 * MICRO * DP),
}


def _data(model: str):
    return RegressionDataset(n=MICRO * DP * STEPS) if model == "mlp" else token_data(MICRO * DP * STEPS)


def _module(model: str) -> L.LightningModule:
    return make_mlp("sgd") if model == "mlp" else make_gpt()


class _RateRecorder(L.Callback):
    def __init__(self) -> None:
        self.rates: list[list[float]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.rates.append([float(g["lr"]) for g in optimizer.param_groups])


def _worker() -> dict:
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_par.callbacks import LRScalingCallback

    torch.set_num_threads(1)
    env, rank = dict(os.environ), int(os.environ["RANK"])
    out = {}
    for name, (registry, model, rule, warmup) in CASES.items():
        os.environ.update(env)
        entry = StrategyRegistry[registry]
        strategy = entry["strategy"](**{**entry["init_params"], "timeout_s": 90})
        scaling, rates, losses = LRScalingCallback(rule, warmup_samples=warmup), _RateRecorder(), LossRecorder()
        trainer = quiet_trainer(strategy, DP, max_steps=STEPS, limit_val_batches=0, callbacks=[scaling, rates, losses])
        module = _module(model)
        trainer.fit(module, _loader(_data(model), MICRO, DP, rank))
        out[name] = {"dp_rank": rank, "losses": losses.losses, "state": strategy.full_state_dict(),
                     "rates": rates.rates, "extras": scaling.summary_extras()}
    return out


@pytest.fixture(scope="module")
def runs() -> dict:
    per_rank = run_distributed(_worker, DP, (), timeout_s=TIMEOUT_S)
    return {name: [r[name] for r in per_rank] for name in CASES}


def _reference(model: str, rule: str, warmup: int) -> tuple[list[float], dict, list[list[float]]]:
    """One process on the global batch, the rate multiplied by the rule's factor and the warm-up before each step."""
    torch.manual_seed(0)
    module = _module(model)
    config = module.configure_optimizers()
    optimizer = config["optimizer"] if isinstance(config, dict) else config
    scheduler = config["lr_scheduler"]["scheduler"] if isinstance(config, dict) else None
    factor = lr_scale_factor(rule, MICRO * DP, MICRO)
    for group in optimizer.param_groups:
        group["lr"] *= factor
    if scheduler is not None:
        scheduler.base_lrs = [b * factor for b in scheduler.base_lrs]
    num_warmup = warmup_steps(warmup, MICRO * DP)
    losses, rates = [], []
    for step, batch in enumerate(DataLoader(_data(model), batch_size=MICRO * DP)):
        loss = module.training_step(batch, step)
        loss.backward()
        base = [g["lr"] for g in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] *= warmup_multiplier(step, num_warmup)
        rates.append([g["lr"] for g in optimizer.param_groups])
        optimizer.step()
        optimizer.zero_grad()
        for group, lr in zip(optimizer.param_groups, base):
            group["lr"] = lr
        if scheduler is not None:
            scheduler.step()
        losses.append(float(loss))
    return losses, {n: p.detach() for n, p in module.named_parameters()}, rates


@pytest.mark.parametrize("name", list(CASES))
def test_scaled_rate_reaches_the_sharded_optimizer(runs, name):
    _, model, rule, warmup = CASES[name]
    with one_thread():
        losses, params, rates = _reference(model, rule, warmup)
    factor = 2.0 if rule == "linear" else 2.0 ** 0.5
    base = rates[-1][0] / factor
    assert [r[0] for r in rates] == pytest.approx([base * factor * warmup_multiplier(s, warmup // (MICRO * DP))
                                                   for s in range(STEPS)])
    torch.testing.assert_close(torch.tensor(global_losses(runs[name])), torch.tensor(losses), rtol=1e-5, atol=0)
    for r in runs[name]:
        torch.testing.assert_close(torch.tensor(r["rates"]), torch.tensor(rates), rtol=1e-6, atol=0)
        assert_params_close(r["state"], params)
        extras = r["extras"]
        assert extras["global_batch"] == MICRO * DP and extras["lr_scale_factor"] == pytest.approx(factor)
        assert extras["lr_warmup_steps"] == warmup // (MICRO * DP) and extras["lr_last"] == pytest.approx(rates[-1])
