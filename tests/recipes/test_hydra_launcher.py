"""``hydra/launcher=lightning_par``: each sweep job runs once, as its own world, in a user's own Hydra app."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.support.recipe_run import run, tail

pytestmark = pytest.mark.e2e

APP = Path(__file__).with_name("user_hydra_app.py")
CONFIG = """\
strategy: ddp_overlap
devices: 1
steps: 4
fail_rank: -1
"""


def _user_app(tmp_path: Path) -> Path:
    """The user's app (``user_hydra_app.py``) and its config in ``tmp_path/app``."""
    app = tmp_path / "app"
    (app / "conf").mkdir(parents=True)
    shutil.copy(APP, app / "app.py")
    (app / "conf" / "config.yaml").write_text(CONFIG)
    return app


@pytest.mark.e2e
def test_user_app_sweep_runs_each_job_once_as_its_own_world(tmp_path):
    """Four jobs (world 1 and 2, with and without rank 1 raising): a child never re-runs the sweep, each rank runs the
    task once, and the failing job is reported while the others complete. The app's own ``strategy`` key stays a
    plain value (lightning_par's config groups are not put on its search path)."""
    app = _user_app(tmp_path)
    sweep = tmp_path / "sweep"
    proc = run([sys.executable, "app.py", "-m", "hydra/launcher=lightning_par", "hydra.launcher.nprocs=${devices}",
                "devices=1,2", "fail_rank=-1,1", "strategy=ddp_overlap", f"hydra.sweep.dir={sweep}"], app)
    assert proc.returncode != 0, tail(proc)  # Hydra re-raises the failed job's error after running every job
    out = proc.stdout + proc.stderr
    assert out.count("Launching 4 jobs locally") == 1, tail(proc)
    jobs = sorted((p for p in sweep.iterdir() if p.is_dir()), key=lambda p: int(p.name))
    assert [p.name for p in jobs] == ["0", "1", "2", "3"], tail(proc)
    expected = {"0": (1, False), "1": (1, False), "2": (2, False), "3": (2, True)}  # devices x fail_rank order
    for job in jobs:
        world, fails = expected[job.name]
        ranks = sorted(line.split()[:2] for line in (job / "ranks.txt").read_text().splitlines())
        assert ranks == [[str(r), str(world)] for r in range(world)], (job.name, ranks)
        if fails:
            assert not (job / "result.json").exists()
        else:
            assert json.loads((job / "result.json").read_text())["world_size"] == world
    assert "#3 failed" in out and "rank 1 fails on purpose" in out, tail(proc)
    assert "`Trainer.fit` stopped" in (sweep / "2" / "app.log").read_text()  # Lightning's log in the job's log file


@pytest.mark.e2e
def test_recipe_strategy_sweep_under_the_launcher_reports_the_zero_memory_effect(tmp_path):
    """The recipe under the launcher (world size from parallel.world_size); the report shows ZeRO-3's smaller model
    state per rank, labelled by strategy."""
    from tests.support.recipe_run import ROOT

    sweep = tmp_path / "sweep"
    proc = run([sys.executable, str(ROOT / "recipes" / "train.py"), "-m", "hydra/launcher=lightning_par",
                "strategy=ddp_overlap,zero2", "parallel=dp2", "model=tiny", "data=synthetic", "trainer=smoke",
                "logger=[csv]", f"hydra.sweep.dir={sweep}"], tmp_path)
    assert proc.returncode == 0, tail(proc)
    import csv

    rows = {r["strategy"]: r for r in csv.DictReader((sweep / "report.csv").open())}
    assert set(rows) == {"ddp_overlap", "zero2"}
    assert all(r["layout"] == "dp2·tp1·pp1" for r in rows.values())
    ddp, zero2 = rows["ddp_overlap"], rows["zero2"]
    assert float(zero2["grad_mib"]) == pytest.approx(float(ddp["grad_mib"]) / 2, rel=0.05)
    assert float(zero2["optimizer_state_mib"]) == pytest.approx(float(ddp["optimizer_state_mib"]) / 2, rel=0.05)
    assert float(zero2["state_mib"]) < float(ddp["state_mib"])
    assert (sweep / "report.png").stat().st_size > 10_000
    md = (sweep / "report.md").read_text()
    assert "| zero2 | dp2·tp1·pp1 |" in md


def test_nprocs_that_differs_from_the_trainers_devices_fails_at_once_naming_it(tmp_path):
    """``Trainer(devices=2)`` in a job of one process (``hydra.launcher.nprocs`` left at 1) used to wait for the
    missing rank until the job's timeout (an hour by default); every job now fails within seconds, naming the
    option and the value to set, and the sweep goes on to the next job."""
    app = _user_app(tmp_path)
    sweep = tmp_path / "sweep"
    proc = run([sys.executable, "app.py", "-m", "hydra/launcher=lightning_par", "hydra.launcher.timeout_s=120",
                "devices=2,1", "strategy=ddp", f"hydra.sweep.dir={sweep}"], app, timeout=100)
    assert proc.returncode != 0, tail(proc)
    out = proc.stdout + proc.stderr
    assert "hydra.launcher.nprocs=1 is not valid for this job" in out, tail(proc)
    assert "devices=2" in out and "hydra.launcher.nprocs=${devices}" in out, tail(proc)
    assert json.loads((sweep / "1" / "result.json").read_text())["world_size"] == 1  # the next job still ran
