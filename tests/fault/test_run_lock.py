"""One job per run directory under every launcher (lightning_par.fault.run_lock), and who counts as an outside
launcher (lightning_par.fault.orphan)."""

from __future__ import annotations

import gc
import json
import os
import re
import select
import signal
import socket
import time

import pytest

from lightning_par.fault.orphan import guard_outside_launcher, outside_launcher
from lightning_par.fault.preemption import PREEMPTED_EXIT_CODE, Preempted, preempted_exit_code
from lightning_par.fault.run_lock import RunDirectoryInUse, claim_run_dir, job_identity


class _Holder:
    """Another process (forked from this one: no 5 s of imports) holding the run directory as rank 0 of job ``job``
    until killed."""

    def __init__(self, run_dir, job: str) -> None:
        read_fd, write_fd = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child
            try:
                gc.freeze()  # as the launcher's ranks: never collect an object whose threads only the parent has
                with claim_run_dir(run_dir, rank=0, job=job):
                    os.write(write_fd, b"held")
                    time.sleep(60)
            finally:
                os._exit(0)
        os.close(write_fd)
        ready, _, _ = select.select([read_fd], [], [], 30)
        assert ready and os.read(read_fd, 4) == b"held"
        os.close(read_fd)

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)


def test_a_second_job_is_refused_naming_the_first_then_takes_over_when_it_dies(tmp_path):
    run_dir = tmp_path / "run"
    first = _Holder(run_dir, "torchrun:abc@127.0.0.1:29500")
    try:
        record = json.loads((run_dir / ".lock").read_text())
        assert record["pid"] == first.pid and record["host"] == socket.gethostname()
        expected = (f"is in use by another job (pid {first.pid} on {socket.gethostname()} started {record['started']} "
                    f"job torchrun:abc@127.0.0.1:29500)")
        with pytest.raises(RunDirectoryInUse, match=re.escape(expected)):  # rank 0 of a second job
            with claim_run_dir(run_dir, rank=0, job="torchrun:xyz@127.0.0.1:29501"):
                pass
        start = time.monotonic()
        with pytest.raises(RunDirectoryInUse, match=re.escape(expected)):  # its rank 1: at once, not after wait_s
            with claim_run_dir(run_dir, rank=1, job="torchrun:xyz@127.0.0.1:29501", wait_s=60):
                pass
        assert time.monotonic() - start < 5
        with claim_run_dir(run_dir, rank=1, job="torchrun:abc@127.0.0.1:29500", wait_s=5):  # the first job's rank 1
            pass
    finally:
        first.kill()
    # The holder died (SIGKILL): its flock went with it, the next job takes the directory over.
    with claim_run_dir(run_dir, rank=0, job="torchrun:xyz@127.0.0.1:29501"):
        assert json.loads((run_dir / ".lock").read_text())["job"] == "torchrun:xyz@127.0.0.1:29501"


def test_a_rank_whose_rank_0_never_takes_the_lock_gives_up(tmp_path):
    (tmp_path / ".lock").write_text(json.dumps({"pid": 2**22 + 12345, "host": socket.gethostname(), "job": "old"}))
    with pytest.raises(RunDirectoryInUse, match="job old"):
        with claim_run_dir(tmp_path, rank=1, job="new", wait_s=0.5):
            pass


def test_job_identity_and_outside_launcher():
    assert job_identity({"TORCHELASTIC_RUN_ID": "r1", "MASTER_ADDR": "h", "MASTER_PORT": "5"}) == "torchrun:r1@h:5"
    assert job_identity({"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0"}) == "slurm:42.0"
    assert job_identity({"RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "7"}) == "world:127.0.0.1:7"
    assert job_identity({}) is None
    assert outside_launcher({"TORCHELASTIC_RUN_ID": "x", "RANK": "0"}) == "torchrun"
    assert outside_launcher({"SLURM_PROCID": "0", "SLURM_STEP_ID": "3"}) == "slurm"
    assert outside_launcher({"RANK": "0", "WORLD_SIZE": "2"}) is None  # our launcher's ranks: it guards them itself


def test_no_guard_without_an_outside_launcher(monkeypatch):
    for var in ("TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_STEP_ID"):
        monkeypatch.delenv(var, raising=False)
    assert guard_outside_launcher(clean_stop=True) is None


def test_status_75_only_with_a_checkpoint_to_resume_from():
    assert preempted_exit_code(True) == PREEMPTED_EXIT_CODE == 75
    assert preempted_exit_code(False) == 143 and preempted_exit_code(False, 10) == 138  # 128 + SIGTERM / SIGUSR1
    assert Preempted("saved").code == 75
    assert Preempted("nothing saved", resumable=False, signum=10).code == 138
