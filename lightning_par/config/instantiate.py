"""Build a config group entry from its ``_target_`` with ``hydra.utils.instantiate``, its keys checked first."""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

__all__ = ["instantiate_entry", "plain"]

#: Keys ``hydra.utils.instantiate`` reads itself; never passed to the target.
_HYDRA_KEYS = frozenset({"_target_", "_args_", "_convert_", "_recursive_", "_partial_"})


def plain(cfg: Any) -> dict[str, Any]:
    """``cfg`` as a plain ``dict`` (interpolations resolved); a mapping is copied."""
    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)


def _target_of(group: str, node: Mapping[str, Any]) -> Any:
    """The object ``node["_target_"]`` names, imported.

    Raises:
        ValueError: ``_target_`` is missing or cannot be imported.
    """
    target = node.get("_target_") if isinstance(node, Mapping) else None
    if target is None or target == "???":
        raise ValueError(
            f"{group}._target_ is missing: {group}=custom needs {group}._target_=my_pkg.MyClass (a class or function "
            f"importable from PYTHONPATH), plus its arguments as +{group}.KEY=VALUE."
        )
    if not isinstance(target, str):
        return target
    from hydra.utils import get_object

    try:
        return get_object(target)
    except Exception as err:  # noqa: BLE001 - Hydra wraps import failures in several exception types
        raise ValueError(
            f"{group}._target_={target!r} cannot be imported ({err}): expected a dotted path to a class or function "
            f"on PYTHONPATH (the current directory is {os.getcwd()})."
        ) from err


def _check_arguments(group: str, target: Any, node: Mapping[str, Any]) -> None:
    """Refuse keys of ``node`` that ``target`` does not accept (unless it takes ``**kwargs``).

    Raises:
        ValueError: an unknown key, naming it and the valid ones.
    """
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):  # builtins and C types without a signature: let the call decide
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    valid = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = sorted(set(node) - _HYDRA_KEYS - set(valid))
    if unknown:
        name = getattr(target, "__qualname__", repr(target))
        raise ValueError(
            f"{group}.{unknown[0]}={node[unknown[0]]!r} is not valid: {name} takes no argument {unknown[0]!r}; "
            f"valid keys are {sorted(valid)}."
        )


def instantiate_entry(group: str, node: Any, **kwargs: Any) -> Any:
    """Build a config group entry (``model``, ``data``, a logger) from its ``_target_`` with ``hydra.utils.instantiate``.

    The entry's keys are checked against the target's signature first, so a typo (``+model.hiden=512``) is a
    ``ValueError`` naming the key and the valid ones instead of a ``TypeError`` deep in a worker. Containers reach the
    target as plain ``dict``/``list`` (``_convert_="all"``), nested entries with a ``_target_`` are built too.

    Args:
        group: the entry's place in the config, for messages (``"model"``, ``"logger.csv"``).
        node: the entry (a ``DictConfig`` or a plain mapping) with a ``_target_``.
        **kwargs: arguments that replace the entry's own (e.g. a ``block_size`` taken from the model).

    Raises:
        ValueError: no ``_target_``, a target that cannot be imported, an argument the target does not take, or the
            target's own ``ValueError`` for a bad value (re-raised as it is: Hydra wraps it in an
            ``InstantiationException``, which would hide the message's type from callers that check for bad input).
    """
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    entry = plain(node)
    target = _target_of(group, entry)
    entry.update(kwargs)
    _check_arguments(group, target, entry)
    try:
        return instantiate(entry, _convert_="all")
    except InstantiationException as err:
        if isinstance(err.__cause__, ValueError):
            raise err.__cause__ from None
        raise
