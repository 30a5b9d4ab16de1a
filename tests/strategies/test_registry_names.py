"""`Trainer(strategy="<name>", accelerator="cpu", devices=2)` in a user's script: Lightning's own launcher starts the
second process (it re-runs the script in a fresh interpreter), and each registered name trains and validates. The
script's first process is a child forked from an interpreter with the imports done (tests/support/forked_run.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.forked_run import run_forked
from tests.support.helpers import ci_params

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).with_name("registry_user_script.py")
CRASH = Path(__file__).with_name("crash_user_script.py")


@pytest.mark.e2e
@pytest.mark.parametrize("name", ci_params(
    ["ddp_overlap", "zero1", "zero2", "zero3", "tensor_parallel", "gpipe", "1f1b", "parallel_3d"],
    ci=["ddp_overlap", "zero3", "tensor_parallel", "1f1b", "parallel_3d"],  # one per strategy family in CI
))
def test_registry_name_trains_under_lightnings_launcher(name, tmp_path):
    proc = run_forked([sys.executable, str(SCRIPT), name], tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("DONE"))
    val_loss = float(line.split()[-1])
    assert 0.0 < val_loss < 5.55  # below the uniform byte entropy after 5 steps on the learnable synthetic stream


@pytest.mark.e2e
@pytest.mark.parametrize("name", ci_params(["ddp_overlap", "zero2", "tensor_parallel"], ci=["ddp_overlap"]))
def test_a_rank_that_raises_ends_the_job_with_a_non_zero_exit(name, tmp_path):
    """No hang: the peers see the closed connection, and nothing waits for the failed rank at exit."""
    proc = run_forked([sys.executable, str(CRASH), name], tmp_path, timeout=120)
    assert proc.returncode != 0
    assert "rank 1 fails on purpose" in proc.stdout + proc.stderr
