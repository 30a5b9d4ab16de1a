"""The fault-tolerant recipe (recipes/train_ft.py, lightning_par.train_ft) end to end: the launcher starts the torchft
lighthouse and 2 replica groups x 1 rank of ``model=tiny``; both groups commit every step with 2 live groups and end
with the same weights. Checkpoints under fault tolerance (DCP per group) resume with the lighthouse (same layout) and
without it (fault tolerance off, one group), with the same losses as an uninterrupted run."""

from __future__ import annotations

import csv
import re
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir

from lightning_par.config.schema import register_configs
from lightning_par.train import launch_job
from lightning_par.train_ft import launch_ft_job
from tests.support.recipe_run import ROOT, run, tail
from tests.fault.test_faults import _checkpoint_weights, _losses

pytest.importorskip("torchft")  # in the dev extra: CI runs these
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
register_configs()

STEPS = 6
#: model=tiny, 6 steps, a checkpoint every 3, a loss logged every step, no validation, 1 rank per group.
TINY = ["model=tiny", "data=synthetic", "trainer=smoke", "parallel=dp1", "logger=csv", "trainer.checkpoint=true",
        "trainer.checkpoint_every_n_steps=3", "trainer.log_every_n_steps=1", "trainer.val_check_interval=1000",
        "trainer.job_timeout_s=240", f"trainer.max_steps={STEPS}"]
FT = ["strategy.fault_tolerance.enabled=true", "strategy.fault_tolerance.num_replica_groups=2",
      "strategy.fault_tolerance.min_replicas=2"]


def _cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def _ft(run_dir: Path, *overrides: str) -> dict:
    args = [*TINY, *overrides]
    return launch_ft_job(_cfg(*args), args, run_dir, timeout_s=300)


def _by_step(run_dir: Path) -> list[float]:
    """The train loss of each step 0..STEPS-1 (the last attempt's where a step was logged twice)."""
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(STEPS)), losses
    return [losses[s][-1] for s in range(STEPS)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The recipe's own command: 2 groups x 1 rank, 6 steps, run as a user runs it."""
    run_dir = tmp_path_factory.mktemp("ft") / "run"
    proc = run([sys.executable, str(ROOT / "recipes" / "train_ft.py"), *TINY, *FT, f"hydra.run.dir={run_dir}"],
               ROOT, timeout=400)
    assert proc.returncode == 0, tail(proc)
    return run_dir


def test_train_ft_starts_the_lighthouse_and_two_groups(uninterrupted: Path) -> None:
    summary = json.loads((uninterrupted / "summary.json").read_text())
    assert summary["num_replica_groups"] == 2 and len(summary["groups"]) == 2
    for g, s in enumerate(summary["groups"]):
        assert s["ft_replica_group_id"] == g, s
        assert s["steps"] == STEPS and s["ft_steps_committed"] == STEPS and s["ft_steps_skipped"] == 0, s
        assert s["ft_live_replicas"] == 2 and s["ft_manager_step"] == STEPS, s
        assert s["ft_batches_committed"] == 2 * STEPS, s
    # each group read its own share of the data, and the gradients were averaged across groups: different losses,
    # the same weights
    a, b = (_by_step(uninterrupted / f"group{g}") for g in range(2))
    assert a != b
    wa, wb = (_checkpoint_weights(uninterrupted / f"group{g}" / "checkpoints" / "last.ckpt") for g in range(2))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=0, msg=k)


def test_train_ft_refuses_what_it_cannot_run(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"strategy.fault_tolerance.enabled=false"):
        launch_ft_job(_cfg(*TINY), TINY, tmp_path)
    with pytest.raises(ValueError, match=r"strategy.fault_tolerance.lighthouse='http://localhost:1'.*starts its own"):
        launch_ft_job(_cfg(*TINY, *FT, "strategy.fault_tolerance.lighthouse=http://localhost:1"), TINY, tmp_path)
    assert not list(tmp_path.iterdir())  # nothing started


def test_checkpoint_under_ft_resumes_with_the_lighthouse(uninterrupted: Path, tmp_path: Path) -> None:
    """Stopped after step 3 (its checkpoint step-3, per group), then the same job again: each group resumes from its
    own checkpoint and continues with the uninterrupted run's losses."""
    first = _ft(tmp_path, *FT, "trainer.max_steps=3")
    assert [s["steps"] for s in first["groups"]] == [3, 3]
    resumed = _ft(tmp_path, *FT)
    for g, s in enumerate(resumed["groups"]):
        assert Path(s["resumed_from"]).name == "step-3.ckpt", s
        assert s["ft_steps_committed"] == STEPS - 3 and s["ft_live_replicas"] == 2, s
        resumed_steps = {int(r["step"]) for r in csv.DictReader((tmp_path / f"group{g}/logs/metrics.csv").open())
                         if r.get("train_loss")}
        assert resumed_steps == {3, 4, 5}, resumed_steps  # the second attempt trained the last 3 steps only
        torch.testing.assert_close(torch.tensor(_by_step(tmp_path / f"group{g}")),
                                   torch.tensor(_by_step(uninterrupted / f"group{g}")), rtol=1e-5, atol=1e-6)


