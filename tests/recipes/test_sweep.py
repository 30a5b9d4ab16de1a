"""A two-job Hydra multirun on CPU: each job is its own world, both summaries and the sweep report are written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from lightning_par.sweep import write_sweep_report
from tests.support.forked_run import run_forked

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_two_job_multirun_writes_summaries_and_report(tmp_path):
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "recipes/train.py", "-m", "parallel=dp1,dp2", "model=tiny", "data=synthetic",
           "trainer=smoke", f"hydra.sweep.dir={sweep}"]
    proc = run_forked(cmd, ROOT, timeout=300)
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


def test_job_directory_names_are_bounded_and_flat():
    """A job's directory name is one path component of at most 96 characters, unique by job number: a swept
    ``data.path`` no longer nests directories, 13 long overrides no longer exceed the 255-byte limit."""
    from lightning_par.config.run_id import JOB_DIR_MAX, job_dir_name

    long = ",".join(f"+model.extra_option_{i}=/data/corpora/shard_{i:04d}/text.txt" for i in range(13))
    names = [job_dir_name(n, long) for n in range(3)]
    assert len(long) > 255 and all(len(x) <= JOB_DIR_MAX and "/" not in x for x in names), names
    assert len(set(names)) == 3 and names[1].startswith("1_+model.extra_option_0=_data_corpora")
    assert job_dir_name(0, "data.path=/a/b.txt,model=tiny") == "0_data.path=_a_b.txt,model=tiny"
    assert job_dir_name(7, "") == "7"


@pytest.mark.slow
def test_sweep_over_data_paths_with_many_overrides_reports_every_job(tmp_path):
    """The issue's sweep: data.path swept over files in nested directories, with 13 overrides in all: each job writes
    its summary.json into its own (flat, bounded) directory and the report lists both."""
    corpora = []
    for i in range(2):
        path = tmp_path / "corpora" / f"set_{i}" / "text.txt"
        path.parent.mkdir(parents=True)
        path.write_text("lorem ipsum dolor sit amet " * 3000)
        corpora.append(str(path))
    sweep = tmp_path / "sweep"
    overrides = ["parallel=dp1", "model=tiny", "data=stdlib", "trainer=smoke", "trainer.max_steps=2",
                 "trainer.log_every_n_steps=1", "trainer.val_check_interval=1000", "trainer.checkpoint=false",
                 "data.batch_size=4", "data.val_batches=1", "seed=7", "model.learning_rate=0.002"]
    cmd = [sys.executable, "recipes/train.py", "-m", f"data.path={','.join(corpora)}", *overrides,
           f"hydra.sweep.dir={sweep}"]
    proc = run_forked(cmd, ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert len(jobs) == 2 and all((j / "summary.json").is_file() for j in jobs), [str(j) for j in sweep.rglob("*")][:20]
    assert all(len(j.name) <= 96 for j in jobs), jobs
    assert "No job wrote a summary.json" not in (sweep / "report.md").read_text()
