"""The Lightning loggers of the ``logger`` config group, with an install hint for the optional ones."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_par.config.instantiate import instantiate_entry, plain

__all__ = ["build_loggers", "check_loggers"]

log = logging.getLogger(__name__)

#: Logger class name -> (modules of which one must be importable, the pip extra that installs one).
_LOGGER_PACKAGES: dict[str, tuple[tuple[str, ...], str]] = {
    "TensorBoardLogger": (("tensorboard", "tensorboardX"), "tensorboard"),
    "WandbLogger": (("wandb",), "wandb"),
    "MLFlowLogger": (("mlflow",), "mlflow"),
}


#: Optional loggers already reported missing in this process (forked ranks inherit it: one warning per job).
_WARNED: set[str] = set()


def check_loggers(cfg: Any) -> list[str]:
    """The names of the ``logger`` entries that will be built, after checking that their packages are installed.

    An entry whose package is missing fails with an install hint, unless it says ``required: false`` (the default
    ``tensorboard`` entry): then it is skipped with a warning.

    Raises:
        ModuleNotFoundError: a required logger's package is missing (the message says what to install).
        ValueError: an entry without ``_target_``.
    """
    entries = plain(cfg.get("logger") or {}) if hasattr(cfg, "get") else {}
    names = []
    for name, node in entries.items():
        if node is None:
            continue
        target = node.get("_target_") if isinstance(node, Mapping) else None
        if not target:
            raise ValueError(f"logger.{name} has no _target_: expected a Lightning logger config such as logger=csv.")
        modules, extra = _LOGGER_PACKAGES.get(str(target).rsplit(".", 1)[-1], ((), ""))
        if modules and not any(importlib.util.find_spec(m) is not None for m in modules):
            hint = f"pip install 'lightning-par[{extra}]' or pip install {modules[0]}"
            if node.get("required", True):
                raise ModuleNotFoundError(
                    f"logger.{name} ({target}) needs the {modules[0]!r} package, which is not installed: {hint}, or "
                    f"leave it out of the logger list (logger=[csv])."
                )
            if name not in _WARNED:
                _WARNED.add(name)
                log.warning("logger.%s skipped: %s is not installed; %s.", name, " or ".join(modules), hint)
            continue
        names.append(name)
    return names


def build_loggers(cfg: Any, run_dir: str | Path) -> list[Any] | bool:
    """The Lightning loggers of the ``logger`` group; ``False`` (no logging) when it is empty.

    A logger whose ``save_dir`` is ``null`` writes into ``run_dir``.

    Raises:
        ModuleNotFoundError, ValueError: see :func:`check_loggers` and :func:`instantiate_entry`.
    """
    entries = plain(cfg.get("logger") or {})
    loggers = []
    for name in check_loggers(cfg):
        node = dict(entries[name])
        node.pop("required", None)
        if "save_dir" in node and node["save_dir"] is None:
            node["save_dir"] = str(run_dir)
        loggers.append(instantiate_entry(f"logger.{name}", node))
    return loggers or False
