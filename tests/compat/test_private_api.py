"""One register of private APIs: every private name of torch, Lightning, transformers or torchft that the package uses
is reached through :mod:`lightning_par.compat` (its submodules per library), read from the source with ``ast``.

A private name is one that starts with ``_`` (not a dunder). A use is

* an import of a module of those libraries with a private part, or of a private name from one
  (``from torch.optim._muon import ...``, ``from lightning.fabric.utilities.distributed import _init_dist_connection``);
* an attribute chain from a name bound to one of their modules with a private part (``torch._foreach_norm``,
  ``http_transport._IPv6HTTPServer``, ``torch._C._get_privateuse1_backend_name``);
* an attribute ``x._name`` (or ``getattr(x, "_name")``) of an object of theirs: ``_name`` is defined nowhere in the
  package (no function, class, assignment, argument or ``self._name = ...`` of ours has that name), so it is a private
  attribute of a foreign object (``trainer.fit_loop._data_fetcher``, ``optimizer._optimizer``). The standard
  library's few private names the package uses (``os._exit``, ``sys._current_frames``, ``pickle._Unpickler``) are
  listed in :data:`STDLIB`.

Uses inside ``lightning_par/compat/`` are the register. Any other fails this test unless it is in
:data:`NOT_YET_MOVED` (file, name) with the reason it is still where it is: a list that may only shrink. The register's
own canary tests (``tests/compat/test_compat.py``, :func:`test_every_registered_private_name_is_still_there`) fail with
the entry's library, place and checked versions when upstream moves a name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lightning_par"
REGISTER = PACKAGE / "compat"
LIBRARIES = ("torch", "lightning", "pytorch_lightning", "lightning_fabric", "transformers", "torchft")

#: Private names of the standard library (not in scope: no upstream of ours moves them).
STDLIB = frozenset({"_exit", "_current_frames", "_getframe", "_Unpickler"})

#: ``(path relative to the repository, private name) -> why it is not in the register yet``. Shrink only (empty since
#: issue 46 moved the last seven: ModelCheckpoint's save path, ``nn.Module._parameters``, torch's ParallelStyle hooks).
NOT_YET_MOVED: dict[tuple[str, str], str] = {}

#: Our own markers on foreign objects start with these (``planner._lp_path``, ``optimizer._lp_zero_init``).
OUR_PREFIXES = ("_lp_", "_lightning_par")


def _private(name: str) -> bool:
    dunder = name.startswith("__") and name.endswith("__")
    return name.startswith("_") and not dunder and not name.startswith(OUR_PREFIXES)


def _package_names() -> set[str]:
    """Every name the package defines: functions, classes, assigned names, arguments, keywords, ``self.x``/``cls.x``."""
    ours: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                ours.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                ours.add(node.id)
            elif isinstance(node, ast.arg):
                ours.add(node.arg)
            elif isinstance(node, ast.keyword) and node.arg:
                ours.add(node.arg)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                ours.add(node.attr)
    return ours


def _library_aliases(tree: ast.AST) -> set[str]:
    """Names bound to a module (or anything) imported from the libraries, in one file."""
    aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in LIBRARIES:
                    aliases.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in LIBRARIES:
            aliases.update(a.asname or a.name for a in node.names)
    return aliases


def _root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def private_uses(path: Path, tree: ast.AST, ours: set[str]) -> list[tuple[int, str, str]]:
    """``(line, private name, what)`` of every use of a private name of the libraries in one file."""
    aliases = _library_aliases(tree)
    uses: list[tuple[int, str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in LIBRARIES:
            for part in node.module.split("."):
                if _private(part):
                    uses.append((node.lineno, part, f"from {node.module} import ..."))
                    break
            else:
                uses.extend((node.lineno, a.name, f"from {node.module} import {a.name}")
                            for a in node.names if _private(a.name))
        elif isinstance(node, ast.Import):
            for a in node.names:
                private = [p for p in a.name.split(".") if _private(p)]
                if a.name.split(".")[0] in LIBRARIES and private:
                    uses.append((node.lineno, private[0], f"import {a.name}"))
        elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in STDLIB:
            if _root(node) in aliases or node.attr not in ours:
                uses.append((node.lineno, node.attr, ast.unparse(node)[:80]))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value) and node.args[1].value not in ours | STDLIB):
            uses.append((node.lineno, node.args[1].value, ast.unparse(node)[:80]))
    return uses


def census() -> dict[tuple[str, str], list[tuple[int, str]]]:
    """``(path, name) -> [(line, what), ...]`` over the package, outside the register."""
    ours = _package_names()
    out: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if REGISTER in path.parents:
            continue
        rel = path.relative_to(ROOT).as_posix()
        for line, name, what in private_uses(path, ast.parse(path.read_text(), str(path)), ours):
            out.setdefault((rel, name), []).append((line, what))
    return out


def test_the_scan_sees_each_kind_of_use() -> None:
    source = (
        "import torch\nimport torchft.manager as m\nfrom torch.optim._muon import X\n"
        "from lightning.fabric.utilities.distributed import _init_dist_connection, sync\n"
        "torch._foreach_norm(x)\nm._IPv6HTTPServer = 1\ntrainer.fit_loop._data_fetcher\n"
        "getattr(o, '_optimizer', o)\nself._ours\nos._exit(1)\n"
    )
    uses = private_uses(Path("x.py"), ast.parse(source), ours={"_ours"})
    assert sorted(name for _, name, _ in uses) == [
        "_IPv6HTTPServer", "_data_fetcher", "_foreach_norm", "_init_dist_connection", "_muon", "_optimizer",
    ]


@pytest.fixture(scope="module")
def found() -> dict[tuple[str, str], list[tuple[int, str]]]:
    """``census()`` once for the two tests below (it parses every package file: about 1.5 s of CPU); read only."""
    return census()


def test_private_names_go_through_the_register(found) -> None:
    outside = {f"{path}: {name} at " + ", ".join(f"{line} ({what})" for line, what in uses)
               for (path, name), uses in found.items() if (path, name) not in NOT_YET_MOVED}
    assert not outside, (
        "private names of torch/Lightning/transformers/torchft used outside lightning_par/compat/ (wrap each in the "
        "register with the versions it was checked on, and a canary):\n" + "\n".join(sorted(outside))
    )


def test_the_not_yet_moved_list_only_shrinks(found) -> None:
    stale = sorted(set(NOT_YET_MOVED) - set(found))
    assert not stale, f"moved or gone: remove them from NOT_YET_MOVED: {stale}"


def test_every_registered_private_name_is_still_there() -> None:
    """The canary of every entry of the Lightning, transformers and torchft registers (torch's own private names are
    checked by tests/compat/test_compat.py)."""
    import importlib

    from lightning_par.compat.register import REGISTER_MODULES, check_entry

    entries = [e for name in REGISTER_MODULES for e in importlib.import_module(name).PRIVATE_USES]
    assert len(entries) >= 30  # every module's entries are seen
    problems = [p for entry in entries for p in [check_entry(entry)] if p]
    problems = [p for p in problems if "is not installed" not in p]  # an optional library absent: not checked
    assert not problems, "\n".join(problems)


def test_the_canary_names_what_moved() -> None:
    from lightning_par.compat.register import PrivateName, check_entry

    moved = PrivateName("lightning", "lightning.pytorch.loops.fit_loop._FitLoop", "_no_such_fetcher", "instance",
                        "lightning 2.6.6", "data_fetcher")
    message = check_entry(moved)
    assert message is not None and "upstream moved" in message and "_no_such_fetcher" in message
    assert "wrapped by data_fetcher, checked on lightning 2.6.6" in message
    gone = PrivateName("lightning", "lightning.pytorch.no_such_module", "_x", "attribute", "lightning 2.6.6", "x")
    assert "upstream moved lightning.pytorch.no_such_module" in (check_entry(gone) or "")


def private_overrides() -> dict[tuple[type, str], list[str]]:
    """``(upstream class, private method) -> [our classes]`` for every method (function, property, static or class
    method) that a class of the package defines in its body under a private name that a base class of torch, Lightning,
    transformers or torchft defines too: an override of a private method, which the scan of accesses above cannot see
    (the name is defined in the package). Read from the imported classes; a module whose optional library is missing is
    passed over."""
    import importlib
    import inspect
    import pkgutil

    import lightning_par

    found: dict[tuple[type, str], list[str]] = {}
    for info in pkgutil.walk_packages(lightning_par.__path__, "lightning_par."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:
            continue
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__:
                continue
            for name, value in vars(cls).items():
                if not _private(name) or not (inspect.isfunction(value)
                                              or isinstance(value, (property, staticmethod, classmethod))):
                    continue
                for base in cls.__mro__[1:]:
                    if base.__module__.split(".")[0] in LIBRARIES and name in vars(base):
                        found.setdefault((base, name), []).append(f"{cls.__module__}.{cls.__qualname__}")
                        break
    return found


def test_every_override_of_a_private_method_is_in_the_register() -> None:
    """An override of an upstream private method stays in the subclass (it only works at the definition); the register
    holds its entry, whose canary says when upstream renames the method (the override would then silently never run)."""
    import importlib

    from lightning_par.compat.register import REGISTER_MODULES, _resolve

    registered = set()
    for name in REGISTER_MODULES:
        for entry in importlib.import_module(name).PRIVATE_USES:
            try:
                registered.add((_resolve(entry.owner), entry.name))
            except (ImportError, AttributeError):  # an optional library absent (its canary says so)
                continue
    overrides = private_overrides()
    assert any(name == "_apply" for _, name in overrides), overrides  # the scan sees torch's ParallelStyle overrides
    missing = {f"{base.__module__}.{base.__qualname__}.{name} (overridden by {', '.join(ours)})"
               for (base, name), ours in overrides.items() if (base, name) not in registered}
    assert not missing, ("private methods of torch/Lightning/transformers/torchft overridden outside the register "
                         "(add an entry with the versions checked on to lightning_par/compat/):\n"
                         + "\n".join(sorted(missing)))
