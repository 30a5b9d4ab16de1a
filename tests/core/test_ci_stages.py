"""``make test`` runs CI's stages in one pytest run (``--staged``, tests/conftest.py): a module of the package that does
not import fails the first stage, and the run stops there, before any later stage starts, within CI's first 120 s.

The check runs ``make test``'s own command (read with ``make -n``) on a copy of the package with one module broken on
purpose, and a test of a later stage that leaves a file behind if it runs."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.recipe_run import tail

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.e2e  # a fresh pytest interpreter (the one CI starts), on a copy of the package

LATER_STAGE_TEST = '''
from pathlib import Path


def test_a_fast_test_after_the_imports_stage():
    (Path(__file__).resolve().parents[2] / "the-fast-stage-ran").write_text("it ran")
'''


def _make_test_commands() -> list[str]:
    """The commands ``make test`` runs (its recipe, the install step left out), with this interpreter as Python."""
    # Under CI this test runs inside `make test`: the outer make's MAKEFLAGS/MAKELEVEL would make the inner one print
    # "make[1]: Entering directory ..." lines among the commands.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")}
    proc = subprocess.run(["make", "--no-print-directory", "-n", "-o", ".venv/.installed", "test",
                           f"PY={sys.executable}"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
                          env=env)
    return [line for line in proc.stdout.splitlines() if line.strip()]


def test_make_test_is_one_staged_pytest_run():
    commands = _make_test_commands()
    assert len(commands) == 1, commands  # one collection of the tree, not one per stage
    args = shlex.split(commands[0])
    assert args[:3] == [sys.executable, "-m", "pytest"] and "--staged" in args and "--durations=25" in args, args
    assert "not slow" in args, args  # every test CI runs, the `slow` cells left out
    assert args[args.index("-n") + 1] == "2", args  # on the machine's two cores (xdist workers)


def test_a_broken_module_fails_the_first_stage_and_nothing_after_it_runs(tmp_path: Path):
    shutil.copytree(ROOT / "lightning_par", tmp_path / "lightning_par", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "lightning_par" / "broken_on_purpose.py").write_text("import a_module_that_does_not_exist  # noqa\n")
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    (tmp_path / "tests" / "core").mkdir(parents=True)
    for name in ("__init__.py", "conftest.py", "core/__init__.py", "core/test_every_module_imports.py"):
        shutil.copy(ROOT / "tests" / name, tmp_path / "tests" / name)
    (tmp_path / "tests" / "core" / "test_a_later_stage.py").write_text(LATER_STAGE_TEST)

    start = time.monotonic()
    proc = subprocess.run(_make_test_commands()[0], shell=True, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    seconds = time.monotonic() - start

    out = tail(proc, 8000)
    assert proc.returncode == 2, out  # pytest's status for a run interrupted (here: at the end of the failed stage)
    assert "FAILED tests/core/test_every_module_imports.py::test_module_imports[lightning_par.broken_on_purpose]" in \
        proc.stdout, out
    assert "No module named 'a_module_that_does_not_exist'" in proc.stdout, out
    assert "stage 1 (imports) had a failure: the later stages (fast, distributed, e2e) were not run" in proc.stdout, out
    assert not (tmp_path / "the-fast-stage-ran").exists(), out
    # the stage-1 tests of the copy are the real ones, and they ran: only the broken module failed
    assert re.search(r"^1 failed, [1-9][0-9]* passed in ", proc.stdout, re.MULTILINE), out
    assert re.search(r"^stage 1 imports +[1-9][0-9]* tests .* FAILED$", proc.stdout, re.MULTILINE), out
    assert re.search(r"^stage 2 fast +0 tests .* not run$", proc.stdout, re.MULTILINE), out
    assert seconds < 120, f"the broken import took {seconds:.0f} s to fail"


@pytest.mark.parametrize("workers", ["0", "2"])
def test_without_a_failure_every_stage_runs_in_order(tmp_path: Path, workers: str):
    """The stages' order and the summary on a small tree: a test of each kind, each leaving its name in a file; in one
    process and on two xdist workers (where the stages are a barrier: nothing of a stage starts before the earlier
    stages' tests have all ended)."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    (tmp_path / "tests" / "core").mkdir(parents=True)
    for name in ("__init__.py", "conftest.py", "core/__init__.py"):
        shutil.copy(ROOT / "tests" / name, tmp_path / "tests" / name)
    log = tmp_path / "order.txt"
    # each test writes its name after a wait that is longer the earlier its stage: on two workers without the barrier
    # a later stage's name would come first
    ran = (f"import time\n\n\ndef _ran(name):\n"
           f"    time.sleep({{'imports': 1.5, 'fast': 1.0, 'distributed': 0.5}}.get(name, 0.0))\n"
           f"    with open({str(log)!r}, 'a') as f:\n        f.write(name + '\\n')\n")
    (tmp_path / "tests" / "core" / "test_every_module_imports.py").write_text(
        f"{ran}\n\ndef test_imports():\n    _ran('imports')\n")
    kinds = f"import pytest\n\n\n{ran}"  # written out of stage order: the run sorts them
    for name, mark in {"e2e": "@pytest.mark.e2e\n", "distributed": "@pytest.mark.distributed\n", "fast": ""}.items():
        kinds += f"\n\n{mark}def test_{name}():\n    _ran({name!r})\n"
    (tmp_path / "tests" / "core" / "test_kinds.py").write_text(kinds)
    record = tmp_path / "unit_seconds.json"
    write = ["--write-unit-seconds", str(record)] if workers == "2" else []
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--staged", "-n", workers,
                           *write, "tests"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, tail(proc)
    assert log.read_text().split() == ["imports", "fast", "distributed", "e2e"], tail(proc)
    for number, stage in enumerate(("imports", "fast", "distributed", "e2e"), 1):
        assert f"stage {number} {stage:12s}     1 tests" in proc.stdout, tail(proc)
    if write:  # each unit of a second or more, with its seconds (the 1.5 s and 1.0 s waits); the e2e test took none
        seconds = json.loads(record.read_text())
        assert set(seconds) == {"tests/core/test_every_module_imports.py::test_imports",
                                "tests/core/test_kinds.py::test_fast"}, seconds
        assert seconds["tests/core/test_every_module_imports.py::test_imports"] >= 1.5, seconds
