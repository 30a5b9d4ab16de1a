"""Fault injection, bounded and on CPU: a rank killed (SIGKILL) or stopped (SIGSTOP), the launcher killed,
a NaN, a run killed and resumed (the same losses step by step as an uninterrupted run, under our launcher and under
``torchrun --max-restarts``), and two jobs started in the same second. Every test has an outer timeout."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lightning_par.config.schema import register_configs
from lightning_par.fault.heartbeat import beat, read_beats
from lightning_par.fault.process import process_state
from lightning_par.fault.resume import checkpoint_step, is_complete_checkpoint, latest_checkpoint
from lightning_par.launcher import DistributedRunError, init_process_group_from_env, run_distributed
from lightning_par.train import launch_job
from tests.support.forked_run import start_forked

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
VICTIM = Path(__file__).with_name("launcher_victim_script.py")
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
register_configs()

#: A few tiny steps, a checkpoint every 2, a loss logged every step, no validation.
TINY = ["model=tiny", "data=synthetic", "trainer=smoke", "trainer.checkpoint=true", "trainer.checkpoint_every_n_steps=2",
        "trainer.log_every_n_steps=1", "trainer.val_check_interval=1000", "trainer.job_timeout_s=240"]


def _cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="config", overrides=TINY + list(overrides))


def _gone(pid: int) -> bool:
    state = process_state(pid)
    return state is None or state.startswith("a zombie") or state == "dead"


def _assert_all_gone(pids: list[int], within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.1)
    left = [(p, process_state(p)) for p in pids if not _gone(p)]
    assert not left, f"processes left running: {left}"


def _losses(run_dir: Path) -> dict[int, list[float]]:
    """Every logged train_loss by step, over all attempts (metrics-<k>.csv, then metrics.csv)."""
    out: dict[int, list[float]] = {}
    for path in sorted((run_dir / "logs").glob("metrics*.csv")):
        for row in csv.DictReader(path.open()):
            if row.get("train_loss"):
                out.setdefault(int(row["step"]), []).append(float(row["train_loss"]))
    return out


def _checkpoint_weights(path: Path) -> dict[str, torch.Tensor]:
    """The model weights of a checkpoint: a file (``torch.save``) or a sharded directory, read in this process."""
    if path.is_file():
        return torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    from lightning_par.checkpoint import load_model_weights
    from lightning_par.config.build import build_module

    module = build_module(_cfg())
    load_model_weights(path, module)
    return dict(module.state_dict())


# --------------------------------------------------------------------------------------------- launcher-level faults
def _collective_loop(fault: str) -> None:
    init_process_group_from_env(timeout_s=60)
    for i in range(3000):
        beat(i, "loop")
        dist.all_reduce(torch.ones(1))
        if i == 5 and dist.get_rank() == 1:
            os.kill(os.getpid(), getattr(signal, fault))
        time.sleep(0.01)


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_a_killed_rank_is_named_with_its_signal(tmp_path, sig):
    """SIGTERM too: a rank does not inherit the launcher's handler (it said "the launcher received SIGTERM")."""
    started = time.monotonic()
    with pytest.raises(DistributedRunError) as info:
        run_distributed(_collective_loop, 2, (sig,), timeout_s=60, heartbeat_dir=tmp_path)
    message = str(info.value)
    assert message.startswith("rank 1 (pid "), message
    assert f"was killed by signal {sig} ({getattr(signal, sig).value}" in message.splitlines()[0], message
    assert "rank 0 raised" in message and "a consequence" in message  # the peer's "connection closed", second
    assert time.monotonic() - started < 30
    _assert_all_gone([b.pid for b in read_beats(tmp_path).values()])


