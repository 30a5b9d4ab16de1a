"""The runtime under two thin adapters (issue 46), read from the source with ``ast``: every import statement counts
(module level, inside functions, under ``if TYPE_CHECKING``).

* ``lightning_par/runtime/`` imports neither adapter (``lightning_par.strategies``, ``lightning_par.fabric``), nor
  ``lightning.pytorch`` (the Trainer package), nor the layout planner.
* ``lightning_par/fabric/`` imports neither ``lightning.pytorch`` nor ``lightning_par.strategies``, as Lightning's own
  Fabric never imports its Trainer package.
* the adapters stay thin: ``fabric/strategy.py`` at most 400 lines, ``fabric/`` at most 500 in all; the Lightning
  ``Strategy`` (``strategies/base.py``) at most 400 lines, ``strategies/`` at most 500 in all (issue 46: the presets
  only set defaults, in ``runtime/presets.py``; what each strategy does is told in ``docs/strategies.md``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_par"

#: folder -> the module prefixes it must not import.
FORBIDDEN = {
    "runtime": ("lightning_par.strategies", "lightning_par.fabric", "lightning.pytorch", "pytorch_lightning",
                "lightning_par.planner"),
    "fabric": ("lightning.pytorch", "pytorch_lightning", "lightning_par.strategies"),
}
#: (path relative to lightning_par/, the most lines it may have); a folder counts all its ``.py`` files.
LINE_BOUNDS = (("fabric/strategy.py", 400), ("fabric", 500), ("strategies/base.py", 400), ("strategies", 500))


def imported(path: Path, text: str | None = None) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``path`` (or in ``text``, read as if it were at ``path``; relative
    imports resolved; ``from a import b`` gives both ``a`` and ``a.b``, since ``b`` may be a module)."""
    package = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text() if text is None else text, str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            out += [(node.lineno, base)] + [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def violations(folder: str) -> list[str]:
    found = []
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        for line, name in imported(path):
            if any(name == p or name.startswith(p + ".") for p in FORBIDDEN[folder]):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {name}")
    return found


def test_the_check_sees_lazy_and_relative_imports() -> None:
    source = "def f():\n    import lightning.pytorch as pl\n    from ..strategies import base\n"
    names = [n for _, n in imported(PACKAGE / "fabric" / "strategy.py", source)]
    assert "lightning.pytorch" in names and "lightning_par.strategies.base" in names


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_the_folder_imports_no_higher_layer(folder: str) -> None:
    assert (PACKAGE / folder).is_dir()
    found = violations(folder)
    assert not found, "\n".join(found)


@pytest.mark.parametrize(("path", "bound"), LINE_BOUNDS)
def test_the_adapters_are_thin(path: str, bound: int) -> None:
    target = PACKAGE / path
    files = sorted(target.rglob("*.py")) if target.is_dir() else [target]
    lines = sum(len(f.read_text().splitlines()) for f in files)
    assert 0 < lines <= bound, f"lightning_par/{path}: {lines} lines (at most {bound})"
