"""`Trainer(strategy="<name>", accelerator="cpu", devices=2)` in a user's script: Lightning's own launcher starts the
second process (it re-runs the script), and each registered name trains and validates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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
    proc = subprocess.run([sys.executable, str(SCRIPT), name], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("DONE"))
    val_loss = float(line.split()[-1])
    assert 0.0 < val_loss < 5.55  # below the uniform byte entropy after 5 steps on the learnable synthetic stream


@pytest.mark.e2e
@pytest.mark.parametrize("name", ci_params(["ddp_overlap", "zero2", "tensor_parallel"], ci=["ddp_overlap"]))
def test_a_rank_that_raises_ends_the_job_with_a_non_zero_exit(name, tmp_path):
    """No hang: the peers see the closed connection, and nothing waits for the failed rank at exit."""
    proc = subprocess.run([sys.executable, str(CRASH), name], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "rank 1 fails on purpose" in proc.stdout + proc.stderr