def test_a_stopped_rank_is_ended_by_the_watchdog_and_named(tmp_path):
    started = time.monotonic()
    with pytest.raises(DistributedRunError) as info:
        run_distributed(_collective_loop, 2, ("SIGSTOP",), timeout_s=120, watchdog_s=2, startup_grace_s=30,
                        heartbeat_dir=tmp_path)
    first = str(info.value).splitlines()[0]
    assert first.startswith("watchdog: rank 1 (pid ") and "its process is stopped (SIGSTOP" in first, first
    assert "last heartbeat at step 5" in first
    assert time.monotonic() - started < 30  # not the 60 s collective timeout, let alone 30 min
    _assert_all_gone([b.pid for b in read_beats(tmp_path).values()])


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_killing_the_launcher_leaves_no_rank(tmp_path, sig):
    """SIGKILL: no clean-up can run in the launcher, the kernel ends the ranks (PR_SET_PDEATHSIG). SIGTERM: the
    launcher stops its ranks, then exits non-zero saying why."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    launcher = subprocess.Popen([sys.executable, str(VICTIM), str(tmp_path)], env=env, cwd=tmp_path,
                                stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(read_beats(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [b.pid for b in read_beats(tmp_path).values()]
        assert len(pids) == 2 and all(not _gone(p) for p in pids)
        launcher.send_signal(getattr(signal, sig))
        _, err = launcher.communicate(timeout=30)
        _assert_all_gone(pids)
        assert launcher.returncode != 0
        if sig == "SIGTERM":
            assert "the launcher received SIGTERM: every rank was stopped" in err, err[-2000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()


# --------------------------------------------------------------------------------------------- the recipe
def test_a_nan_stops_the_recipe_and_the_last_good_checkpoint_stays(tmp_path):
    """model.learning_rate=1e6: non-finite from the second step. The job fails naming the step; every checkpoint on
    disk is finite and the newest was written before the non-finite step."""
    run_dir = tmp_path / "run"
    with pytest.raises(DistributedRunError) as info:
        launch_job(_cfg("model.learning_rate=1e6", "trainer.checkpoint_every_n_steps=1", "trainer.max_steps=8"), run_dir)
    message = str(info.value)
    assert "NonFiniteError: Non-finite" in message and "at step 1" in message, message[-2000:]
    assert "rank 0" in message and "rank 1" in message
    ckpts = sorted((run_dir / "checkpoints").glob("step-*.ckpt"))
    assert [p.name for p in ckpts] == ["step-1.ckpt"]  # saved after step 0; nothing after the non-finite step 1
    assert os.readlink(run_dir / "checkpoints" / "last.ckpt") == "step-1.ckpt"
    assert all(torch.isfinite(t).all() for t in _checkpoint_weights(ckpts[0]).values())
    assert not (run_dir / "summary.json").exists()


def test_a_run_that_trains_no_step_fails_instead_of_exiting_0(tmp_path):
    """A data module whose training set gives no batch (Lightning only warns and skips training): the job fails on
    every rank saying it trained 0 steps and why, and writes no summary that a sweep would score."""
    run_dir = tmp_path / "run"
    with pytest.raises(DistributedRunError) as info:
        launch_job(_cfg("data=custom", "data._target_=tests.fault.fault_models.EmptyTrainData", "trainer.checkpoint=false"),
                   run_dir)
    message = str(info.value)
    assert "NoTrainingStepError: the run trained 0 optimizer steps (step 0, max_steps=6)" in message, message[-2000:]
    assert "rank 0 had 0 training batches" in message and "rank 1 had 0 training batches" in message, message[-2000:]
    assert not (run_dir / "summary.json").exists()


def test_a_stopped_rank_ends_the_recipe_in_seconds(tmp_path):
    run_dir = tmp_path / "run"
    stopped: dict[str, int] = {}

    def stop_rank1() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            b = read_beats(run_dir / ".heartbeat").get(1)
            if b is not None and b.warm and b.step >= 2:
                os.kill(b.pid, signal.SIGSTOP)
                stopped["pid"] = b.pid
                return
            time.sleep(0.01)

    watcher = threading.Thread(target=stop_rank1, daemon=True)
    watcher.start()
    with pytest.raises(DistributedRunError) as info:
        launch_job(_cfg("trainer.max_steps=2000", "trainer.watchdog_s=3", "trainer.watchdog_startup_s=120"), run_dir)
    first = str(info.value).splitlines()[0]
    assert first.startswith(f"watchdog: rank 1 (pid {stopped['pid']})") and "stopped (SIGSTOP" in first, first
    _assert_all_gone([b.pid for b in read_beats(run_dir / ".heartbeat").values()])


SLEEPY = ["model=custom", "model._target_=tests.fault.fault_models.SleepyGPT", "+model.sleep_step=3"]


@pytest.mark.parametrize("sleeper", [0, 1])
def test_a_rank_stuck_in_its_forward_is_named_not_the_peer_waiting_for_it(tmp_path, sleeper):
    """The sleeping rank is named, with its phase and line; the peer is named as waiting in a collective.
    Before, the oldest heartbeat won (throttled writes): rank 0 was named whichever rank slept."""
    with pytest.raises(DistributedRunError) as info:
        launch_job(_cfg(*SLEEPY, f"+model.sleep_rank={sleeper}", "trainer.max_steps=50", "trainer.watchdog_s=3",
                        "trainer.watchdog_startup_s=120"), tmp_path / "run")
    lines = str(info.value).splitlines()
    assert lines[0].startswith(f"watchdog: rank {sleeper} (pid "), lines
    assert "last heartbeat at step 3, forward, at training_step (fault_models.py:" in lines[0], lines[0]
    assert "time.sleep(self.sleep_s)" in lines[0]
    # the peer waits in the first collective after its own forward part: the token count of the label mask's
    # weighting (forward) or the gradient all-reduce (backward)
    assert lines[1].startswith(f"Also idle: rank {1 - sleeper} ") and "step 3, " in lines[1], lines[1]
    assert "waiting in collective" in lines[1], lines[1]


def _resumable_at_freeze(run_dir: Path, step: int, before: int | None) -> bool:
    """With every rank stopped: the checkpoint a restart resumes from (the latest complete one,
    :func:`~lightning_par.fault.resume.latest_checkpoint`) is of a step ``>= step`` (``< before``), no newer one is half
    written, and every step before it has its loss in the log, so that the resumed run logs every step. (Seen under
    load, checking only before the freeze: the run went on to save ``step-4`` between the check and the freeze, the
    loss of step 3 not yet in the log; the restart resumed at step 4 and step 3 was never logged.)"""
    latest = latest_checkpoint(run_dir / "checkpoints", on_skip=None)
    if latest is None:
        return False
    at = checkpoint_step(latest)[0]
    if at < step or (before is not None and at >= before):
        return False
    for path in (run_dir / "checkpoints").iterdir():  # `step-<N>.ckpt`, or a temporary name of one being written
        match = re.match(r"step-(\d+)", path.name)
        if match and int(match.group(1)) > at:
            return False  # a newer checkpoint, not complete yet: the frozen run is writing it
    losses = _losses(run_dir)
    return all(k in losses for k in range(at))


def _kill_rank_after(run_dir: Path, step: int, victim: int, killed: dict[str, Any],
                     before: int | None = None) -> threading.Thread:
    """In the background: once a checkpoint ``step-<s>.ckpt`` with ``step <= s`` (``< before`` if given) is complete
    and the loss of step ``s`` is in the log, freeze every rank, and if what is on disk then is what a restart resumes
    from (:func:`_resumable_at_freeze`), SIGKILL ``victim`` and thaw the rest; else thaw them all and wait again: the
    run is interrupted between two checkpoints however loaded the machine is. (Lightning saves a step's checkpoint
    before it logs that step's loss: a kill in between loses the log line, not the step, which the resumed run then
    redoes from the checkpoint before.) Any such checkpoint will do, not only ``step``'s: the logger writes its lines in
    batches, and on an idle machine a step's line can come after the checkpoint callback has already removed that
    step's checkpoint (kept: the last two), so waiting for one step alone could let the run end untouched."""

    def ready() -> bool:
        losses = None
        for ckpt in sorted((run_dir / "checkpoints").glob("step-*.ckpt")):
            match = re.fullmatch(r"step-(\d+)\.ckpt", ckpt.name)
            s = int(match.group(1)) if match else -1
            if s < step or (before is not None and s >= before) or not is_complete_checkpoint(ckpt):
                continue
            losses = _losses(run_dir) if losses is None else losses
            if s in losses:
                return True
        return False

    def run() -> None:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if not ready():
                time.sleep(0.005)
                continue
            pids = {r: b.pid for r, b in read_beats(run_dir / ".heartbeat").items()}
            for pid in pids.values():
                os.kill(pid, signal.SIGSTOP)
            if not _resumable_at_freeze(run_dir, step, before):
                for pid in pids.values():
                    os.kill(pid, signal.SIGCONT)
                time.sleep(0.05)
                continue
            os.kill(pids[victim], signal.SIGKILL)
            for r, pid in pids.items():
                if r != victim:
                    os.kill(pid, signal.SIGCONT)
            killed["pid"] = pids[victim]
            return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _assert_same_losses(reference: dict[int, list[float]], resumed: dict[int, list[float]], steps: int) -> float:
    assert sorted(reference) == list(range(steps)) and sorted(resumed) == list(range(steps))
    worst = 0.0
    for step in range(steps):
        for value in resumed[step]:  # steps logged twice (before the kill, and again after the resume) both count
            worst = max(worst, abs(value - reference[step][0]))
    assert worst <= 1e-6, {s: (reference[s], resumed[s]) for s in range(steps)}
    return worst


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """``uninterrupted(*overrides)``: the run directory of an uninterrupted run of ``_cfg(*overrides)``, checked to
    have run ``trainer.max_steps`` steps. Tests whose overrides compose the same config (the whole composed config
    compared) share one run: the kill-and-resume test under ``ddp_overlap``, the default strategy, and the torchrun
    restart test each launched the same 10-step run before."""
    runs: dict[str, Path] = {}

    def run(*overrides: str) -> Path:
        cfg = _cfg(*overrides)
        key = OmegaConf.to_yaml(cfg)
        if key not in runs:
            run_dir = tmp_path_factory.mktemp("uninterrupted") / "reference"
            summary = launch_job(cfg, run_dir)
            assert summary is not None and summary["steps"] == cfg.trainer.max_steps
            runs[key] = run_dir
        return runs[key]

    return run


