"""Proof that the marker-selected stages of ``make test`` select the same tests as the folder-selected stages before the
layout change (``tests/support/relayout.py``).

``python -m tests.support.check_stages [--base REV]`` exports the tree at ``REV`` (default: the commit before the
move, :data:`BASE`) to a temporary folder, runs ``pytest --collect-only -q`` there with each stage's old selection and
here with each stage's new selection, maps the old node ids to the new files (:func:`tests.support.relayout.plan`
on the old tree) and checks, stage by stage, that the sets are equal. Exit status 1 and the differences on a mismatch.

The old stages 3 (``tests/distributed tests/lightning tests/gpu``) and 4 (the tests of ``tests/unit tests/config``
that start processes) are one stage now, selected by marker: ``distributed`` (or ``gpu``) and not ``e2e``; a test
marked ``e2e`` runs in the e2e stage (old stage 4's e2e tests, and the 8 world-8 cells of the old distributed folder
that carry ``e2e`` beside ``distributed``: markers alone cannot tell them from the e2e folder's tests marked both, and
no marker is taken away). So the new distributed stage must equal old stage 3 less its e2e tests plus old stage 4's
non-e2e tests, and the new e2e stage old stage 5 plus the e2e tests of old stages 3 and 4; the other stages,
test-fast, test-slow and the whole non-slow set must be equal as they are.

Since then: ``make test`` is one ``--staged`` run and each stage is read with ``--stage NAME`` (tests/conftest.py's
``stage_of``); tests added after the base are counted, not compared (the union check places each in one stage); a test
of the base that is gone must be in :data:`GONE`, one that changed stage on purpose in :data:`MOVED`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.support.relayout import ROOT, plan

#: The commit of main the layout change started from.
BASE = "955d976"

IMPORTS = "tests/unit/test_every_module_imports.py"
OLD = {
    "imports": [IMPORTS],
    "fast": ["-m", "not slow and not e2e and not distributed", "tests/unit", "tests/config", "--deselect", IMPORTS],
    "distributed": ["-m", "not slow", "tests/distributed", "tests/lightning", "tests/gpu"],
    "distributed_e2e": ["-m", "not slow and e2e", "tests/distributed", "tests/lightning", "tests/gpu"],
    "process_units": ["-m", "not slow and (e2e or distributed)", "tests/unit", "tests/config"],
    "process_units_e2e": ["-m", "not slow and e2e", "tests/unit", "tests/config"],
    "e2e": ["-m", "not slow", "tests/e2e"],
    "test-fast": ["-m", "not slow and not e2e and not distributed", "tests/unit", "tests/config"],
    "test-slow": ["-m", "slow"],
    "all": ["-m", "not slow"],
}
NEW_IMPORTS = "tests/core/test_every_module_imports.py"
#: ``make test`` is one pytest run with ``--staged``; tests/conftest.py's ``stage_of`` sorts the tests into the stages,
#: which ``--stage NAME`` selects alone. ``make test-fast`` selects by marker (FAST, as the Makefile writes it): stages 1
#: and 2 together.
FAST = "not slow and not e2e and not distributed and not gpu"
NEW = {
    "imports": ["--stage", "imports"],
    "fast": ["--stage", "fast"],
    "distributed": ["--stage", "distributed"],
    "e2e": ["--stage", "e2e"],
    "test-fast": ["-m", FAST, "tests"],
    "test-slow": ["-m", "slow"],
    "all": ["-m", "not slow"],
}
#: Tests that changed stage on purpose since :data:`BASE`, by node id prefix (``file::test``; its parametrized cases
#: too): (old stage, new stage, why). Each must exist and be where this says.
MOVED = {
    "tests/core/test_import_layers.py::test_importing_the_package_does_not_load_the_planner":
        ("fast", "e2e", "starts a fresh interpreter (issue 47)"),
    "tests/core/test_docs.py::test_docs_site_builds_strictly":
        ("fast", "e2e", "runs mkdocs in a fresh interpreter (issue 47)"),
    "tests/benchmarks/test_gpu_check.py::test_the_script_fails_loudly_without_a_gpu":
        ("fast", "e2e", "runs scripts/gpu_check.sh, which starts interpreters (issue 47)"),
}

#: Tests of :data:`BASE` that no longer exist, on purpose: node id -> why.
GONE = {
    "tests/core/test_every_module_imports.py::test_module_imports[lightning_par.data_parallel.fault_tolerance]":
        "the module was removed (4527edb: its re-export of the fault_tolerance folder)",
}


def compare(expected: dict[str, set[str]], new: dict[str, set[str]]) -> bool:
    """Stage by stage: every test of :data:`BASE` that still exists is in the stage it was (after :data:`MOVED`), and
    every test of ``BASE`` still exists unless :data:`GONE` says why; tests added since ``BASE`` are counted (their
    stage is their markers'; the union check places each in exactly one). True when something differs."""
    failed = False
    then, now = set().union(*expected.values()), set().union(*new.values())
    print(f"since the base: {len(now - then)} tests added, {len(then - now)} gone")
    for nodeid in sorted(then - now):
        print(f"    gone: {nodeid}" + (f" ({GONE[nodeid]})" if nodeid in GONE else " -- not in GONE"))
        failed |= nodeid not in GONE
    for name, want in expected.items():
        got = new[name] & then  # the tests that existed at the base
        want = want & now  # and still exist
        status = "same" if got == want else "DIFFERENT"
        print(f"{name:12s} base {len(expected[name]):5d}  now {len(new[name]):5d}  "
              f"(+{len(new[name] - then)} added)  tests of both: {status}")
        if got != want:
            failed = True
            for nodeid in sorted(want - got)[:20]:
                print(f"    left this stage:   {nodeid}")
            for nodeid in sorted(got - want)[:20]:
                print(f"    joined this stage: {nodeid}")
    return failed


def collect(root: Path, args: list[str]) -> set[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                          cwd=root, capture_output=True, text=True)
    if proc.returncode not in (0, 5):  # 5: nothing collected
        raise SystemExit(f"collection failed in {root} for {args}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return {line for line in proc.stdout.splitlines() if "::" in line}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default=BASE, help="the commit with the old layout (default %(default)s)")
    args = parser.parse_args(argv)
    makefile = (ROOT / "Makefile").read_text()
    for expr in (FAST, '$(PYTEST) --staged --durations=25 -m "not slow" tests'):
        assert expr in makefile, f"the Makefile no longer has {expr!r}: update NEW here"
    with tempfile.TemporaryDirectory() as tmp:
        old_root = Path(tmp)
        archive = subprocess.run(["git", "archive", args.base], cwd=ROOT, capture_output=True, check=True).stdout
        with tarfile.open(fileobj=__import__("io").BytesIO(archive)) as tar:
            tar.extractall(old_root, filter="data")
        moves = plan(old_root)
        with ThreadPoolExecutor(3) as pool:  # each collection imports the suite (about 20 s of one core)
            old_jobs = {name: pool.submit(collect, old_root, sel) for name, sel in OLD.items()}
            new_jobs = {name: pool.submit(collect, ROOT, sel) for name, sel in NEW.items()}
            old = {name: job.result() for name, job in old_jobs.items()}
            new = {name: job.result() for name, job in new_jobs.items()}

    def mapped(ids: set[str]) -> set[str]:
        out = set()
        for nodeid in ids:
            path, sep, rest = nodeid.partition("::")
            out.add(moves.get(path, path) + sep + rest)
        return out

    expected = {
        "imports": mapped(old["imports"]),
        "fast": mapped(old["fast"]),
        "distributed": mapped((old["distributed"] - old["distributed_e2e"])
                              | (old["process_units"] - old["process_units_e2e"])),
        "e2e": mapped(old["e2e"] | old["process_units_e2e"] | old["distributed_e2e"]),
        "test-fast": mapped(old["test-fast"]),
        "test-slow": mapped(old["test-slow"]),
        "all": mapped(old["all"]),
    }
    failed = False
    for prefix, (was, now, why) in MOVED.items():
        moved = {nodeid for nodeid in expected[was] if nodeid == prefix or nodeid.startswith(prefix + "[")}
        if not moved:
            print(f"MOVED names {prefix}, which is not in the {was} stage of {args.base}")
            failed = True
        expected[was] -= moved
        expected[now] |= moved
        if was == "fast":
            expected["test-fast"] -= moved
        print(f"    {was} -> {now}: {prefix} ({len(moved)} tests; {why})")
    print("tests whose stage changed (marked e2e in the old distributed folders: the e2e stage now):")
    for nodeid in sorted(mapped(old["distributed_e2e"])):
        print(f"    distributed -> e2e: {nodeid}")
    print("old stage 4 (tests of tests/unit, tests/config that start processes) split: "
          f"{len(old['process_units']) - len(old['process_units_e2e'])} -> distributed, "
          f"{len(old['process_units_e2e'])} -> e2e")
    failed |= compare(expected, new)
    if new["test-fast"] != new["imports"] | new["fast"]:
        print("make test-fast does not select stages 1 and 2 of make test")
        failed = True
    stages = [new["imports"], new["fast"], new["distributed"], new["e2e"]]
    union = set().union(*stages)
    overlap = sum(len(s) for s in stages) - len(union)
    print(f"stages' union {len(union)} vs every non-slow test {len(new['all'])}; tests in two stages: {overlap}")
    if union != new["all"] or overlap:
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
