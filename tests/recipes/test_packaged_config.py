"""A non-editable install carries conf/ (as lightning_par.conf) and the Hydra plugins: the recipe runs from any
directory with ``python -m lightning_par.train``.

The wheel is built from a copy of the sources and installed with ``--no-deps --target`` (torch, Lightning and Hydra
come from the running environment), so this needs no network. The full check in a fresh virtual environment is
``scripts/check_install.sh``.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support.recipe_run import ROOT, tail

pytestmark = pytest.mark.e2e

SOURCES = ("lightning_par", "hydra_plugins", "conf", "setup.py", "pyproject.toml", "README.md")


def _can_build_here() -> bool:
    """This environment can build the wheel itself: setuptools >= 70.1 (bdist_wheel built in), or older with ``wheel``."""
    try:
        from importlib.metadata import version

        major, minor = (int(x) for x in version("setuptools").split(".")[:2])
    except Exception:  # noqa: BLE001 - not installed, or an odd version string
        return False
    return (major, minor) >= (70, 1) or importlib.util.find_spec("wheel") is not None


def _build_wheel(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(path, src / name)
    isolation = ["--no-build-isolation"] if _can_build_here() else []  # else pip fetches setuptools for the build
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", *isolation, "-w", str(tmp_path / "dist"), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, tail(proc)
    # Quiet packaging: setuptools warns about neither the license's form nor undeclared package data.
    warned = [line for line in (proc.stdout + proc.stderr).splitlines()
              if "Warning" in line or "is absent from the `packages`" in line]
    assert not warned, warned
    return next((tmp_path / "dist").glob("lightning_par-*.whl"))


@pytest.mark.e2e
def test_wheel_ships_conf_and_plugins_and_trains_from_another_directory(tmp_path):
    wheel = _build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    for yaml in ROOT.glob("conf/**/*.yaml"):
        assert f"lightning_par/conf/{yaml.relative_to(ROOT / 'conf').as_posix()}" in names, yaml
    assert "hydra_plugins/lightning_par_hydra/launcher.py" in names
    assert "lightning_par/planner/data/calibration.json" in names  # the planner's published measurements
    assert not any(n.startswith("hydra_plugins/__init__") for n in names)  # a namespace package
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, tail(proc)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "HYDRA_FULL_ERROR": "1"}
    info = subprocess.run([sys.executable, "-m", "lightning_par.train", "--info", "searchpath"], cwd=work, env=env,
                          capture_output=True, text=True, timeout=120)
    assert "pkg://lightning_par.conf" in info.stdout, tail(info)
    run_dir = work / "run"
    proc = subprocess.run([sys.executable, "-m", "lightning_par.train", "model=tiny", "data=synthetic", "trainer=smoke",
                           f"hydra.run.dir={run_dir}"], cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, tail(proc)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["strategy"] == "ddp_overlap"
    assert "Trainer.fit" in (run_dir / "train.log").read_text()  # Lightning's log lines reach the job's train.log
