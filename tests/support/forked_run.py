"""``python SCRIPT ARGS`` as a child forked from a zygote that has torch, Lightning, Hydra and lightning_par imported
(:mod:`tests.support.zygote`), for the end-to-end tests that need "this command ran, printed this, wrote that and
exited so", not a fresh interpreter: each run saves the 5-8 s (far more on a loaded machine) a fresh interpreter spends
importing them. The result is a ``subprocess.CompletedProcess`` with the command's stdout, stderr and exit status, as
``subprocess.run(cmd, capture_output=True, text=True)`` gives.

Keep a real process (``subprocess``) where the interpreter is what a test tests: the README's literal commands (one
real run suffices), launching, signals, orphans, what a fresh interpreter prints at import.

One zygote per environment (the zygote imports with the environment it started with; ``PYTHONPATH`` is applied per
run): most runs share the first. A zygote lives as long as the test session (it ends when its standard input closes).
The zygote process itself runs nothing and starts no thread, so its children are forked from a single-threaded
process that never entered an OpenMP region (the pytest process's own rule, ``tests/conftest.py``).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ZYGOTE = Path(__file__).with_name("zygote.py")
#: Variables applied per run, not at the zygote's imports: read when a run starts, never at import (sys.path is rebuilt
#: from PYTHONPATH for each child; pytest sets PYTEST_CURRENT_TEST per test; an in-process Trainer leaves MASTER_PORT).
_PER_RUN = frozenset({"PYTHONPATH", "HYDRA_FULL_ERROR", "PYTEST_CURRENT_TEST", "MASTER_ADDR", "MASTER_PORT"})
#: One zygote per environment (the variables outside _PER_RUN): {key: Popen}. Test-session state, not the package's.
_ZYGOTES: dict[tuple, subprocess.Popen] = {}


def _zygote(env: dict[str, str]) -> subprocess.Popen:
    key = tuple(sorted((k, v) for k, v in env.items() if k not in _PER_RUN))
    proc = _ZYGOTES.get(key)
    if proc is None or proc.poll() is not None:
        zygote_env = {k: v for k, v in env.items() if k not in _PER_RUN}
        proc = subprocess.Popen([sys.executable, str(ZYGOTE)], cwd=ROOT, env=zygote_env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, bufsize=1)
        _ZYGOTES[key] = proc
        if len(_ZYGOTES) == 1:
            atexit.register(_close_zygotes)
    return proc


def _close_zygotes() -> None:
    """At the session's end: close each zygote's input (it exits) and wait for it, so its children's CPU time is counted
    in this process's (``/usr/bin/time`` of the test run)."""
    for proc in _ZYGOTES.values():
        proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _command(cmd: list[str]) -> list[str]:
    """``cmd`` without the interpreter: ``[SCRIPT, *ARGS]`` or ``["-m", MODULE, *ARGS]``; refuses anything else."""
    if len(cmd) < 2 or cmd[0] != sys.executable or (cmd[1].startswith("-") and cmd[1] != "-m") or \
            (cmd[1] == "-m" and len(cmd) < 3):
        raise ValueError(f"cmd={cmd!r} is not valid for a forked run: expected [sys.executable, SCRIPT, *ARGS] or "
                         f"[sys.executable, '-m', MODULE, *ARGS] (run anything else with subprocess)")
    return [str(c) for c in cmd[1:]]


class ForkedProcess:
    """A command running in a forked child of a zygote (see :func:`start_forked`); ``communicate`` and ``returncode``
    as ``subprocess.Popen`` has them, output captured as text."""

    def __init__(self, cmd: list[str], cwd: Path | str, env: dict[str, str] | None = None,
                 stderr_to_stdout: bool = False, log: Path | str | None = None, new_session: bool = False) -> None:
        self.args = cmd
        self.returncode: int | None = None
        env = dict(os.environ if env is None else env)
        argv = _command(cmd)
        zygote = _zygote(env)
        self._tmp = tempfile.TemporaryDirectory(prefix="forked-run-")
        self._out = os.path.join(self._tmp.name, "stdout") if log is None else str(log)
        self._err = self._out if stderr_to_stdout or log is not None else os.path.join(self._tmp.name, "stderr")
        request = {"argv": argv, "cwd": str(Path(cwd).resolve()), "env": env, "stdout": self._out, "stderr": self._err,
                   "status": os.path.join(self._tmp.name, "status"), "append": log is not None,
                   "new_session": new_session}
        zygote.stdin.write(json.dumps(request) + "\n")
        zygote.stdin.flush()
        answer = zygote.stdout.readline()
        if not answer:
            raise RuntimeError(f"the zygote ({ZYGOTE}) exited (status {zygote.wait()}): its stderr is the session's")
        self.pid: int = json.loads(answer)["pid"]
        self._status = request["status"]

    def poll(self) -> int | None:
        if self.returncode is None and os.path.exists(self._status):
            self.returncode = int(Path(self._status).read_text())
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        """The exit status, once the child has exited (``subprocess.TimeoutExpired`` past ``timeout``, as ``Popen``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        """Wait for the exit (``subprocess.TimeoutExpired`` past ``timeout``, the child left running, as ``Popen``);
        stdout and stderr (None if it went to stdout)."""
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            raise subprocess.TimeoutExpired(self.args, timeout, output=_read(self._out)) from None
        out, err = _read(self._out), None if self._err == self._out else _read(self._err)
        self._tmp.cleanup()
        return out, err


def start_forked(cmd: list[str], cwd: Path | str, env: dict[str, str] | None = None,
                 stderr_to_stdout: bool = False, log: Path | str | None = None,
                 new_session: bool = False) -> ForkedProcess:
    """Start ``cmd`` (``[sys.executable, SCRIPT, *ARGS]`` or ``[sys.executable, "-m", MODULE, *ARGS]``) in ``cwd`` with
    ``env`` (default: this process's environment) in a forked child of a zygote; returns at once. ``log``: append
    stdout and stderr to this file (the caller reads it; ``communicate`` then returns what the file holds) instead of
    capturing them. ``new_session``: the child's own session and process group (``start_new_session=True``)."""
    return ForkedProcess(cmd, cwd, env, stderr_to_stdout, log, new_session)


def run_forked(cmd: list[str], cwd: Path | str, env: dict[str, str] | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """:func:`start_forked`, then wait: ``subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
    timeout=timeout)``'s result. Past ``timeout`` seconds the child is killed (SIGKILL) and
    ``subprocess.TimeoutExpired`` raised, as ``subprocess.run`` does."""
    proc = start_forked(cmd, cwd, env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _read(path: str) -> str:
    return Path(path).read_bytes().decode(errors="replace") if os.path.exists(path) else ""
