"""docs/architecture.md, "Adding a parallelism": the context-parallel axis, as the example of an axis added on the registry, is
named in code only inside its own folder and in the files that page lists (at most 6).

The check reads the code (not docstrings or comments) of every module of ``lightning_par`` with ``ast``: identifiers,
attribute and keyword names, imports and string constants that name the cp axis, its sizes, options or formulas.
Names of the derived meshes (``dp_cp``, ``dp_shard_cp``: :data:`lightning_par.parallel_dims.DERIVED_MESHES`) are the
mesh module's vocabulary, asked for by name, and are not counted.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path


import lightning_par
from lightning_par.parallel_dims import DERIVED_MESHES

PACKAGE = Path(lightning_par.__file__).parent
ROOT = PACKAGE.parent
PAGE = ROOT / "docs" / "architecture.md"

#: What the axis's own work is made of, outside which nothing names it: its folder; the models that follow the
#: contract (the reference GPT and the Hugging Face adapter are models, not the framework); its benchmark.
OWN = ("lightning_par/context_parallel/", "lightning_par/models/", "lightning_par/hf/",
       "lightning_par/benchmarks/context_parallel.py")

#: A name of the cp axis: its size, switch, option group, options, methods, attention formulas.
CP_NAME = re.compile(r"(^|_)cp(_|$)|context_parallel|ContextParallel|CP_METHODS|ring_attention|ulysses", re.IGNORECASE)


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _names(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.arg):
        return [node.arg]
    if isinstance(node, ast.keyword) and node.arg:
        return [node.arg]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.alias):
        return [node.name, node.asname or ""]
    if isinstance(node, ast.ImportFrom):
        return [node.module or ""]
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    return []


def cp_mentions(path: Path) -> list[tuple[int, str]]:
    """``(line, name)`` of every mention of the cp axis in ``path``'s code."""
    tree = ast.parse(path.read_text())
    docs = _docstrings(tree)
    out = []
    for node in ast.walk(tree):
        if id(node) in docs:
            continue
        for name in _names(node):
            words = [w for w in re.split(r"[^A-Za-z0-9_]+", name) if w]  # a string may hold a path or a sentence
            if any(CP_NAME.search(w) and w not in DERIVED_MESHES for w in words):
                out.append((getattr(node, "lineno", 0), name if len(name) < 60 else name[:57] + "..."))
    return out


def listed_files() -> list[str]:
    """The numbered files of the "Adding a parallelism" list of docs/architecture.md."""
    text = PAGE.read_text()
    section = text.split("## Adding a parallelism", 1)[1].split("\n#", 1)[0]
    return re.findall(r"^\d+\. `(lightning_par/[^`]+)`", section, flags=re.MULTILINE)


def test_the_docs_list_at_most_six_files():
    files = listed_files()
    assert 0 < len(files) <= 6, files
    for f in files:
        assert (ROOT / f).is_file(), f


#: Modules that name the cp axis today although the page's list does not include them (2026-11-27): the attention a
#: checkpointed block recomputes under cp (activation_checkpointing), packed documents' masks under cp (data.doc_mask,
#: the runtime's step, lightning_par.runtime.step, through the contract's ``context_parallel_attention``; it was
#: lightning_par/steps.py's before the runtime took the step), and the token-weighted loss of dp
#: replicas composed with cp's (data_parallel.axis, data_parallel.token_mean). Each should reach cp through the axis
#: registry (a recompute context, a token group) instead; until then they are listed here, so a NEW mention elsewhere
#: still fails. Since issue 45 also the register of the step's host reads (profiling.host_syncs, docs/host-syncs.md is
#: generated from it), whose rows say under which layout, cp's among them, each read happens; the rows could come from
#: each axis's folder through the registry instead.
CROSS_CUTTING = {
    "lightning_par/activation_checkpointing.py", "lightning_par/data/doc_mask.py", "lightning_par/data_parallel/axis.py",
    "lightning_par/data_parallel/token_mean.py", "lightning_par/pipeline_parallel/steps.py", "lightning_par/runtime/step.py",
    "lightning_par/profiling/host_syncs.py",
}


