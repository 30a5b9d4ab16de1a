"""No import circle of more than 2 modules in ``lightning_par/``, read from the source with ``ast``.

Every import statement counts (module level, inside functions, under ``if TYPE_CHECKING``): a lazy import inside a
function still makes the lower module depend on the higher one. An edge ``a -> b`` is an explicit import of module
``b`` by module ``a`` (``from lightning_par.x import y`` is an edge to ``lightning_par.x.y`` when that is a module, else
to ``lightning_par.x``); the parent packages Python initialises on the way are not edges (every module would then
depend on ``lightning_par/__init__.py``). Circles are the strongly connected components of that graph (Tarjan).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_par"
#: The largest import circle allowed (a module and its helper importing each other back, lazily).
MAX_CIRCLE = 2


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names)
        graph[name] = {t for t in targets if t in mods and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_check_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    """``import_graph()`` once for the module's tests (it parses every package file: about 0.6 s); read only."""
    return import_graph()


def test_the_graph_sees_lazy_and_type_checking_imports(graph):
    assert "lightning_par.parallelize" in graph["lightning_par.strategies.base"]
    assert "lightning_par.data_parallel.engine" in graph["lightning_par.axis_registry"]  # under TYPE_CHECKING


def test_no_import_circle_larger_than_two_modules(graph):
    big = [c for c in circles(graph) if len(c) > MAX_CIRCLE]
    assert not big, big


def test_the_registry_sits_below_parallelize(graph):
    assert "lightning_par.parallelize" not in graph["lightning_par.axis_registry"]
    assert "lightning_par.parallelize" not in graph["lightning_par.steps"]


#: The folders of the parallel axes: the runtime's layer, below the layout planner (which reads their terms).
AXIS_FOLDERS = ("data_parallel", "tensor_parallel", "pipeline_parallel", "context_parallel", "expert_parallel")


def test_no_axis_folder_imports_the_planner(graph):
    """The axes' planner terms read the shared formulas from below (``comm_cost``, ``state_cost``), never the planner:
    the planner depends on the axes, not the reverse."""
    axis_modules = [m for m in graph if m.count(".") and m.split(".")[1] in AXIS_FOLDERS]
    assert len(axis_modules) > 20  # the scan sees the axis folders
    upward = {m: sorted(t for t in graph[m] if t.startswith("lightning_par.planner")) for m in axis_modules}
    assert not {m: t for m, t in upward.items() if t}, upward


@pytest.mark.e2e  # a fresh interpreter (tests/README.md: a new interpreter is not the fast stage)
def test_importing_the_package_does_not_load_the_planner():
    """``import lightning_par`` (and composing a config) leaves the layout planner (4k+ lines) unloaded: checked in a
    fresh interpreter, since this test process may have imported it already."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import lightning_par\n"
        "after_package = sorted(m for m in sys.modules if m.startswith('lightning_par.planner'))\n"
        "import lightning_par.config.schema\n"
        "after_config = sorted(m for m in sys.modules if m.startswith('lightning_par.planner'))\n"
        "print(after_package, after_config)\n"
        "assert 'lightning_par.strategies' in sys.modules\n"  # the import did load the package's runtime
        "assert not after_package and not after_config, (after_package, after_config)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_config_names_the_planner_device_presets():
    from lightning_par.config.schema import DEVICE_PRESET_NAMES
    from lightning_par.planner.devices import DEVICE_PRESETS

    assert DEVICE_PRESET_NAMES == tuple(DEVICE_PRESETS)
