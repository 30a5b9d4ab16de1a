"""Naming faults without processes: exit codes and signals, process states, stalled heartbeats, the launcher's
choice of cause, run ids, and the non-finite guard's options."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import threading
import time
import types

import pytest

from lightning_par.config.run_id import job_run_id
from lightning_par.fault.heartbeat import HeartbeatCallback, culprit_key, read_beats, stalled_ranks, write_beat
from lightning_par.fault.nonfinite import NonFiniteGuard
from lightning_par.fault.process import describe_exit, process_state
from lightning_par.fault.where import locate
from lightning_par.launcher import _describe_failure, _Outcome


def test_exit_codes_and_signals_are_named():
    assert describe_exit(None) == "is still running"
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-signal.SIGKILL).startswith("was killed by signal SIGKILL (9")
    assert describe_exit(-signal.SIGSEGV) == "was killed by signal SIGSEGV (11)"


def test_process_state_of_this_process_and_of_none():
    assert process_state(os.getpid()) in ("running", "sleeping")
    assert process_state(2**22 + 12345) is None


def test_the_stalest_or_stopped_rank_is_named_first(tmp_path):
    now = time.time()
    write_beat(tmp_path, 0, step=7, phase="train_batch_end", warm=True)
    write_beat(tmp_path, 1, step=5, phase="before_backward", warm=True)
    write_beat(tmp_path, 2, step=0, phase="setup:fit", warm=False)
    beats = read_beats(tmp_path)
    assert beats[1].step == 5 and beats[1].pid == os.getpid() and beats[2].warm is False
    # Everyone is idle 10 s later: warm ranks are over a 5 s limit, the cold one is within its 60 s grace.
    stalls = stalled_ranks(tmp_path, [0, 1, 2], started_at=now, watchdog_s=5, startup_grace_s=60, now=now + 10)
    assert sorted(s.rank for s in stalls) == [0, 1]
    assert "rank" in stalls[0].describe() and "limit 5 s" in stalls[0].describe()
    # A rank that never sent a heartbeat is measured from the start, against the grace period.
    stalls = stalled_ranks(tmp_path, [3], started_at=now, watchdog_s=5, startup_grace_s=60, now=now + 61)
    assert stalls[0].rank == 3 and "no heartbeat since it started" in stalls[0].describe()


def test_the_oldest_heartbeat_is_the_culprit(tmp_path):
    write_beat(tmp_path, 0, 4, "a", True)
    write_beat(tmp_path, 1, 3, "b", True)
    t0 = min(b.time for b in read_beats(tmp_path).values())
    # Make rank 1's beat 3 s older than rank 0's: the oldest heartbeat is the culprit.
    p = tmp_path / "rank-00001.json"
    data = json.loads(p.read_text())
    data["time"] = t0 - 3
    p.write_text(json.dumps(data))
    stalls = stalled_ranks(tmp_path, [0, 1], started_at=t0 - 10, watchdog_s=1, startup_grace_s=1, now=t0 + 10)
    assert stalls[0].rank == 1


class _P:
    def __init__(self, pid):
        self.pid = pid


def test_a_lost_rank_is_the_cause_not_the_peer_that_lost_it():
    tb = "Traceback...\nRuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:123"
    outcomes = {0: _Outcome(False, tb), 1: _Outcome(False, exitcode=-signal.SIGKILL)}
    message = _describe_failure(outcomes, [_P(100), _P(101)])
    assert message.startswith("rank 1 (pid 101) was killed by signal SIGKILL")
    assert "rank 0 raised RuntimeError" in message and "a consequence" in message


def test_an_own_error_comes_before_peer_errors():
    own = "Traceback...\nValueError: bad batch"
    peer = "Traceback...\nRuntimeError: Connection reset by peer"
    outcomes = {0: _Outcome(False, peer), 1: _Outcome(False, own), 2: _Outcome(False, own), 3: _Outcome(True, None)}
    message = _describe_failure(outcomes, [_P(1), _P(2), _P(3), _P(4)])
    assert message.startswith("rank 1 raised:\n" + own)
    assert "rank 2 raised the same error" in message and "rank 0 raised RuntimeError: Connection reset" in message


def test_run_ids():
    assert job_run_id({"SLURM_JOB_ID": "42"}) == "slurm-42"
    assert job_run_id({"SLURM_JOB_ID": "42", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "2",
                       "SLURM_STEP_ID": "0"}) == "slurm-40_2-step0"
    assert job_run_id({"TORCHELASTIC_RUN_ID": "abc"}) == "torchrun-abc"
    with pytest.raises(ValueError, match="--standalone or --rdzv-id"):
        job_run_id({"TORCHELASTIC_RUN_ID": "none"})
    t = time.mktime((2026, 1, 2, 3, 4, 5, 0, 0, -1))
    a, b = job_run_id({}, now=t, pid=11), job_run_id({}, now=t, pid=12)
    assert a == "2026-01-02/03-04-05-11" and a != b  # two jobs in the same second


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"action": "ignore"}, "NonFiniteGuard action='ignore' is not valid: expected one of ['stop', 'skip']"),
    ({"max_consecutive_skips": 0}, "NonFiniteGuard max_consecutive_skips=0 is not valid"),
])
def test_nonfinite_guard_rejects_bad_options(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        NonFiniteGuard(**kwargs)


def test_heartbeat_callback_rejects_bad_limits():
    with pytest.raises(ValueError, match=re.escape("HeartbeatCallback watchdog_s=0 is not valid")):
        HeartbeatCallback(watchdog_s=0)


def test_a_heartbeat_left_by_an_earlier_run_does_not_count(tmp_path):
    """A resumed job reuses its run directory: the previous attempt's heartbeats are older than this start."""
    write_beat(tmp_path, 0, step=40, phase="train_batch_end", warm=True)
    later = time.time() + 3600
    assert stalled_ranks(tmp_path, [0], started_at=later, watchdog_s=5, startup_grace_s=60, now=later + 10) == []
    stalls = stalled_ranks(tmp_path, [0], started_at=later, watchdog_s=5, startup_grace_s=60, now=later + 61)
    assert stalls[0].beat is None and stalls[0].limit_s == 60


