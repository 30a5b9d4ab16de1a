"""Under torchrun nothing outlives its job: the agent killed (SIGKILL) or ended by SIGUSR1 (its default action) takes
its workers with it, after they saved a checkpoint where the preemption signal allows; ``--signals-to-handle`` with
SIGUSR1 forwards the preemption signal; a second job in the same run directory is refused at once, naming the first.

Every test kills what it started (the process group of torchrun) in a ``finally``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from lightning_par.fault.heartbeat import read_beats
from lightning_par.fault.process import process_state
from tests.fault.test_preemption import SLOW_STEPS, torchrun_cmd

pytestmark = [pytest.mark.e2e, pytest.mark.distributed, pytest.mark.timeout(300)]

#: Long enough that the job never ends by itself during the test; only the preemption saves.
RUN = (*SLOW_STEPS, "trainer.max_steps=400", "trainer.checkpoint_every_n_steps=1000", "trainer.preemption_grace_s=8")


def _alive(pid: int) -> bool:
    state = process_state(pid)
    return state is not None and not state.startswith("a zombie") and state != "dead"


def _start(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    """torchrun in a session of its own, its output read all along (a full pipe would block the workers' exit)."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    proc.lines = []  # type: ignore[attr-defined]
    proc.reader = threading.Thread(target=lambda: proc.lines.extend(proc.stdout), daemon=True)  # type: ignore[attr-defined]
    proc.reader.start()  # type: ignore[attr-defined]
    return proc


def _workers_at_step(beat_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 200) -> list[int]:
    """The pids of both workers once each reached ``step`` (their heartbeats)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        beats = read_beats(beat_dir)
        if len(beats) == 2 and all(b.step >= step for b in beats.values()):
            return [beats[0].pid, beats[1].pid]
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"the workers did not reach step {step}: {''.join(proc.lines)[-3000:]}")


def _end(proc: subprocess.Popen, pids: list[int] = ()) -> str:
    """Kill what is left (torchrun's session, and the workers by pid), return the output."""
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    proc.reader.join(timeout=30)
    return "".join(proc.lines)


def _wait_gone(pids: list[int], timeout: float) -> float:
    start = time.monotonic()
    while any(_alive(p) for p in pids) and time.monotonic() - start < timeout:
        time.sleep(0.05)
    return time.monotonic() - start


@pytest.mark.parametrize("case", ["SIGKILL:null", pytest.param("SIGKILL:SIGTERM", marks=pytest.mark.slow),
                                  pytest.param("SIGUSR1:SIGUSR1", marks=pytest.mark.slow)])
def test_torchrun_agent_gone_leaves_no_worker(tmp_path, case):
    """torchrun's agent killed by ``sig``: both workers are gone within 10 s (they were left training with ppid 1).
    With a preemption signal, its arrival through PR_SET_PDEATHSIG makes them save the step's checkpoint first (its
    commit record written) and exit; with preemption off, they are killed at once."""
    sig, preemption = case.split(":")
    run_dir = tmp_path / "run"
    cmd, env = torchrun_cmd(run_dir, *RUN, f"trainer.preemption_signal={preemption}")
    proc = _start(cmd, env, tmp_path)
    pids: list[int] = []
    try:
        pids = _workers_at_step(run_dir / ".heartbeat", 2, proc)
        os.kill(proc.pid, getattr(signal, sig))
        took = _wait_gone(pids, 10.0)
        alive = [p for p in pids if _alive(p)]
        assert not alive, f"workers {alive} outlived torchrun's agent by {took:.1f} s"
        saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*.ckpt"))
        if preemption == "null":
            assert saved == [], saved
        else:
            assert len(saved) == 1, saved  # the preemption's own checkpoint, complete
            from lightning_par.fault.resume import latest_checkpoint

            assert latest_checkpoint(run_dir / "checkpoints", on_skip=None) is not None
        print(f"{case}: workers gone {took:.2f} s after the agent's {sig}; checkpoints {saved}")
    finally:
        out = _end(proc, pids)
    if preemption != "null":
        assert "is gone: stopping as if preempted" in out, out[-3000:]


@pytest.mark.slow
def test_torchrun_forwards_sigusr1_with_signals_to_handle(tmp_path):
    """``torchrun --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1``: SIGUSR1 to the agent is forwarded to
    both workers, which save the same step and exit with 75 (the agent exits non-zero itself)."""
    run_dir = tmp_path / "run"
    cmd, env = torchrun_cmd(run_dir, *RUN, "trainer.preemption_signal=SIGUSR1")
    cmd.insert(cmd.index("--standalone"), "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    proc = _start(cmd, env, tmp_path)
    pids: list[int] = []
    try:
        pids = _workers_at_step(run_dir / ".heartbeat", 2, proc)
        os.kill(proc.pid, signal.SIGUSR1)
        proc.wait(timeout=60)
    finally:
        out = _end(proc, pids)
    reports = dict(re.findall(r"lightning_par: rank (\d): preempted by SIGUSR1 at step (\d+)", out))
    assert sorted(reports) == ["0", "1"] and len(set(reports.values())) == 1, out[-3000:]
    assert (run_dir / "checkpoints" / f"step-{reports['0']}.ckpt").exists()


def test_two_torchrun_jobs_in_one_run_directory(tmp_path):
    """A second torchrun job given the run directory of a running one is refused at once, naming the first's pid,
    host and start time; the first keeps training undisturbed (its lock record unchanged)."""
    run_dir = tmp_path / "run"
    cmd, env = torchrun_cmd(run_dir, *RUN, "trainer.preemption_signal=null")
    first = _start(cmd, env, tmp_path)
    pids: list[int] = []
    try:
        pids = _workers_at_step(run_dir / ".heartbeat", 1, first)
        record = json.loads((run_dir / ".lock").read_text())
        assert record["pid"] == pids[0] or record["pid"] in pids, record
        second = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
        out = second.stdout + second.stderr
        assert second.returncode != 0
        assert f"is in use by another job (pid {record['pid']} on {record['host']} started {record['started']}" in out, \
            out[-3000:]
        assert json.loads((run_dir / ".lock").read_text()) == record
        assert first.poll() is None and all(_alive(p) for p in pids)
    finally:
        _end(first, pids)


def test_preempted_without_a_checkpoint_is_not_status_75(tmp_path):
    """trainer.checkpoint=false: SIGTERM to the launcher stops the job at the next step boundary, but with nothing to
    resume from the status is 143 (128 + SIGTERM), not 75, which would make a scheduler restart it from step 0
    forever; the message says why."""
    from lightning_par.fault.preemption import Preempted
    from lightning_par.train import launch_job
    from tests.fault.test_faults import _cfg
    from tests.fault.test_preemption import signal_at_step

    run_dir = tmp_path / "run"
    sent = signal_at_step(run_dir / ".heartbeat", 2, "launcher", launcher_pid=os.getpid())
    with pytest.raises(Preempted) as info:
        launch_job(_cfg(*RUN, "trainer.checkpoint=false", "trainer.preemption_grace_s=30"), run_dir)
    assert sent.get("at") is not None
    assert info.value.code == 143 and not info.value.resumable, (info.value.code, str(info.value))
    assert "no checkpoint to resume from" in str(info.value) and "exit code 143" in str(info.value), str(info.value)
    assert not (run_dir / "checkpoints").exists() or not list((run_dir / "checkpoints").glob("step-*"))
