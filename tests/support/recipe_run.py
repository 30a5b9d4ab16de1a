"""Run a command as a user would, with this checkout (and extra directories) on PYTHONPATH."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.support.forked_run import run_forked

ROOT = Path(__file__).resolve().parents[2]


def run(cmd: list[str], cwd: Path, *paths: Path, timeout: float = 300, fresh: bool = False,
        **env: str) -> subprocess.CompletedProcess:
    """``cmd`` in ``cwd`` with ``paths`` then the repository first on ``PYTHONPATH``; output captured as text.

    ``cmd`` is ``[sys.executable, SCRIPT, *ARGS]`` (or ``-m MODULE``): run in a child forked from an interpreter that
    has the recipes' imports done (:mod:`tests.support.forked_run`), the same command line, environment, output and
    exit status without the seconds of a fresh interpreter's imports. ``fresh=True``: a new interpreter
    (``subprocess.run``), for a test of what a fresh interpreter does."""
    pythonpath = [str(p) for p in (*paths, ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath), "HYDRA_FULL_ERROR": "1", **env}
    if fresh:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env)
    return run_forked(cmd, cwd, full_env, timeout=timeout)


def tail(proc: subprocess.CompletedProcess, n: int = 4000) -> str:
    return proc.stdout[-n:] + "\n--- stderr ---\n" + proc.stderr[-n:]