@pytest.mark.parametrize("strategy", ["ddp_overlap", "zero2"])
def test_a_run_killed_and_resumed_matches_the_uninterrupted_run(tmp_path, strategy, uninterrupted):
    steps = 10
    overrides = (f"strategy={strategy}", f"trainer.max_steps={steps}")
    reference = uninterrupted(*overrides)  # its summary checked: `steps` steps

    run_dir = tmp_path / "run"
    killed: dict[str, Any] = {}
    watcher = _kill_rank_after(run_dir, 2, victim=1, killed=killed, before=steps)
    with pytest.raises(DistributedRunError) as info:
        launch_job(_cfg(*overrides), run_dir)
    watcher.join(timeout=5)
    assert str(info.value).startswith(f"rank 1 (pid {killed['pid']}) was killed by signal SIGKILL"), str(info.value)

    summary = launch_job(_cfg(*overrides), run_dir)  # ckpt_path null: the latest complete checkpoint of this run
    assert summary is not None and summary["steps"] == steps
    resumed_from = Path(summary["resumed_from"]).name
    assert resumed_from.startswith("step-") and 2 <= int(resumed_from[5:-5]) < steps, resumed_from
    worst = _assert_same_losses(_losses(reference), _losses(run_dir), steps)
    print(f"{strategy}: resumed from {resumed_from}; max |loss difference| over {steps} steps = {worst:.3g}")


