"""Which checkpoint a run resumes from: ``ckpt_path`` null / ``"last"`` / a path, and the latest complete one.

Checkpoints are the ones Lightning's ``ModelCheckpoint`` writes with ``filename="step-{step}"``: ``step-<N>.ckpt``
(``step-<N>-v<K>.ckpt`` when the name was taken), each a sharded directory (every lightning_par strategy writes one).
The latest *complete* one is the highest ``(N, K)`` that the format's own check accepts
(:func:`lightning_par.checkpoint.read_record`: DCP's ``.metadata``, written by the coordinator once every rank's shards
are written, ``meta.pt``, and a readable record of what wrote it, of a format this version reads).

Names with ``.tmp`` (staging directories, temporary files) and ``last.ckpt`` (a link to one of the step checkpoints)
are never candidates.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["CHECKPOINT_FILENAME", "checkpoint_step", "is_complete_checkpoint", "latest_checkpoint", "resolve_ckpt_path"]

#: ``ModelCheckpoint(filename=...)`` of the recipes (with ``auto_insert_metric_name=False``).
CHECKPOINT_FILENAME = "step-{step}"
_STEP_NAME = re.compile(r"^step-(\d+)(?:-v(\d+))?\.ckpt$")


def checkpoint_step(path: str | Path) -> tuple[int, int] | None:
    """``(step, version)`` from a ``step-<N>[-v<K>].ckpt`` name, or ``None`` for any other name."""
    m = _STEP_NAME.match(Path(path).name)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def is_complete_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a whole checkpoint this version can load (see the module docstring)."""
    from lightning_par.checkpoint import read_record

    try:
        read_record(path)
    except (FileNotFoundError, ValueError):
        return False
    return True


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The latest complete ``step-<N>.ckpt`` in ``directory``, or ``None`` (no directory, or nothing complete)."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    candidates = []
    for path in directory.iterdir():
        key = checkpoint_step(path)
        if key is not None and ".tmp" not in path.name and not path.is_symlink():
            candidates.append((key, path))
    for _, path in sorted(candidates, reverse=True):
        if is_complete_checkpoint(path):
            return path
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
        ValueError: ``"last"`` with no complete checkpoint in ``checkpoint_dir``, or a path that does not exist; the
            message names ``ckpt_path``, the value and what would be valid.
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
    from lightning_par.checkpoint import read_record  # the format's own check: torn, damaged, a file, too new

    try:
        read_record(path)
    except (FileNotFoundError, ValueError) as err:
        raise ValueError(f"ckpt_path={ckpt_path!r} is not valid: {err}") from None
    return path.resolve()
