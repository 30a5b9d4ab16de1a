"""A non-finite loss or gradient on ONE rank stops or skips the step on EVERY rank, under every strategy, for models
that are not our GPT.

Skip parity: a run of ``STEPS`` optimizer steps whose last step is poisoned on one rank ends with exactly the
parameters of a clean run of ``STEPS - 1`` steps (the skipped step changed no weight and no optimizer state: SGD with
momentum and weight decay, and AdamW, would both move the weights otherwise). Stop: every rank raises
``NonFiniteError`` naming the step, the poisoned rank (and its pipeline stage) and what was non-finite.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from lightning_par.fault.nonfinite import NonFiniteError, NonFiniteGuard
from lightning_par.launcher import run_distributed
from lightning_par.models import GPTConfig, GPTLightningModule
from lightning_par.strategies import DDPOverlapStrategy, Parallel3DStrategy, PipelineStrategy, TensorParallelStrategy
from lightning_par.strategies.zero import ZeroStrategy
from tests.support.helpers import TIMEOUT_S, LossRecorder, TokenDataset, full_state_dict, quiet_trainer
from tests.support.pipeline import RegressionDataset, SequentialModule, gathered_params
from tests.support.tensor_parallel import ToyLM, unpadded_state
from tests.support.zero import TokenMLP

pytestmark = pytest.mark.distributed

STEPS, MICRO = 3, 4
NAN = float("nan")


class Poisoned:
    """``poison = (step, rank, "loss" | "grad")``: make that step's loss, or one gradient entry, NaN on that rank."""

    poison: tuple[int, int, str] | None = None

    def poisoned(self, kind: str) -> bool:
        return self.poison is not None and self.poison[2] == kind and (
            (self.trainer.global_step, self.global_rank) == self.poison[:2]
        )


class PoisonedMLP(Poisoned, TokenMLP):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * NAN if self.poisoned("loss") else loss


class PoisonedToyLM(Poisoned, ToyLM):
    def on_after_backward(self) -> None:
        if self.poisoned("grad"):
            grad = self.ffn[0].weight.grad
            (grad._local_tensor if hasattr(grad, "_local_tensor") else grad).view(-1)[0] = NAN


class PoisonedSequential(Poisoned, SequentialModule):
    def loss_fn(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        loss = F.mse_loss(outputs, targets)  # the last pipeline stage calls this (training_step is not)
        return loss * NAN if self.poisoned("loss") else loss


class PoisonedGPT(Poisoned, GPTLightningModule):
    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        loss = GPTLightningModule.loss_fn(logits, targets)
        return loss * NAN if self.poisoned("loss") else loss


def _mlp():
    torch.manual_seed(0)
    return PoisonedMLP()


def _toy():
    torch.manual_seed(0)
    return PoisonedToyLM()


def _seq():
    torch.manual_seed(0)
    return PoisonedSequential()


def _gpt():
    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=16, vocab_size=256, dropout=0.0)
    return PoisonedGPT(config, learning_rate=3e-3, adam_eps=1e-6)


def _full(module, strategy):
    return full_state_dict(module)


STRATEGIES = {
    "ddp_overlap": (lambda: DDPOverlapStrategy(bucket_cap_mb=0.01, timeout_s=60), _mlp, "tokens", _full),
    "zero2": (lambda: ZeroStrategy(stage=2, timeout_s=60), _mlp, "tokens", _full),
    "zero3": (lambda: ZeroStrategy(stage=3, timeout_s=60), _mlp, "tokens", _full),
    "tensor_parallel": (lambda: TensorParallelStrategy(tp_size=2, plan=ToyLM.PLAN, timeout_s=60), _toy, "toy",
                        unpadded_state),
    "gpipe": (lambda: PipelineStrategy(pp_size=2, schedule="gpipe", num_microbatches=2, timeout_s=60), _seq,
              "regression", gathered_params),
    "parallel_3d": (lambda: Parallel3DStrategy(dp_size=2, pp_size=2, dp_mode="zero1", num_microbatches=2,
                                               timeout_s=90), _gpt, "tokens", gathered_params),
}
DATA = {
    "tokens": lambda: TokenDataset(n=64, seq=16),
    "toy": lambda: TokenDataset(n=64, seq=16, vocab=37),
    "regression": lambda: RegressionDataset(n=64),
}