def test_torchrun_max_restarts_resumes_from_the_latest_checkpoint(tmp_path, uninterrupted):
    """Restart-safety under ``torchrun --max-restarts 1``: a rank killed mid-run, the agent restarts the world, the
    recipe finds its run directory (outputs/torchrun-<rdzv id>) and resumes; the losses are the uninterrupted run's."""
    steps = 10
    overrides = TINY + [f"trainer.max_steps={steps}"]
    reference = uninterrupted(f"trainer.max_steps={steps}")  # its summary checked: `steps` steps
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
           "--monitor-interval", "0.5", str(ROOT / "recipes" / "train.py"), *overrides]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        run_dirs: list[Path] = []
        while not run_dirs and time.monotonic() < deadline:
            run_dirs = list((tmp_path / "outputs").glob("torchrun-*"))
            time.sleep(0.1)
        assert len(run_dirs) == 1, "every rank must use one run directory"
        killed: dict[str, Any] = {}
        _kill_rank_after(run_dirs[0], 2, victim=1, killed=killed).join(timeout=150)
        assert "pid" in killed
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-4000:]
    summary = json.loads((run_dirs[0] / "summary.json").read_text())
    assert summary["resumed_from"] is not None and summary["steps"] == steps
    _assert_same_losses(_losses(reference), _losses(run_dirs[0]), steps)


def test_two_jobs_started_in_the_same_second_write_to_their_own_directories(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "recipes" / "train.py"), "model=tiny", "data=synthetic", "trainer=smoke",
           "trainer.max_steps=2"]
    jobs = [start_forked(cmd, tmp_path, env, stderr_to_stdout=True) for _ in range(2)]  # two forked children
    outputs = [job.communicate(timeout=240)[0] for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], [o[-2000:] for o in outputs]
    run_dirs = sorted(p.parent for p in (tmp_path / "outputs").glob("*/*/summary.json"))
    assert len(run_dirs) == 2, run_dirs
    for run_dir in run_dirs:
        assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
        assert len(list((run_dir / "logs").glob("metrics*.csv"))) == 1  # nobody else's log in here
