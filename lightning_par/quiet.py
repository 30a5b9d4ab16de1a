"""Lines other libraries print on every rank of every run that tell a lightning_par user nothing they can act on,
filtered once, when ``lightning_par`` is imported (:func:`install`). Each entry names the line and why it is safe:

- torch 2.13's ``FutureWarning: `isinstance(treespec, LeafSpec)` is deprecated``: raised by Lightning's own
  ``lightning.pytorch.utilities._pytree`` (it builds a ``LeafSpec``), not by user code; Lightning has to change.
- Lightning 2.6's ``💡 Tip: For seamless cloud logging ... try installing [litlogger]``: an advertisement logged at
  INFO on every ``Trainer`` whose loggers are not a ``LitLogger``.

Nothing else is filtered: a warning about the user's own code or configuration still shows.
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["LEAFSPEC_DEPRECATION", "LITLOGGER_TIP", "install"]

#: The start of torch's deprecation message for ``LeafSpec`` (a regular expression for ``warnings.filterwarnings``).
LEAFSPEC_DEPRECATION = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
#: A substring of Lightning's litlogger tip.
LITLOGGER_TIP = "try installing [litlogger]"
#: Loggers Lightning's ``rank_zero_info`` writes through (fabric and pytorch each install their own).
_RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


def _not_a_tip(record: logging.LogRecord) -> bool:
    try:
        return LITLOGGER_TIP not in record.getMessage()
    except Exception:  # noqa: BLE001 - a record that cannot format is not ours to judge
        return True


def install() -> None:
    """Install the filters (idempotent: a second call adds nothing)."""
    warnings.filterwarnings("ignore", message=LEAFSPEC_DEPRECATION, category=FutureWarning)
    for name in _RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        if _not_a_tip not in logger.filters:
            logger.addFilter(_not_a_tip)
