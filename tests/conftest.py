"""Session-wide test settings and shared fixtures."""

import gc
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

# The distributed tests fork their ranks from this process (lightning_par.launcher, start method "fork"). GNU OpenMP is
# not fork-safe: a child that enters a parallel region after this process ran one on several threads waits forever
# for the worker threads it did not inherit (seen in the full suite: a forked rank idle in libgomp inside CPU flash
# attention). With one intra-op thread here this process never starts an OpenMP thread pool; the ranks set their own
# thread count (threads_per_rank).
torch.set_num_threads(1)
# Lightning's launchers raise the thread count of the process they run in (``_set_num_threads_if_needed``: cpu count
# over processes, unless OMP_NUM_THREADS is set): after an in-process Trainer run, this process would run OpenMP
# regions on 2 threads, and a world forked after that hangs in libgomp (seen in the full suite: a rank idle in
# libgomp inside Adam's sqrt, forked by an in-process recipe run). The ranks' own counts are set by the launcher.
os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    """Destroy the default process group a test started in this process (a ``Trainer`` or ``Fabric`` at world 1 leaves
    it initialised), after every test: later tests check that nothing starts one before its time, and a world forked
    from a process holding a gloo group fails (measured: one in-process float8 Trainer run left its group, and every
    forked world after it in the suite errored or timed out). Also restores the environment: an in-process run sets
    MASTER_PORT (Lightning picks a free port and writes it to os.environ), and every later subprocess launch of the
    suite then inherited a port this process still held (EADDRINUSE in the registry and README example tests)."""
    environ = dict(os.environ)
    yield
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    if torch.get_num_threads() != 1:  # a test raised it: back to one before anything here runs multi-threaded
        torch.set_num_threads(1)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        # and free the group's objects here, where its threads are: a world forked while they wait in this process's
        # garbage inherits them (the launcher's ranks freeze what they inherit, see lightning_par.launcher._child)
        gc.collect()


@pytest.fixture(autouse=True)
def cuda_device(request) -> torch.device | None:
    """The tests marked ``gpu`` (a CUDA path): skipped without a CUDA device, except under ``LP_REQUIRE_CUDA=1``
    (``scripts/gpu_check.sh``), where a missing device fails them instead, so the GPU check cannot pass by skipping.
    Their CUDA device; None for the other tests."""
    if request.node.get_closest_marker("gpu") is None:
        return None
    if not torch.cuda.is_available():
        if os.environ.get("LP_REQUIRE_CUDA") == "1":
            pytest.fail("LP_REQUIRE_CUDA=1 but torch.cuda.is_available() is False: no CUDA device to test on.")
        pytest.skip("needs a CUDA device (run scripts/gpu_check.sh on a GPU machine)")
    return torch.device("cuda", 0)


# --- CI's stages in one pytest run (`make test`: `pytest --staged -n 2`) ---------------------------------------------
# One collection of the tree instead of one per stage (each imports every test module: ~15 s of a core), the tests run
# stage by stage, and the run stops at the end of the first stage with a failure: a broken import fails in the first
# stage, a failing fast test before any process group starts. `--stage NAME` selects one stage (check_stages uses it).
#
# With pytest-xdist (`-n 2`: the machine's two cores), the stages stay a barrier: the controller hands out each module's
# tests of one stage as one unit where they share a module fixture, else each test alone (`_unit_of`; xdist's
# `loadscope`, units in stage order, the longest first within a stage: `staged_order`), a worker starts a test only
# once every test of the earlier stages has ended (the controller writes a file per finished stage), and after a stage
# with a failure nothing of a later stage runs.

#: The stages in the order they run; a test's stage is the first whose rule matches (see :func:`stage_of`).
STAGES = ("imports", "fast", "distributed", "e2e")
#: Stage 1: every package module imports (seconds); first, so that a broken import fails CI before anything else.
IMPORTS_FILE = "tests/core/test_every_module_imports.py"
#: A worker waits at most this long for the earlier stages to end before it fails the test it holds (seconds).
BARRIER_TIMEOUT_S = 1200.0


