"""Which checkpoint a run resumes from: ``ckpt_path`` null / ``"last"`` / a path, and the latest complete one.

Checkpoints are the ones Lightning's ``ModelCheckpoint`` writes with ``filename="step-{step}"``: ``step-<N>.ckpt``
(``step-<N>-v<K>.ckpt`` when the name was taken), each a sharded directory (every lightning_par strategy writes one).
The latest *complete* one is the highest ``(N, K)`` that the format's own check accepts
(:func:`lightning_par.checkpoint.verify_checkpoint`: DCP's ``.metadata``, written by the coordinator once every rank's
shards are written, ``meta.pt``, a readable record of what wrote it, of a format this version reads, and every file
the record lists there with its recorded size and CRC-32). A damaged newer checkpoint is skipped with a warning that
names it, the file and what is wrong; the run resumes from the newest intact one.

Names with ``.tmp`` (staging directories, temporary files) and ``last.ckpt`` (a link to one of the step checkpoints)
are never candidates.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "CHECKPOINT_FILENAME",
    "checkpoint_problem",
    "checkpoint_step",
    "is_complete_checkpoint",
    "latest_checkpoint",
    "resolve_ckpt_path",
]

#: ``ModelCheckpoint(filename=...)`` of the recipes (with ``auto_insert_metric_name=False``).
CHECKPOINT_FILENAME = "step-{step}"
log = logging.getLogger(__name__)
_STEP_NAME = re.compile(r"^step-(\d+)(?:-v(\d+))?\.ckpt$")


def checkpoint_step(path: str | Path) -> tuple[int, int] | None:
    """``(step, version)`` from a ``step-<N>[-v<K>].ckpt`` name, or ``None`` for any other name."""
    m = _STEP_NAME.match(Path(path).name)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def checkpoint_problem(path: str | Path) -> str | None:
    """Why ``path`` is not a whole checkpoint this version can load (the file and what is wrong with it), or
    ``None`` when it is (see the module docstring). Reads every file of the checkpoint once.

    Raises:
        lightning_par.checkpoint.safe.UnsafeCheckpointError: a checkpoint that would run code if loaded, or whose
            record names a file outside it: never skipped for an older one, always an error (it was tampered with).
    """
    from lightning_par.checkpoint import verify_checkpoint
    from lightning_par.checkpoint.safe import UnsafeCheckpointError

    try:
        verify_checkpoint(path)
    except UnsafeCheckpointError:
        raise
    except (FileNotFoundError, ValueError) as err:
        return str(err)
    return None


def is_complete_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a whole checkpoint this version can load (see the module docstring)."""
    return checkpoint_problem(path) is None


def _warn_skipped(path: Path, problem: str) -> None:
    log.warning("Skipping checkpoint %s: %s", path, problem)


def latest_checkpoint(
    directory: str | Path, on_skip: Callable[[Path, str], None] | None = _warn_skipped
) -> Path | None:
    """The latest complete ``step-<N>.ckpt`` in ``directory``, or ``None`` (no directory, or nothing complete).

    Args:
        directory: where the checkpoints are.
        on_skip: called with each newer checkpoint passed over and why (by default a logged warning); ``None``: quiet.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return None
    candidates = []
    for path in directory.iterdir():
        key = checkpoint_step(path)
        if key is not None and ".tmp" not in path.name and not path.is_symlink():
            candidates.append((key, path))
    for _, path in sorted(candidates, reverse=True):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        if on_skip is not None:
            on_skip(path, problem)
    return None


def resolve_ckpt_path(ckpt_path: str | None, checkpoint_dir: str | Path) -> Path | None:
    """The checkpoint to resume from, following Lightning's ``fit(ckpt_path=...)`` convention.

    Args:
        ckpt_path: ``None`` (the latest complete checkpoint in ``checkpoint_dir`` if there is one, else a fresh
            start: what a restarted or requeued job needs), ``"last"`` (the same, but there must be one) or the path
            of a checkpoint file or directory (``~`` expanded).
        checkpoint_dir: where this run writes its checkpoints.

    Returns:
        The checkpoint path, or ``None`` to start from scratch.

    Raises:
        ValueError: ``"last"`` with no complete checkpoint in ``checkpoint_dir``, a path that does not exist, or one
            that is not a whole checkpoint (torn, damaged: the message names the file and what is wrong with it); the
            message names ``ckpt_path``, the value and what would be valid.
        lightning_par.checkpoint.safe.UnsafeCheckpointError: (a ``ValueError``) a checkpoint that would run code if
            loaded (the newest of the directory included: it is refused, not skipped), naming the file and global.
    """
    if ckpt_path is None:
        return latest_checkpoint(checkpoint_dir)
    if ckpt_path == "last":
        found = latest_checkpoint(checkpoint_dir)
        if found is None:
            raise ValueError(
                f"ckpt_path='last' is not valid here: there is no complete checkpoint (step-<N>.ckpt) in "
                f"{str(checkpoint_dir)!r}. Expected a run directory with checkpoints (hydra.run.dir=<that run>), the "
                f"path of a checkpoint, or ckpt_path=null to start from scratch."
            )
        return found
    path = Path(ckpt_path).expanduser()
    if not path.exists():
        raise ValueError(
            f"ckpt_path={ckpt_path!r} is not valid: it does not exist. Expected null, 'last' or the path of a "
            f"checkpoint (a .ckpt file or a sharded checkpoint directory)."
        )
    from lightning_par.checkpoint.safe import UnsafeCheckpointError

    try:
        problem = checkpoint_problem(path)  # the format's own check: torn, damaged, a file, too new, unsafe
    except UnsafeCheckpointError as err:
        raise ValueError(f"ckpt_path={ckpt_path!r} is not valid: {err}") from None
    if problem is not None:
        raise ValueError(f"ckpt_path={ckpt_path!r} is not valid: {problem}")
    return path.resolve()