def _run(case: dict[str, Any]) -> dict[str, Any]:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    make_strategy, make_module, data, state_fn = STRATEGIES[case["strategy"]]
    strategy = make_strategy()
    dims = strategy.resolve_parallel_dims(world)
    dataset = DATA[data]()
    sampler = DistributedSampler(dataset, num_replicas=dims.dp_size, rank=dims.coordinates(rank)["dp"], shuffle=False)
    module = make_module()
    module.poison = case.get("poison")
    guard = NonFiniteGuard(action=case["action"])
    recorder = LossRecorder()
    trainer = quiet_trainer(strategy, world, max_steps=case["steps"], limit_val_batches=0,
                            callbacks=[recorder, guard])
    try:
        trainer.fit(module, DataLoader(dataset, batch_size=MICRO, sampler=sampler, drop_last=True))
    except NonFiniteError as e:
        return {"error": str(e)}
    return {"state": state_fn(module, strategy), "skipped": guard.skipped, "losses": recorder.losses}


def _cases_worker(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    env = dict(os.environ)
    out = []
    for case in cases:
        os.environ.update(env)  # Lightning's environment teardown deletes WORLD_SIZE after each fit
        out.append(_run(case))
    return out


def _launch(world: int, cases: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    per_rank = run_distributed(_cases_worker, world, (cases,), timeout_s=TIMEOUT_S)
    return [[per_rank[r][c] for r in range(world)] for c in range(len(cases))]


SKIP_WORLD2 = [  # (strategy, poisoned rank, what)
    ("ddp_overlap", 1, "loss"),
    ("zero2", 1, "loss"),
    ("zero3", 0, "loss"),
    ("tensor_parallel", 1, "grad"),
    ("gpipe", 1, "loss"),  # rank 1 is the last stage, where the loss is computed
]
STOP_WORLD2 = [  # (strategy, poisoned rank, what, step, expected pieces of the message)
    ("ddp_overlap", 0, "loss", 1, ["Non-finite loss", "at step 1", "rank 0: loss=nan"]),
    ("tensor_parallel", 1, "grad", 1, ["Non-finite gradient at step 1", "rank 1: non-finite gradient in ffn.0.weight"]),
    ("gpipe", 1, "loss", 0, ["at step 0", "rank 1 (pipeline stage 1): loss=nan", "rank 0 (pipeline stage 0)"]),
]


@pytest.fixture(scope="module")
def world2() -> dict[str, Any]:
    cases = []
    for name, rank, what in SKIP_WORLD2:
        cases.append({"strategy": name, "action": "skip", "steps": STEPS, "poison": (STEPS - 1, rank, what)})
        cases.append({"strategy": name, "action": "skip", "steps": STEPS - 1})
    for name, rank, what, step, _ in STOP_WORLD2:
        cases.append({"strategy": name, "action": "stop", "steps": STEPS, "poison": (step, rank, what)})
    results = _launch(2, cases)
    n = 2 * len(SKIP_WORLD2)
    return {
        "skip": {SKIP_WORLD2[i][0]: (results[2 * i], results[2 * i + 1]) for i in range(len(SKIP_WORLD2))},
        "stop": {STOP_WORLD2[i][0]: results[n + i] for i in range(len(STOP_WORLD2))},
    }


def _assert_skip_is_no_step(poisoned: list[dict], clean: list[dict]) -> None:
    for p, c in zip(poisoned, clean):
        assert p["skipped"] == 1 and c["skipped"] == 0
        assert p["state"].keys() == c["state"].keys()
        for name in c["state"]:
            assert torch.isfinite(p["state"][name]).all(), name
            torch.testing.assert_close(p["state"][name], c["state"][name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("name", [c[0] for c in SKIP_WORLD2])
def test_a_skipped_step_changes_nothing_on_any_rank(world2, name):
    poisoned, clean = world2["skip"][name]
    _assert_skip_is_no_step(poisoned, clean)


@pytest.mark.parametrize("name", [c[0] for c in STOP_WORLD2])
def test_every_rank_stops_naming_the_step_the_rank_and_the_value(world2, name):
    expected = next(c[4] for c in STOP_WORLD2 if c[0] == name)
    for result in world2["stop"][name]:
        assert "error" in result, result.keys()
        for piece in expected:
            assert piece in result["error"], (piece, result["error"])
    if name == "tensor_parallel":  # rank 0's shard of ffn.0.weight is finite: only rank 1 is named
        assert "rank 0:" not in world2["stop"][name][0]["error"]


def test_parallel_3d_skips_on_every_rank():
    """dp2 x pp2, zero1 on the dp axis: the loss of one replica's last stage is poisoned."""
    cases = [
        {"strategy": "parallel_3d", "action": "skip", "steps": STEPS, "poison": (STEPS - 1, 3, "loss")},
        {"strategy": "parallel_3d", "action": "skip", "steps": STEPS - 1},
    ]
    poisoned, clean = _launch(4, cases)
    _assert_skip_is_no_step(poisoned, clean)