def stage_of(item: pytest.Item) -> str:
    """The CI stage of ``item``, by marker (tests/README.md): the module import checks, then ``e2e`` (a recipe
    interpreter; also when marked ``distributed``), ``distributed`` or ``gpu``, and the rest (no processes)."""
    if item.nodeid.split("::", 1)[0] == IMPORTS_FILE:
        return "imports"
    if item.get_closest_marker("e2e") is not None:
        return "e2e"
    if item.get_closest_marker("distributed") is not None or item.get_closest_marker("gpu") is not None:
        return "distributed"
    return "fast"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("lightning_par stages")
    group.addoption("--staged", action="store_true",
                    help="run the tests stage by stage (" + ", ".join(STAGES) + ") and stop after the first stage "
                         "with a failure (make test); with -n N the stages are a barrier across the workers")
    group.addoption("--stage", choices=STAGES, default=None, help="only the tests of this stage")
    group.addoption("--write-unit-seconds", metavar="PATH", default=None,
                    help="with --staged -n N: write each unit's seconds (of one second or more) to PATH, the file "
                         "that orders the units (tests/support/unit_seconds.json)")


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _unit_of(item: pytest.Item) -> str:
    """What xdist hands to one worker with ``item`` under ``--staged``: its module when it uses a fixture of module,
    class or package scope (often a whole gloo world's parity run, shared by the module's cells: it must run once), else
    the test alone (the stage's long end-to-end tests spread over the workers)."""
    info = getattr(item, "_fixtureinfo", None)
    shared = info is None or any(d.scope in ("module", "class", "package")
                                 for defs in info.name2fixturedefs.values() for d in defs)
    return _module(item.nodeid) if shared else item.nodeid


@pytest.hookimpl(trylast=True)  # after `-m` and `-k` deselected theirs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    only = config.getoption("--stage")
    if only is not None:
        keep = [item for item in items if stage_of(item) == only]
        config.hook.pytest_deselected(items=[item for item in items if stage_of(item) != only])
        items[:] = keep
    if not config.getoption("--staged"):
        return
    if not hasattr(config, "workerinput"):
        items.sort(key=lambda item: STAGES.index(stage_of(item)))  # stable: file order within a stage
        return
    items[:] = staged_order(items, unit_seconds())


#: The seconds each unit (:func:`_unit_of`) of one or more seconds took in a measured ``make test`` (its setup, call and
#: teardown on a worker, summed; ``make test ARGS=--write-unit-seconds=tests/support/unit_seconds.json`` rewrites it).
#: It only orders the units: a stale or missing entry costs time at a barrier, never a test.
UNIT_SECONDS_FILE = Path(__file__).parent / "support" / "unit_seconds.json"
#: The estimate for a test of a unit the file does not list (a new test, or one of a unit under a second).
UNKNOWN_TEST_S = 0.5


def unit_seconds() -> dict[str, float]:
    """The recorded seconds per unit (``UNIT_SECONDS_FILE``); empty where the file is missing (a copy of this
    conftest elsewhere)."""
    try:
        return json.loads(UNIT_SECONDS_FILE.read_text())
    except FileNotFoundError:
        return {}


def staged_order(items: list[pytest.Item], seconds: dict[str, float]) -> list[pytest.Item]:
    """A worker's order under ``--staged`` (the order xdist's controller hands the units out in): by stage, each unit's
    tests together in file order, within a stage the longest units first (``seconds``, else :data:`UNKNOWN_TEST_S`
    per test): the longest-processing-time-first rule, so that the units left at a stage's barrier are short and the
    two workers end it together (measured: a 17 s unit of one test handed out last kept the other worker idle 15 s)."""
    units = [_unit_of(item) for item in items]
    count: dict[str, int] = {}
    first: dict[str, int] = {}
    for index, unit in enumerate(units):
        count[unit] = count.get(unit, 0) + 1
        first.setdefault(unit, index)
    keys = [(STAGES.index(stage_of(item)), -seconds.get(unit, UNKNOWN_TEST_S * count[unit]), first[unit], index)
            for index, (item, unit) in enumerate(zip(items, units))]
    return [items[key[-1]] for key in sorted(keys)]  # the index last: file order within a unit