def test_a_group_of_two_resumed_alone_mid_epoch_is_refused(uninterrupted: Path) -> None:
    """Group 0's checkpoint of the 2-group run, mid-epoch, resumed without fault tolerance: alone it would read other
    samples (its position counts 2 data-parallel ranks), so the resume is refused before any process starts."""
    with pytest.raises(ValueError, match=r"data-parallel replicas \(dp_size\): 2 -> 1 \(the checkpoint is 6 batches "
                                         r"into an epoch"):
        launch_job(_cfg(*TINY, "trainer.max_steps=9"), uninterrupted / "group0")


def test_checkpoint_under_ft_resumes_without_the_lighthouse(tmp_path: Path) -> None:
    """One replica group under fault tolerance, stopped after step 3; its checkpoint resumed with fault tolerance off
    (plain recipe, no lighthouse) continues with the losses of an uninterrupted run without fault tolerance."""
    one = ["strategy.fault_tolerance.enabled=true", "strategy.fault_tolerance.num_replica_groups=1"]
    first = _ft(tmp_path, *one, "trainer.max_steps=3")
    assert first["groups"][0]["ft_steps_committed"] == 3
    resumed = launch_job(_cfg(*TINY), tmp_path / "group0")
    assert resumed is not None and Path(resumed["resumed_from"]).name == "step-3.ckpt"
    assert "ft_live_replicas" not in resumed
    reference = launch_job(_cfg(*TINY), tmp_path / "plain")
    torch.testing.assert_close(torch.tensor(_by_step(tmp_path / "group0")), torch.tensor(_by_step(tmp_path / "plain")),
                               rtol=1e-5, atol=1e-6)
    assert reference is not None and reference["steps"] == STEPS


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _train_ft_until_both_groups_train(tmp_path: Path, *overrides: str, **popen: Any) -> Any:
    """``recipes/train_ft.py`` on the tiny model for 1,000 steps (with ``overrides``), started and returned once both
    replica groups have logged a step (killed if it ends or stalls first, within 240 s)."""
    import os
    import subprocess
    import time

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(ROOT / "recipes" / "train_ft.py"), *TINY, *FT,
                             "trainer.max_steps=1000", *overrides, f"hydra.run.dir={tmp_path}"], cwd=ROOT, env=env,
                            **popen)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not all(
                (tmp_path / f"group{g}" / "logs" / "metrics.csv").exists() for g in range(2)):
            assert proc.poll() is None, "train_ft ended early"
            time.sleep(0.5)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc


def test_nothing_outlives_a_killed_train_ft(tmp_path: Path) -> None:
    """SIGKILL of the launcher (no clean-up can run): the lighthouse, both groups' launchers and their ranks die."""
    import subprocess

    from tests.fault.test_faults import _assert_all_gone

    proc = _train_ft_until_both_groups_train(tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # the lighthouse, 2 group launchers and their 2 ranks
        pids = _descendants(proc.pid)
        assert len(pids) >= 5, pids
    finally:
        proc.kill()
        proc.wait()
    try:
        _assert_all_gone(pids, within_s=30.0)
    except AssertionError as err:
        cmdlines = {p: Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:300] for p in pids
                    if Path(f"/proc/{p}/cmdline").exists()}
        raise AssertionError(f"{err}; {cmdlines}") from None


def test_the_servers_listen_on_loopback_and_a_dead_lighthouse_is_named(tmp_path: Path) -> None:
    """Issue 50. While both groups train, every TCP socket listening in the job's processes (the lighthouse, each
    group's rendezvous store, torchft manager and checkpoint servers, gloo) is bound to loopback (read from /proc: no
    traffic leaves the machine's loopback); then SIGKILL of the lighthouse: the launcher names its death within
    ``connect_timeout_s + 10 s`` and stops every group."""
    import os
    import signal
    import subprocess
    import time

    from tests.fault.test_faults import _assert_all_gone
    from tests.fault_tolerance.test_ft_servers_bind import _is_loopback, _listening

    connect_s = 5.0
    proc = _train_ft_until_both_groups_train(tmp_path, f"strategy.fault_tolerance.connect_timeout_s={connect_s}",
                                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        pids = _descendants(proc.pid)
        listening = {}
        for pid in [proc.pid, *pids]:
            try:
                listening[pid] = _listening(pid)
            except OSError:  # a process that ended meanwhile
                continue
        lighthouses = [p for p in pids if b"torchft_lighthouse" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(lighthouses) == 1, pids
        assert listening[lighthouses[0]], listening  # the lighthouse listens, and so do the groups' servers
        assert sum(len(v) for v in listening.values()) >= 5, listening
        assert all(_is_loopback(a) for v in listening.values() for a, _ in v), listening
        t0 = time.monotonic()
        os.kill(lighthouses[0], signal.SIGKILL)
        out, _ = proc.communicate(timeout=connect_s + 10)
        named_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert re.search(r"train_ft: the lighthouse \(http://127\.0\.0\.1:\d+, pid \d+\) died \(killed by SIGKILL\) while "
                     r"the replica groups ran", out), out[-3000:]
    assert named_s < connect_s + 10, named_s
    _assert_all_gone(pids, within_s=30.0)


def test_a_bad_bind_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"strategy.fault_tolerance.bind='anywhere' is not valid: expected 'auto'"):
        launch_ft_job(_cfg(*TINY, *FT, "strategy.fault_tolerance.bind=anywhere"), TINY, tmp_path)
    assert not list(tmp_path.iterdir())
