"""The fault-tolerant replicate axis (torchft) on gloo: replica groups, each its own world, the lighthouse started by
the test. Parity with one process without failures; a group SIGKILLed mid-run while the other keeps stepping, then
restarted and joined with the live group's state streamed over HTTP (bitwise equal at the first step after it joins).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from tests.ft_helpers import progress, regression_dataset, start_group
from tests.helpers import assert_params_close, reference_fit
from tests.user_models import make_mlp

torchft = pytest.importorskip("torchft")  # in the dev extra: CI runs these
from torchft.coordination import LighthouseServer  # noqa: E402

pytestmark = pytest.mark.distributed

MICRO, STEPS = 4, 8


def _wait(procs: list, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            assert rc == 0, f"replica group exited with {rc}"
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _logs(dir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(dir.glob("log_g*.txt")))


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_two_groups_zero2_match_one_process(tmp_path: Path, optimizer: str) -> None:
    """2 replica groups x zero2 dp2 (4 ranks, two worlds) == one process on the global batch of 16 (= plain HSDP
    dp_replicate 2 x dp_shard 2, which the HSDP tests hold to the same reference), 8 steps."""
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        cfg = dict(lighthouse=lighthouse.address(), groups=2, world=2, dp_mode="zero2", optimizer=optimizer,
                   micro_batch=MICRO, steps=STEPS, dir=str(tmp_path), min_replicas=2)
        procs = [start_group({**cfg, "group": g}) for g in range(2)]
        try:
            _wait(procs, 240)
        except AssertionError:
            raise AssertionError(_logs(tmp_path))
    finally:
        lighthouse.shutdown()
    results = [torch.load(tmp_path / f"result_g{g}.pt", weights_only=False) for g in range(2)]
    ref_losses, ref_state = reference_fit(lambda: make_mlp(optimizer), regression_dataset(), MICRO * 4, STEPS)
    ranks = [r for res in results for r in res]
    losses = [sum(r["losses"][i] for r in ranks) / len(ranks) for i in range(STEPS)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for r in ranks:
        assert_params_close(r["state"], ref_state)
        s = r["summary"]
        assert s["ft_steps_committed"] == STEPS and s["ft_steps_skipped"] == 0, s
        assert s["ft_live_replicas"] == 2 and s["ft_manager_step"] == STEPS, s
