"""docs/adding-an-optimizer.md: a new optimizer touches at most 4 package files (issue 46).

Muon, the example in the package, is named in code (not docstrings or comments) only inside the files the page lists
for a new optimizer, plus two extras that are Muon's own and not the registry's: its benchmark section, and the
private-API register's entry for torch's Newton-Schulz (``torch.optim._muon``). The hosts (the reference GPT, the
Hugging Face module), the recipe's schemas and the strategies name no optimizer. The demonstration from outside the
package (no package file at all) is ``tests/optim/test_demo_optimizer.py``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import lightning_par

PACKAGE = Path(lightning_par.__file__).parent
PAGE = PACKAGE.parent / "docs" / "adding-an-optimizer.md"

#: Files naming Muon beyond the page's list, and why.
EXTRAS = {
    "lightning_par/benchmarks/muon.py": "Muon's benchmark section (recipes/benchmark.py --only muon), optional",
    "lightning_par/compat/__init__.py": "the private-API register: torch.optim._muon, which Muon calls",
}


def code_names(path: Path) -> set[str]:
    """Identifiers, attribute, argument and keyword names, imports and string constants of ``path``'s code
    (docstrings left out; comments are not in the tree)."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in docs:
            continue
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, (ast.keyword, ast.arg)) and getattr(node, "arg", None):
            names.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.alias):
            names.update({node.name, node.asname or ""})
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
    return names


def listed_files() -> list[str]:
    """The package files of the page's table "The files a new optimizer touches", ``<name>`` read as ``muon``."""
    section = PAGE.read_text().split("## The files a new optimizer touches", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| \d+ \| `([^`]+)` \|", section, re.MULTILINE)
    return [row.replace("<name>", "muon") for row in rows]


def test_a_new_optimizer_touches_at_most_four_package_files():
    files = listed_files()
    assert 2 <= len(files) <= 4, files
    assert all(f.startswith("lightning_par/") for f in files)
    naming = sorted(str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")
                    if any(re.search("muon", n, re.IGNORECASE) for n in code_names(p)))
    assert set(naming) - set(EXTRAS) <= set(files), sorted(set(naming) - set(EXTRAS) - set(files))
    assert set(EXTRAS) <= set(naming)  # an extra that no longer names Muon leaves this list


def test_an_import_path_is_looked_up_never_imported():
    """A checkpoint's hyper-parameters may name the optimizer: an import path is only looked up among the modules the
    program imported, so naming one never runs a module's code."""
    import sys

    import pytest

    from lightning_par.optim.registry import optimizer_entry

    name = "lightning_par_never_imported_module_xyz"
    with pytest.raises(ValueError, match="no imported module 'lightning_par_never_imported_module_xyz'"):
        optimizer_entry(f"{name}:ENTRY", "GPTLightningModule")
    assert name not in sys.modules
    with pytest.raises(ValueError, match="not an OptimizerEntry"):
        optimizer_entry("sys:path")
