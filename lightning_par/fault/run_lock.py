"""One job per run directory, under every launcher: ``<run dir>/.lock`` is held by the job that writes there.

The job's rank 0 takes an exclusive ``flock`` on ``<run dir>/.lock`` before the job writes anything there, and
writes who holds it (pid, host, start time, job) into the file. A second job given the same directory is refused at
once with a :class:`RunDirectoryInUse` naming the first. The lock dies with its process (the kernel releases a
``flock`` on exit, even on SIGKILL), so a restarted or requeued job takes over a stale lock by itself; where the file
system has no ``flock`` (``ENOLCK``), a lock whose holder is a dead process of this host is taken over, any other is
refused.

Under our launcher the launching process is the job's rank 0 here. Under torchrun or SLURM every rank calls
:func:`claim_run_dir`: global rank 0 takes the lock; the other ranks wait (without writing) until the file names
their own job (:func:`job_identity`: torchrun's rendezvous id and store address, or SLURM's job and step), and are
refused at once when it names another job whose holder is a live process of their host (else after ``wait_s``: then
their rank 0 was refused, and torchrun/srun end them anyway).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

__all__ = ["LOCK_FILE", "RunDirectoryInUse", "claim_run_dir", "job_identity"]

#: The lock file, in the run directory.
LOCK_FILE = ".lock"
#: Seconds between two reads of the lock file by ranks other than 0.
_POLL_S = 0.1


class RunDirectoryInUse(RuntimeError):
    """Another job holds the run directory; the message names it (pid, host, start time, job)."""


@dataclass(frozen=True)
class _Holder:
    pid: int | None
    host: str | None = None
    started: str | None = None
    job: str | None = None

    @classmethod
    def read(cls, path: Path) -> _Holder | None:
        try:
            text = path.read_text().strip()
        except OSError:
            return None
        if not text:
            return None
        try:
            data = json.loads(text)
        except ValueError:
            data = None
        if isinstance(data, dict):
            return cls(data.get("pid"), data.get("host"), data.get("started"), data.get("job"))
        if isinstance(data, int):  # a plain pid (an older version's lock file)
            return cls(data)
        return cls(None)

    def describe(self) -> str:
        parts = [f"pid {self.pid if self.pid is not None else 'unknown'}"]
        if self.host:
            parts.append(f"on {self.host}")
        if self.started:
            parts.append(f"started {self.started}")
        if self.job:
            parts.append(f"job {self.job}")
        return " ".join(parts)

    def alive_here(self) -> bool:
        """Whether the holder is a live process of this host."""
        if self.pid is None or (self.host is not None and self.host != socket.gethostname()):
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def job_identity(environ: dict[str, str] | None = None) -> str | None:
    """What every rank of one job (one attempt's world) shares: ``torchrun:<rendezvous id>@<store address>``,
    ``slurm:<job id>.<step id>``, ``world:<store address>`` for other ranks with the torchrun variables (the Hydra
    launcher's), ``None`` in a process that is no rank (our launcher's parent)."""
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" in env:
        return f"torchrun:{env['TORCHELASTIC_RUN_ID']}@{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"
    if env.get("SLURM_JOB_ID"):
        return f"slurm:{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '')}"
    if "RANK" in env and "MASTER_PORT" in env:
        return f"world:{env.get('MASTER_ADDR', '')}:{env['MASTER_PORT']}"
    return None


def _in_use(run_dir: Path, holder: _Holder | None) -> RunDirectoryInUse:
    who = holder.describe() if holder is not None else "pid unknown"
    return RunDirectoryInUse(
        f"the run directory {str(run_dir)!r} is in use by another job ({who}): give each job its own hydra.run.dir "
        f"(the default, outputs/${{lp_run_id:}}, is unique per job), or wait for that job to end."
    )


@contextlib.contextmanager
def claim_run_dir(run_dir: str | os.PathLike, rank: int = 0, job: str | None = None,
                  wait_s: float = 120.0) -> Iterator[None]:
    """Hold ``<run_dir>/.lock`` for this job while the block runs (see the module docstring).

    Args:
        run_dir: the run directory (created if missing).
        rank: this process's global rank; rank 0 takes the lock, the others wait until it names ``job``.
        job: the job's identity (:func:`job_identity`); needed for ``rank > 0``.
        wait_s: how long a rank other than 0 waits for its rank 0 to take the lock.

    Raises:
        RunDirectoryInUse: another job holds the directory (the message names its pid, host, start time and job).
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    if rank != 0:
        deadline = time.monotonic() + wait_s
        while True:
            holder = _Holder.read(path)
            if holder is not None and holder.job is not None and holder.job == job:
                break
            if holder is not None and holder.job != job and holder.alive_here():
                raise _in_use(run_dir, holder)
            if time.monotonic() > deadline:
                raise _in_use(run_dir, holder)
            time.sleep(_POLL_S)
        yield
        return
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _in_use(run_dir, _Holder.read(path)) from None
        except OSError as e:  # no flock on this file system: trust the record, take over a dead holder's
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            holder = _Holder.read(path)
            if holder is not None and holder.pid != os.getpid() and (holder.alive_here() or (
                    holder.host is not None and holder.host != socket.gethostname())):
                raise _in_use(run_dir, holder) from None
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                            "started": datetime.now().astimezone().isoformat(timespec="seconds"), "job": job}))
        f.flush()
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(f, fcntl.LOCK_UN)
