"""Run a command as a user would, with this checkout (and extra directories) on PYTHONPATH."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(cmd: list[str], cwd: Path, *paths: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """``cmd`` in ``cwd`` with ``paths`` then the repository first on ``PYTHONPATH``; output captured as text."""
    pythonpath = [str(p) for p in (*paths, ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath), "HYDRA_FULL_ERROR": "1", **env}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env)


def tail(proc: subprocess.CompletedProcess, n: int = 4000) -> str:
    return proc.stdout[-n:] + "\n--- stderr ---\n" + proc.stderr[-n:]
