"""A module fitted again, as a Lightning user does it: a second, new Trainer on the same module (the staged /
fine-tune pattern), and ``fit`` twice on one Trainer, under every layout, against one process doing the same fits.

Before the fix the first fit's engines stayed on the module: under ``zero2`` the second fit's steps left it unchanged,
under ``zero3`` and pipelining the second Trainer started from other weights, tensor parallelism crashed
(``distribute_module should only be called once``), and ``fit`` twice at dp 2 x tp 2 trained the split parameters with
zero gradients (the teardown's ``.cpu()`` dropped their gradient hooks). Now a new strategy puts the plain module back
first (:meth:`lightning_par.parallelize.ParallelModel.unparallelize`), and the same Trainer reuses its parallel module.

Every case: losses of every step of both fits (the mean over the dp replicas), the final parameters, the
``trainer.validate`` / ``trainer.test`` losses of new Trainers afterwards, and the module put back to its plain form
at the end (same classes, no hooks, plain parameters) — fp32, rel 1e-5, SGD with momentum and AdamW. Lightning injects
its shuffling ``DistributedSampler``; the reference walks the same samples (:mod:`tests.support.reparallel`).
"""

from __future__ import annotations

import pytest
import torch

from lightning_par.launcher import run_distributed
from tests.support.helpers import TIMEOUT_S, assert_params_close
from tests.support.reparallel import global_losses, reference, worker

pytestmark = pytest.mark.distributed

STEPS = 3

#: World 2: every single-axis layout, each fitted by two new Trainers.
WORLD2 = [
    {"name": "zero1", "strategy": "zero1", "optimizer": "sgd", "dp": 2, "evaluate": True},
    {"name": "zero2", "strategy": "zero2", "optimizer": "adamw", "dp": 2},
    {"name": "zero3", "strategy": "zero3", "optimizer": "sgd", "dp": 2, "evaluate": True},
    {"name": "tp2", "strategy": "tensor_parallel", "options": {"tp_size": 2}, "optimizer": "adamw", "dp": 1,
     "evaluate": True},
    {"name": "pp2", "strategy": "1f1b", "optimizer": "sgd", "dp": 1, "evaluate": True},
]
for _case in WORLD2:
    _case["fits"] = [("new", STEPS), ("new", STEPS)]

#: World 4: dp 2 x tp 2 and dp 2 x pp 2 with two new Trainers, and fit twice on one Trainer at dp 2 x tp 2.
WORLD4 = [
    {"name": "dp2_tp2", "strategy": "tensor_parallel", "options": {"tp_size": 2}, "optimizer": "adamw", "dp": 2,
     "fits": [("new", STEPS), ("new", STEPS)], "evaluate": True},
    {"name": "dp2_tp2_same_trainer", "strategy": "tensor_parallel", "options": {"tp_size": 2}, "optimizer": "sgd",
     "dp": 2, "fits": [("new", STEPS), ("same", STEPS)]},
    {"name": "dp2_pp2", "strategy": "1f1b", "optimizer": "sgd", "dp": 2, "fits": [("new", STEPS), ("new", STEPS)]},
]

#: Slow: the other layout for the second Trainer (the plain module goes from one layout to another), and fit twice on
#: one Trainer at dp 2 x pp 2 and under zero3.
SLOW2 = [
    {"name": "pp2_then_zero3", "strategy": "1f1b", "optimizer": "adamw", "dp": 1,
     "fits": [("new", STEPS), ("new", STEPS, {"strategy": "zero3", "dp": 2})], "evaluate": True},
    {"name": "zero3_same_trainer", "strategy": "zero3", "optimizer": "adamw", "dp": 2,
     "fits": [("new", STEPS), ("same", STEPS)]},
]
SLOW4 = [
    {"name": "dp2_tp2_then_dp2_pp2", "strategy": "tensor_parallel", "options": {"tp_size": 2}, "optimizer": "sgd",
     "dp": 2, "fits": [("new", STEPS), ("new", STEPS, {"strategy": "1f1b", "options": {}})], "evaluate": True},
    {"name": "dp2_pp2_same_trainer", "strategy": "1f1b", "optimizer": "adamw", "dp": 2,
     "fits": [("new", STEPS), ("same", STEPS)]},
]


def _check(cases: list[dict], world: int) -> None:
    results = run_distributed(worker, world, (cases,), timeout_s=TIMEOUT_S * 2)
    for case in cases:
        runs = [r[case["name"]] for r in results]
        ref = reference(case)
        got = global_losses(runs)
        for fit, (losses, expected) in enumerate(zip(got, ref["losses"])):
            torch.testing.assert_close(
                torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0,
                msg=lambda m, c=case["name"], f=fit: f"{c}, fit {f + 1}: {m}",
            )
        for run in runs:
            assert not run["owned"], case["name"]
            assert run["structure"] == ref["structure"], case["name"]
            assert_params_close(run["params"], ref["params"])
            if case.get("evaluate"):
                assert run["val"] == pytest.approx(ref["val"], rel=1e-5), case["name"]
                assert run["test"] == pytest.approx(ref["test"], rel=1e-5), case["name"]


def test_second_trainer_single_axis_layouts() -> None:
    """zero1, zero2, zero3, tp 2 and 1F1B pp 2: a second, new Trainer continues from the first one's weights."""
    _check(WORLD2, 2)


def test_second_trainer_and_fit_twice_two_axis_layouts() -> None:
    """dp 2 x tp 2 and dp 2 x pp 2 with a second Trainer, and fit twice on one Trainer at dp 2 x tp 2."""
    _check(WORLD4, 4)


@pytest.mark.slow
def test_second_trainer_other_layout_world2() -> None:
    _check(SLOW2, 2)


@pytest.mark.slow
def test_second_trainer_other_layout_world4() -> None:
    _check(SLOW4, 4)