def _set_time(directory, rank, at):
    p = directory / f"rank-{rank:05d}.json"
    data = json.loads(p.read_text())
    data["time"] = at
    p.write_text(json.dumps(data))


def test_the_rank_behind_is_named_even_when_a_waiting_peer_went_idle_first(tmp_path):
    """Rank 1 sleeps in its forward at step 3; rank 0 reached that step's backward and waits there for it. Rank 0's
    last progress is older, and only rank 0 is over the limit yet: the culprit is still rank 1, the one behind."""
    write_beat(tmp_path, 0, 3, "backward", True, collective="wait")
    write_beat(tmp_path, 1, 3, "forward", True, where="training_step (m.py:3): time.sleep(60)")
    t0 = time.time()
    _set_time(tmp_path, 0, t0 - 1)
    _set_time(tmp_path, 1, t0)
    stalls = stalled_ranks(tmp_path, [0, 1], started_at=t0 - 10, watchdog_s=4, startup_grace_s=60, now=t0 + 3.5)
    assert [s.rank for s in stalls] == [1, 0]
    assert "last heartbeat at step 3, forward, at training_step (m.py:3)" in stalls[0].describe()
    assert "waiting in collective wait" in stalls[1].describe()


def test_at_the_same_phase_the_rank_not_waiting_in_a_collective_is_the_culprit(tmp_path):
    write_beat(tmp_path, 0, 3, "forward", True, where="training_step (m.py:3): time.sleep(60)")
    write_beat(tmp_path, 1, 3, "forward", True, collective="all_gather_into_tensor")
    t0 = time.time()
    _set_time(tmp_path, 0, t0)
    _set_time(tmp_path, 1, t0 - 2)
    stalls = stalled_ranks(tmp_path, [0, 1], started_at=t0 - 10, watchdog_s=4, startup_grace_s=60, now=t0 + 5)
    assert [s.rank for s in stalls] == [0, 1]
    # A lower step always comes first, whatever the phase.
    assert culprit_key(read_beats(tmp_path)[1]) > culprit_key(None)


def test_where_names_the_line_a_thread_is_blocked_on():
    """A thread blocked in C code (as in a gloo collective or a sleep) is seen at its innermost Python line."""
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    work = types.SimpleNamespace(wait=functools.partial(os.read, r1, 1))  # a C-level wait, as torch's Work.wait

    def stuck_in_a_collective():
        work.wait()

    def stuck_in_a_sleep():
        os.read(r2, 1)

    threads = [threading.Thread(target=f, daemon=True) for f in (stuck_in_a_collective, stuck_in_a_sleep)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    try:
        waiting, sleeping = [locate(t) for t in threads]
    finally:
        os.write(w1, b"x")
        os.write(w2, b"x")
    assert waiting.collective == "wait" and "stuck_in_a_collective" in waiting.where, waiting
    assert "work.wait()" in waiting.where
    assert sleeping.collective is None and "stuck_in_a_sleep" in sleeping.where, sleeping


def test_the_progress_guard_fails_only_a_fit_that_had_steps_left_and_trained_none():
    from types import SimpleNamespace

    from lightning_par.fault.no_progress import NoTrainingStepError, ProgressGuard

    def end(start: int | None, now: int, max_steps: int, should_stop: bool = False) -> None:
        guard = ProgressGuard()
        trainer = SimpleNamespace(global_step=now, max_steps=max_steps, should_stop=should_stop, interrupted=False,
                                  global_rank=1, num_training_batches=0)
        if start is not None:
            guard.on_train_start(trainer, None)
            guard.start_step = start
        guard.on_fit_end(trainer, None)

    end(0, 6, 6)  # trained
    end(None, 6, 6)  # resumed at max_steps: nothing left, training skipped
    end(None, 0, 6, should_stop=True)  # stopped on purpose (a preemption agreed before the first step)
    with pytest.raises(NoTrainingStepError, match=r"trained 0 optimizer steps \(step 0, max_steps=6\): rank 1 had 0"):
        end(None, 0, 6)  # an empty training dataloader: Lightning never starts the training loop
    with pytest.raises(NoTrainingStepError, match=r"step 4, max_steps=-1"):
        end(4, 4, -1)
