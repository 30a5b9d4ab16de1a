"""NCCL's device rule on every layout, on the CPU: no collective of a training step, a validation, a checkpoint save or
a resume receives a tensor built on the host (:mod:`tests.device_rule`: a factory without ``device=``, or what is
computed from such tensors only; NCCL would raise ``No backend type associated with device type cpu`` on a GPU).

Each case is one short fit (one optimizer step, a validation at its end) of a tiny model on gloo ranks under
:class:`tests.device_rule.DeviceRule`; two cases save a checkpoint and two more resume from them for one more step.
Every layout: ddp_overlap, zero1-3, HSDP, tp with sequence parallelism, pp with one schedule of each family (one
stage per rank, looped virtual stages, V-shaped zero bubble) alone and with dp, cp with both methods alone and with
dp, ep. One launch per world size; a case that breaks the rule fails on its own (every rank refuses the same
collective, so none waits on the others). Before the fix of issue 45 every dp layout failed here in the token count
of ``data_parallel/token_mean.py``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.device_rule import DeviceRule
from tests.p3d_helpers import run_step, token_data

pytestmark = pytest.mark.distributed

MICRO = 8


def _fit(name: str, model: str = "gpt", strategy: str = "parallel_3d", **options: Any) -> dict[str, Any]:
    return {"kind": "fit", "name": name, "model": model, "strategy": strategy, "options": options, "steps": 1,
            "micro_batch": MICRO, "val": True}


WORLD2 = [
    _fit("ddp_overlap", strategy="ddp_overlap"),
    _fit("zero1", dp_mode="zero1"),
    _fit("zero2", dp_mode="zero2"),
    _fit("zero3", dp_mode="zero3"),
    _fit("tp2-sp", tp_size=2, sequence_parallel=True),
    _fit("pp2-1f1b", pp_size=2, schedule="1f1b", num_microbatches=4),
    _fit("pp2-interleaved_1f1b", pp_size=2, schedule="interleaved_1f1b", num_microbatches=4),
    _fit("pp2-zbv_zero_bubble", pp_size=2, schedule="zbv_zero_bubble", num_microbatches=4),
    _fit("cp2-ring", cp_size=2, method="ring"),
    _fit("cp2-all_to_all", cp_size=2, method="all_to_all"),
    _fit("ep2", model="moegpt", ep_size=2),
]
WORLD4 = [
    _fit("hsdp2x2-zero3", dp_replicate_size=2, dp_shard_size=2, dp_mode="zero3"),
    _fit("dp2pp2-1f1b-zero1", dp_size=2, pp_size=2, schedule="1f1b", num_microbatches=4, dp_mode="zero1"),
    _fit("dp2cp2-ring-zero2", dp_size=2, cp_size=2, dp_mode="zero2"),
    _fit("dp2tp2-sp-zero3", dp_size=2, tp_size=2, sequence_parallel=True, dp_mode="zero3"),
]
#: the cases that save a checkpoint, each resumed by a case of the same layout for one more step
SAVERS = ("zero3", "pp2-1f1b")


def guarded_worker(plan: list[dict[str, Any]], train: Any, val: Any) -> list[dict[str, Any]]:
    """Body of one rank: every step of ``plan`` under :class:`DeviceRule`; a step's exception is returned, by name."""
    env = dict(os.environ)
    torch.set_num_threads(1)
    results = []
    for step in plan:
        os.environ.clear()
        os.environ.update(env)  # Lightning's teardown removes WORLD_SIZE and friends after each fit
        rule = DeviceRule()
        try:
            with rule:
                run_step(step, train, val)
            results.append({"name": step["name"], "error": None, "collectives": rule.collectives})
        except Exception as err:  # noqa: BLE001 - reported by the case's test
            results.append({"name": step["name"], "error": f"{type(err).__name__}: {err}"[:2000],
                            "collectives": rule.collectives, "violations": rule.violations})
    return results


def _plan(cases: list[dict[str, Any]], tmp: str) -> list[dict[str, Any]]:
    plan = [dict(c) for c in cases]
    for case in list(plan):
        if case["name"] in SAVERS:
            path = os.path.join(tmp, f"{case['name']}.ckpt")
            case["save"] = path
            plan.append({**case, "name": f"{case['name']}-resume", "save": None, "resume": path, "steps": 2})
    return plan


def _launch(world: int, cases: list[dict[str, Any]], tmp: str) -> dict[str, list[dict[str, Any]]]:
    from lightning_par.launcher import run_distributed

    plan = _plan(cases, tmp)
    per_rank = run_distributed(guarded_worker, world, (plan, token_data(MICRO * 4 * 2), token_data(MICRO * 4, seed=1)),
                               timeout_s=900)
    return {step["name"]: [per_rank[r][i] for r in range(world)] for i, step in enumerate(plan)}


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _launch(2, WORLD2, str(tmp_path_factory.mktemp("rule2")))


@pytest.fixture(scope="module")
def world4(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _launch(4, WORLD4, str(tmp_path_factory.mktemp("rule4")))


def _check(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["error"] is None, r["error"]
        assert r["collectives"] > 0  # the rule saw the step's collectives (a check that saw none proves nothing)


@pytest.mark.parametrize("name", [c["name"] for c in _plan(WORLD2, "")])
def test_world2_layout_keeps_every_collective_on_the_device(world2, name):
    _check(world2[name])


@pytest.mark.parametrize("name", [c["name"] for c in WORLD4])
def test_world4_layout_keeps_every_collective_on_the_device(world4, name):
    _check(world4[name])