class _StageState:
    """Per run: the stages that had a failure, and each stage's test count and wall seconds (the terminal summary)."""

    def __init__(self) -> None:
        self.failed: list[str] = []
        self.counts: dict[str, int] = {}
        self.started: dict[str, float] = {}
        self.ended: dict[str, float] = {}


_stage_state = pytest.StashKey[_StageState]()


class _StagedController:
    """The xdist controller's part of ``--staged``: it hands out one unit per stage and module (:func:`_unit_of`: or
    per test, for a test that shares no module fixture) in the workers' order,
    learns each test's stage from the map the workers wrote, counts each stage's tests, and when a stage's last test
    has ended writes the stage's file (``passed``/``failed``) that the workers wait for; after a stage with a failure it
    stops the run."""

    def __init__(self, config: pytest.Config) -> None:
        self.config, self.state = config, config.stash[_stage_state]
        self.stage_dir = Path(tempfile.mkdtemp(prefix="lp-stages-"))
        self.stage: dict[str, str] = {}
        self.unit: dict[str, str] = {}
        self.left: dict[str, set[str]] = {}
        self.seconds: dict[str, float] = {}
        config.option.loadscopereorder = False  # the workers' order is the stages' (loadscope would sort by size)

    def stage_of_nodeid(self, nodeid: str) -> str:
        if not self.stage:
            tests = json.loads(next(iter(sorted(self.stage_dir.glob("map-*.json")))).read_text())
            for test, (stage, unit) in tests.items():
                self.stage[test], self.unit[test] = stage, unit
                self.left.setdefault(stage, set()).add(test)
        return self.stage[nodeid]

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node) -> None:
        node.workerinput["lp_stage_dir"] = str(self.stage_dir)

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log):
        from xdist.scheduler import LoadScopeScheduling

        controller = self

        class StagedScopes(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:  # see _unit_of: a module's shared fixtures run once
                return f"{controller.stage_of_nodeid(nodeid)}|{controller.unit[nodeid]}"

        return StagedScopes(config, log)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        stage, state = self.stage_of_nodeid(report.nodeid), self.state
        state.started.setdefault(stage, time.monotonic())
        if report.failed and stage not in state.failed:
            state.failed.append(stage)
        unit = self.unit[report.nodeid]
        self.seconds[unit] = self.seconds.get(unit, 0.0) + report.duration
        if report.when != "teardown":
            return
        state.counts[stage] = state.counts.get(stage, 0) + 1
        state.ended[stage] = time.monotonic()
        self.left[stage].discard(report.nodeid)
        if self.left[stage]:
            return
        # written whole, then renamed: a worker that sees the file reads its whole word (seen: a worker read the empty
        # file between its creation and its write, took it for a failed stage and ran nothing more)
        part = self.stage_dir / f"done-{stage}.part"
        part.write_text("failed" if stage in state.failed else "passed")
        os.replace(part, self.stage_dir / f"done-{stage}")
        later = [s for s in STAGES[STAGES.index(stage) + 1:] if self.left.get(s)]
        if stage in state.failed and later:
            self.config.pluginmanager.getplugin("dsession").shouldstop = _stop_message(stage)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """A run that ended without a failed stage but with a test that never reported has not run that test: fail."""
        if self.state.failed or session.shouldstop or session.exitstatus not in (0, 1) or not self.stage:
            return
        missing = sorted(test for tests in self.left.values() for test in tests)
        if missing:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
            reporter = self.config.pluginmanager.getplugin("terminalreporter")
            if reporter is not None:
                reporter.write_line(f"{len(missing)} tests never reported (not run): " + ", ".join(missing[:20]),
                                    red=True)

    def pytest_unconfigure(self) -> None:
        shutil.rmtree(self.stage_dir, ignore_errors=True)
        path = self.config.getoption("--write-unit-seconds")
        if path is not None and self.seconds:
            Path(path).write_text(json.dumps({unit: round(s, 1) for unit, s in sorted(self.seconds.items()) if s >= 1.0},
                                             indent=0, ensure_ascii=False) + "\n")


class _StagedWorker:
    """An xdist worker's part of ``--staged``: it writes each test's stage for the controller, and starts a test only
    once every test of the earlier stages has ended (on any worker); after a stage with a failure it runs nothing of a
    later stage (no report: the controller stops the run)."""

    def __init__(self, config: pytest.Config) -> None:
        self.stage_dir = Path(config.workerinput["lp_stage_dir"])
        self.stages: set[str] = set()

    @pytest.hookimpl(tryfirst=True)  # before xdist's own sends the collection to the controller
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.stages = {stage_of(item) for item in session.items}
        (self.stage_dir / f"map-{session.config.workerinput['workerid']}.json").write_text(
            json.dumps({item.nodeid: (stage_of(item), _unit_of(item)) for item in session.items}))

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
        deadline = time.monotonic() + BARRIER_TIMEOUT_S
        for stage in STAGES[:STAGES.index(stage_of(item))]:
            if stage not in self.stages:
                continue
            done = self.stage_dir / f"done-{stage}"
            while not done.exists():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{item.nodeid}: stage {stage!r} did not end within {BARRIER_TIMEOUT_S:.0f} s")
                time.sleep(0.05)
            word = done.read_text()
            if word != "passed":
                if word != "failed":
                    raise RuntimeError(f"{item.nodeid}: the file of stage {stage!r} says {word!r}: expected 'passed' "
                                       f"or 'failed'")
                return True  # not run
        return None


def _stop_message(stage: str) -> str:
    later = STAGES[STAGES.index(stage) + 1:]
    return f"stage {STAGES.index(stage) + 1} ({stage}) had a failure: the later stages ({', '.join(later)}) were not run"


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_stage_state] = _StageState()
    if not config.getoption("--staged"):
        return
    if hasattr(config, "workerinput"):
        config.pluginmanager.register(_StagedWorker(config), "lp-staged-worker")
    elif getattr(config.option, "dist", "no") != "no" and not config.getoption("collectonly"):
        # -n N: this process only hands out the tests (xdist's own configure, which registers that, runs last)
        config.pluginmanager.register(_StagedController(config), "lp-staged-controller")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    outcome = yield
    if item.config.getoption("--staged") and outcome.get_result().failed:  # setup, call or teardown
        failed = item.config.stash[_stage_state].failed
        if stage_of(item) not in failed:
            failed.append(stage_of(item))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Under ``--staged`` in one process: after the last test of a stage that had a failure, stop the run
    (``session.shouldstop``: pytest reports "Interrupted: <reason>" and exits 2). (xdist: :class:`_StagedController`.)"""
    if not item.config.getoption("--staged") or hasattr(item.config, "workerinput"):
        yield
        return
    state, stage = item.config.stash[_stage_state], stage_of(item)
    state.counts[stage] = state.counts.get(stage, 0) + 1
    state.started.setdefault(stage, time.monotonic())
    yield
    state.ended[stage] = time.monotonic()
    if stage in state.failed and nextitem is not None and stage_of(nextitem) != stage:
        item.session.shouldstop = _stop_message(stage)


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    if not config.getoption("--staged") or config.getoption("--collect-only"):
        return
    state = config.stash[_stage_state]
    terminalreporter.section("stages")
    for number, stage in enumerate(STAGES, 1):
        status = "FAILED" if stage in state.failed else ("passed" if stage in state.counts else "not run")
        wall = state.ended.get(stage, 0.0) - state.started.get(stage, 0.0)
        terminalreporter.write_line(f"stage {number} {stage:12s} {state.counts.get(stage, 0):5d} tests {wall:8.1f} s "
                                    f"{status}")
