"""NCCL's device rule on every layout, on the CPU: no collective of a training step, a validation, a checkpoint save or
a resume receives a tensor built on the host (:mod:`tests.support.device_rule`: a factory without ``device=``, or what is
computed from such tensors only; NCCL would raise ``No backend type associated with device type cpu`` on a GPU).

Each case is one short fit (one optimizer step, a validation at its end) of a tiny model on gloo ranks under
:class:`tests.support.device_rule.DeviceRule`; two cases save a checkpoint and two more resume from them for one more step.
Every layout: ddp_overlap, zero1-3, HSDP, tp with sequence parallelism, pp with one schedule of each family (one
stage per rank, looped virtual stages, V-shaped zero bubble) alone and with dp, cp with both methods alone and with
dp, ep; and fault-tolerant replica groups (torchft), whose own cross-group all-reduce the rule sees too. One launch per
world size (the replica groups: one OS process per group, each its own world); a case that breaks the rule fails on
its own (every rank refuses the same collective, so none waits on the others). Before the fix of issue 45 every dp
layout failed here in the token count of ``data_parallel/token_mean.py`` (the fault-tolerant case too, within each
group: shown by putting the old host-built count back).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.device_rule import rule_report
from tests.support.p3d import plan_worker, token_data

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
    per_rank = run_distributed(plan_worker, world,
                               (plan, token_data(MICRO * 4 * 2), token_data(MICRO * 4, seed=1), rule_report),
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


# ---------------------------------------------------------------------------------------------- fault-tolerant groups
#: the layout inside each of the two replica groups (2 ranks each): a preset and its options; CI runs zero2 (dp2),
#: the others are ``slow``
FT_LAYOUTS: dict[str, tuple[str, dict[str, Any]]] = {
    "zero2": ("zero2", {}), "zero3": ("zero3", {}), "ddp_overlap": ("ddp_overlap", {}),
    "zero2-tp2": ("parallel_3d", {"dp_mode": "zero2", "tp_size": 2, "sequence_parallel": True}),
}
FT_PRESETS = ["zero2", *(pytest.param(name, marks=pytest.mark.slow) for name in list(FT_LAYOUTS)[1:])]


@pytest.mark.parametrize("preset", FT_PRESETS)
def test_fault_tolerant_groups_keep_every_collective_on_the_device(tmp_path: Path, preset: str) -> None:
    """Two replica groups (each its own world of 2 ranks, the ``preset`` layout of :data:`FT_LAYOUTS` inside,
    torchft across; the lighthouse started here) fit the tiny GPT for one step with a validation and save a
    checkpoint, then each resumes its own for one more step, every step under :class:`~tests.support.device_rule.DeviceRule`. torchft's cross-group all-reduce
    (``Manager.allreduce`` -> its ``ProcessGroupGloo`` -> ``c10d.allreduce_``) reaches the dispatcher on the training
    thread, so the rule sees it: the count of collectives issued from torchft's files must be above 0 in both fits
    (the first fit also streams group 0's state to group 1, ``init_sync``, which applies it on the training thread)."""
    pytest.importorskip("torchft")
    from torchft.coordination import LighthouseServer

    from tests.support.ft import start_group

    strategy, options = FT_LAYOUTS[preset]
    fit = {**_fit(f"ft-{preset}", strategy=strategy, **options), "watch": ["torchft"],
           "save": str(tmp_path / "g{group}.ckpt")}
    plan = [fit, {**fit, "name": f"ft-{preset}-resume", "save": None, "resume": str(tmp_path / "g{group}.ckpt"),
                  "steps": 2}]
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    procs = []
    try:
        cfg = dict(lighthouse=lighthouse.address(), groups=2, world=2, dir=str(tmp_path), plan=plan,
                   device_rule=True, timeout_s=400.0)
        procs = [start_group({**cfg, "group": g}) for g in range(2)]
        deadline = time.monotonic() + 420
        for p in procs:
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            logs = "\n".join(f.read_text()[-3000:] for f in sorted(tmp_path.glob("log_g*.txt")))
            assert rc == 0, f"replica group exited with {rc}\n{logs}"
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
        lighthouse.shutdown()
    reports = {(g, rank): results for g in range(2)
               for rank, results in enumerate(torch.load(tmp_path / f"result_g{g}.pt", weights_only=False))}
    errors = [f"group {g} rank {rank} {r['name']}: {r['error']}" for (g, rank), results in reports.items()
              for r in results if r["error"] is not None]
    assert not errors, "\n".join(errors)
    for (g, rank), results in reports.items():
        assert [r["name"] for r in results] == [s["name"] for s in plan]
        for r in results:
            where = f"group {g} rank {rank} {r['name']}"
            assert r["collectives"] > 0, where
            assert r["watched"]["torchft"] > 0, f"{where}: the rule saw no collective of torchft's"
            extras = r["extras"]
            assert extras["ft_steps_committed"] >= 1 and extras["ft_live_replicas"] == 2, (where, extras)


def test_the_rule_sees_torchfts_process_group() -> None:
    """torchft's ``ProcessGroupGloo`` (what ``FaultTolerantReplicas`` averages through) calls the c10d backend from
    Python, not ``torch.distributed``'s functions: its ``allreduce`` still reaches the dispatcher as
    ``c10d.allreduce_`` on the calling thread, so :class:`DeviceRule` refuses a host tensor there and counts the call
    as torchft's (a world of one, its own store)."""
    pytest.importorskip("torchft")
    from datetime import timedelta

    from torch.distributed import AllreduceOptions, ReduceOp, TCPStore
    from torchft import ProcessGroupGloo

    from tests.support.device_rule import DeviceRule, HostTensorInCollective

    store = TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))
    pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
    pg.configure(f"127.0.0.1:{store.port}/rule", "rule_replica", 0, 1)
    opts = AllreduceOptions()
    opts.reduceOp = ReduceOp.SUM
    with DeviceRule(watch=("torchft",)) as rule:
        device = torch.ones(3, device="cpu")  # device= given: the group's device on a GPU machine
        pg.allreduce([device], opts).wait()
        with pytest.raises(HostTensorInCollective, match=r"c10d\.allreduce_.*built on the host"):
            pg.allreduce([torch.ones(3)], opts)
    assert rule.collectives == 2 and rule.watched == {"torchft": 2}, (rule.collectives, rule.watched)
    assert len(rule.violations) == 1
    torch.testing.assert_close(device, torch.ones(3))
    pg.shutdown()