def test_the_cp_axis_is_named_only_in_its_folder_and_the_listed_files():
    allowed = set(listed_files()) | CROSS_CUTTING
    outside = {}
    for path in sorted([*PACKAGE.rglob("*.py"), *(ROOT / "recipes").glob("*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(OWN) or rel in allowed:
            continue
        found = cp_mentions(path)
        if found:
            outside[rel] = found
    assert not outside, "\n".join(f"{f}: {m}" for f, m in outside.items())


def test_the_check_finds_a_mention():
    """The check can fail: a module naming the axis is found."""
    found = cp_mentions(PACKAGE / "context_parallel" / "axis.py")
    assert any(name == "cp_size" for _, name in found), found


# ---------------------------------------------------------------------------------------------------- every axis
#: The two host adapters (Lightning's Strategy, Fabric's Strategy): they translate their host's hooks and must not
#: decide anything per axis; every axis-specific choice is made by the axis's folder through the registry (the
#: registry presets may set defaults, which are data, not conditions: their module, runtime/presets.py, is held to the
#: same rule).
ADAPTERS = ("lightning_par/strategies/", "lightning_par/fabric/", "lightning_par/runtime/presets.py")

#: Conditions on an axis that the adapters still hold, each with its reason and owner (may only shrink; empty since
#: Fabric's step, with its token mean over dp, moved into lightning_par/runtime/).
ADAPTER_AXIS_CONDITIONS: set[tuple[str, str]] = set()


def _axis_word() -> re.Pattern[str]:
    """Every name of an axis: the mesh axes, the derived meshes, the registered axes, their size fields and
    ``<axis>_enabled`` switches."""
    from lightning_par.axes import AXES
    from lightning_par.parallel_dims import MESH_AXES, ParallelDims

    axes = {*MESH_AXES, *DERIVED_MESHES, *(a.name for a in AXES if a.size_fields)}
    words = axes | set(ParallelDims.size_names()) | {f"{a}_enabled" for a in axes}
    return re.compile("|".join(sorted(map(re.escape, words), key=len, reverse=True)))


def _conditions(tree: ast.AST) -> list[ast.AST]:
    out: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
            out.append(node.test)
        elif isinstance(node, ast.comprehension):
            out.extend(node.ifs)
        elif isinstance(node, (ast.Compare, ast.BoolOp, ast.match_case)):
            out.append(node)
    return out


def axis_conditions(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of every axis name (a size, a mesh axis, a switch: as an identifier, attribute, keyword or
    string) inside a condition (``if``/``while``/``assert``/conditional expression/comprehension filter, a comparison
    or boolean operation, a ``match`` case) of ``source``."""
    word = _axis_word()
    found = set()
    for cond in _conditions(ast.parse(source)):
        for node in ast.walk(cond):
            for name in _names(node):
                if word.fullmatch(name):
                    found.add((getattr(cond, "lineno", getattr(node, "lineno", 0)), name))
    return sorted(found)


def test_no_adapter_branches_on_an_axis():
    """Issue 46: neither adapter branches on an axis (pp, dp_replicate, dp_shard, cp, tp, ep, dp): no condition on an
    axis's name or size in ``lightning_par/strategies/`` or ``lightning_par/fabric/``, nor in the presets they take
    (``lightning_par/runtime/presets.py``)."""
    outside = {}
    for folder in ADAPTERS:
        target = ROOT / folder
        assert target.exists(), folder
        for path in sorted(target.rglob("*.py")) if target.is_dir() else [target]:
            rel = path.relative_to(ROOT).as_posix()
            found = [(line, name) for line, name in axis_conditions(path.read_text())
                     if (rel, name) not in ADAPTER_AXIS_CONDITIONS]
            if found:
                outside[rel] = found
    assert not outside, "\n".join(f"{f}: {m}" for f, m in outside.items())


def test_the_listed_adapter_conditions_are_still_there():
    """The allow-list only shrinks: an entry whose condition is gone must be removed."""
    for rel, name in ADAPTER_AXIS_CONDITIONS:
        assert any(n == name for _, n in axis_conditions((ROOT / rel).read_text())), (rel, name)


def test_the_axis_condition_check_finds_each_axis():
    """The check can fail, for every axis: a size test, a switch, a mesh name compared and a size in a filter."""
    for axis in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "dp"):
        src = (f"if dims.{axis}_size > 1:\n    pass\n"
               f"x = 1 if dims.{axis}_enabled else 2\n"
               f"y = name == {axis!r}\n"
               f"z = [k for k in sizes if k != '{axis}_size']\n")
        names = {n for _, n in axis_conditions(src)}
        assert names == {f"{axis}_size", f"{axis}_enabled", axis}, (axis, names)
    assert axis_conditions("sizes = {'tp_size': 2}\nmesh = dims.group('tp')\n") == []  # data, not conditions
