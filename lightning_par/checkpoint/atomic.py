"""Crash-safe checkpoint directories: write into a temporary sibling, rename into place once every rank is done.

A sharded checkpoint is written by every rank at once (``torch.distributed.checkpoint``); a crash in the middle (a
killed rank, a full disk) would leave a directory with some shards missing. Writing into ``<name>.tmp-<n>`` next to
the target and renaming it only after all ranks finished (a barrier) makes the update all-or-nothing as far as the
file system allows: ``rename`` is atomic on POSIX within a file system, and the previous checkpoint is moved aside
just before and deleted only after the new one is in place (Megatron-LM and torchtitan commit checkpoints the same
way, with a marker file or a final rename).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

__all__ = ["commit_checkpoint_dir", "remove_leftovers", "staging_dir"]


def staging_dir(path: str | Path) -> Path:
    """The temporary directory a checkpoint for ``path`` is written into before :func:`commit_checkpoint_dir`."""
    path = Path(path)
    return path.with_name(f"{path.name}.tmp-staging")


def remove_leftovers(directory: str | Path) -> list[Path]:
    """Remove what interrupted saves left in ``directory``: every ``<name>.tmp-staging`` (a save killed, or failed
    on a full disk, before it committed: never loadable), and every ``<name>.tmp-old`` whose ``<name>`` is in place
    (a commit killed after its rename). A ``<name>.tmp-old`` without ``<name>`` is the only copy of that checkpoint
    and is kept. Call it on one rank before any save of the run.

    Returns:
        The paths removed.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for leftover in sorted(directory.iterdir()):
        name = leftover.name
        stale = name.endswith(".tmp-staging") or (
            name.endswith(".tmp-old") and leftover.with_name(name[: -len(".tmp-old")]).exists()
        )
        if stale and not leftover.is_symlink():
            shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
            removed.append(leftover)
    return removed


def commit_checkpoint_dir(path: str | Path, barrier: Callable[[], None], is_rank0: bool) -> None:
    """Replace ``path`` by its fully written :func:`staging_dir`. Collective: every rank calls it after writing.

    Args:
        path: the checkpoint's final location (a directory or file there is replaced).
        barrier: waits for every rank (all must have finished writing before the rename).
        is_rank0: the one rank that renames.

    Raises:
        FileNotFoundError: on rank 0, the staging directory does not exist.
    """
    path = Path(path)
    staged = staging_dir(path)
    barrier()
    if is_rank0:
        if not staged.is_dir():
            raise FileNotFoundError(f"no staged checkpoint at {str(staged)!r} to commit to {str(path)!r}.")
        old = path.with_name(f"{path.name}.tmp-old")
        if old.exists():
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        if path.exists():
            path.rename(old)  # the previous checkpoint stays whole until the new one is in place
        staged.rename(path)
        if old.exists():
            shutil.rmtree(old) if old.is_dir() else old.unlink()
    barrier()
