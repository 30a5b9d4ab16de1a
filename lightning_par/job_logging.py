"""Python logging of the worker processes into the Hydra job's log file (``<run dir>/train.log``).

Hydra configures the root logger of the job process (a console handler and a file handler on
``<output dir>/<job name>.log``). Two things kept Lightning's messages out of that file: Lightning gives its
``lightning.pytorch`` / ``lightning.fabric`` loggers their own console handler and stops propagation when it is
imported before any root handler exists (which is the case: the recipe imports Lightning before Hydra starts), and a
worker started with ``spawn`` has no handlers at all. :func:`attach_job_log`, called first thing in each worker, fixes
both.
"""

from __future__ import annotations

import logging

__all__ = ["JOB_LOG_ENV", "attach_job_log", "job_log_file"]

#: Environment variable through which the job process tells its workers where the job's log file is.
JOB_LOG_ENV = "LP_JOB_LOG"

#: Hydra's default job-logging format.
_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"

#: Loggers to which Lightning gives a console handler of its own at import (and detaches from the root logger).
_LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric")


def job_log_file() -> str | None:
    """Path of the root logger's first file handler (Hydra's ``<output dir>/<job name>.log``), or ``None``."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            return handler.baseFilename
    return None


def attach_job_log(path: str | None) -> None:
    """Make this process's Python logging, Lightning's included, reach the job's log file.

    Adds a file handler on ``path`` to the root logger unless one is already there (a forked worker inherits the
    job's; a new handler also sets the root level to INFO, Hydra's default), and re-attaches Lightning's loggers to the root logger
    (their own console handler is removed, so every message is printed once, by the root's handlers).

    Args:
        path: the job's log file (see :func:`job_log_file`); ``None`` only re-attaches Lightning's loggers.
    """
    root = logging.getLogger()
    if path is not None and path != job_log_file():
        handler = logging.FileHandler(path, mode="a")
        handler.setFormatter(logging.Formatter(_FORMAT))
        root.addHandler(handler)
        root.setLevel(logging.INFO)  # Hydra's default job level; a spawned worker starts at WARNING
    if not root.handlers:
        return
    for name in _LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if type(handler) is logging.StreamHandler:
                logger.removeHandler(handler)
        logger.propagate = True
