"""A two-job Hydra multirun on CPU: each job is its own world, both summaries and the sweep report are written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_par.sweep import write_sweep_report

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_two_job_multirun_writes_summaries_and_report(tmp_path):
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "recipes/train.py", "-m", "parallel=dp1,dp2", "model=tiny", "data=synthetic",
           "trainer=smoke", f"hydra.sweep.dir={sweep}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert len(jobs) == 2, jobs  # the children did not re-run the sweep
    worlds = sorted(json.loads((j / "summary.json").read_text())["world_size"] for j in jobs)
    assert worlds == [1, 2]
    assert proc.stdout.count("Launching 2 jobs locally") + proc.stderr.count("Launching 2 jobs locally") == 1
    report = (sweep / "report.md").read_text()
    assert "dp1·tp1·pp1" in report and "dp2·tp1·pp1" in report
    assert (sweep / "report.png").stat().st_size > 10_000


def test_report_of_an_empty_directory_says_so(tmp_path):
    md, png = write_sweep_report(tmp_path)
    assert png is None and "No job wrote a summary.json" in md.read_text()
