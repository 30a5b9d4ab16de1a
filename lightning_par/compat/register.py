"""The entries of the register of private names (Lightning, transformers, torchft, and the torch methods that classes of
ours override, :data:`lightning_par.compat.PRIVATE_USES`; torch's other private names are
:data:`lightning_par.compat.PRIVATE_NAMES` and the helpers of :mod:`lightning_par.compat`) and their canary.

Each :class:`PrivateName` says where upstream keeps the name, how we use it, the versions it was checked on and the
helper of ours that wraps it. :func:`check_entry` is the canary: it looks the name up in the installed library without
running anything, and says in one line what moved (tests/compat/test_private_api.py runs it over every entry of :data:`REGISTER_MODULES`).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from dataclasses import dataclass

__all__ = ["REGISTER_MODULES", "PrivateName", "check_entry"]

#: The modules whose ``PRIVATE_USES`` make the register (beside torch's :data:`lightning_par.compat.PRIVATE_NAMES`).
REGISTER_MODULES: tuple[str, ...] = ("lightning_par.compat",) + tuple(
    f"lightning_par.compat.{name}" for name in ("fabric", "lightning", "transformers", "torchft")
)

#: How a name is looked up: an attribute of a module or class (``getattr``), or an instance attribute a class's
#: source assigns (``self.<name>`` in the source of the class or one of its bases: instances are not built here).
KINDS = ("attribute", "instance")


@dataclass(frozen=True)
class PrivateName:
    """One private name of an upstream library that the package uses.

    Attributes:
        library: the distribution (``"lightning"``, ``"transformers"``, ``"torchft"``).
        owner: the dotted path of the module or class that holds the name (``"lightning.pytorch.loops.fit_loop._FitLoop"``).
        name: the private name.
        kind: one of :data:`KINDS`.
        checked_on: the versions the use was checked on (``"lightning 2.6.6"``).
        helper: the function or name of ours that wraps it (the only place it is used).
    """

    library: str
    owner: str
    name: str
    kind: str
    checked_on: str
    helper: str


def _resolve(path: str) -> object:
    """The module or class at a dotted ``path`` (the longest importable module prefix, then attributes)."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def check_entry(entry: PrivateName) -> str | None:
    """``None`` when ``entry``'s name is where the entry says, else what is wrong (one line, naming the entry's
    helper and the versions it was checked on); ``"... is not installed"`` for an optional library that is absent."""
    where = f"{entry.owner}.{entry.name} ({entry.kind}; wrapped by {entry.helper}, checked on {entry.checked_on})"
    if importlib.util.find_spec(entry.library) is None:
        return f"{entry.library} is not installed: {where} not checked"
    try:
        owner = _resolve(entry.owner)
    except (ImportError, AttributeError) as err:
        return f"upstream moved {entry.owner}: {where}: {err}"
    if entry.kind == "attribute":
        found = hasattr(owner, entry.name)
    elif entry.kind == "instance":
        classes = inspect.getmro(owner) if inspect.isclass(owner) else (owner,)
        found = any(f"self.{entry.name}" in _source(c) for c in classes)
    else:
        return f"unknown kind {entry.kind!r} of {where}: expected one of {KINDS}"
    return None if found else f"upstream moved {where}: the installed {entry.library} has no {entry.name} there"


def _source(obj: object) -> str:
    try:
        return inspect.getsource(obj)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return ""
