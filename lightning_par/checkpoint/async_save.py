"""Checkpoints written in the background (``torch.distributed.checkpoint.async_save``), committed atomically later.

:func:`start_async_save` copies this rank's tensors (the local shards of DTensors; DCP's default stager cannot
deep-copy every engine's DTensors) so training may change the parameters as soon as it returns, writes ``meta.pt`` on rank 0 at once, and hands the shard writes to a background
thread. The background save coordinates the ranks over its own gloo process group, so it never shares a collective
stream with training. The checkpoint stays in its staging directory (``<name>.tmp-staging``, never a resume candidate)
until :meth:`PendingSave.commit`, called on every rank at a step boundary once every rank's writes are done, writes
the commit record (with every file's size and CRC-32) and renames the directory into place. A process killed before
then leaves only the staging directory: an interrupted background save never becomes the newest checkpoint.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from lightning_par.checkpoint.atomic import commit_checkpoint_dir, staging_dir
from lightning_par.checkpoint.sharded import METADATA_FILENAME, save_file, split_tensors, write_record

__all__ = ["PendingSave", "snapshot", "start_async_save"]


def snapshot(state: Any) -> Any:
    """A copy of a nested dict/list of tensors that later in-place updates do not reach: every tensor cloned (a
    DTensor as a DTensor over a clone of its local shard, same mesh, placements and global shape); other values
    kept as they are. Memory: this rank's part of the state once more, in bytes."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        local = state.to_local().detach().clone()
        return DTensor.from_local(local, state.device_mesh, state.placements, run_check=False, shape=state.shape,
                                  stride=state.stride())
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: snapshot(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(snapshot(v) for v in state)
    return state


class _AlreadyStaged:
    """A DCP ``AsyncStager`` for a state that :func:`snapshot` has copied already: staging is the identity."""

    should_synchronize_after_execute = False

    def stage(self, state_dict: Any) -> Any:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class PendingSave:
    """A checkpoint whose shards are being written in the background (see the module docstring)."""

    def __init__(
        self, path: Path, future: Future, record: dict[str, Any], is_rank0: bool, barrier: Callable[[], None]
    ) -> None:
        self.path, self._future, self._record = path, future, record
        self._is_rank0, self._barrier = is_rank0, barrier
        self._after_commit: list[Callable[[], None]] = []

    def after_commit(self, action: Callable[[], None]) -> None:
        """Run ``action`` (on this rank) once the checkpoint is committed; never if the save fails. E.g. pointing
        ``last.ckpt`` at it: a link must never name a checkpoint that is not in place."""
        self._after_commit.append(action)

    def done(self) -> bool:
        """Whether this rank's background writes have finished (successfully or not); no communication."""
        return self._future.done()

    def commit(self) -> None:
        """Wait for this rank's writes, then write the record and rename the checkpoint into place. Collective: every
        rank calls it.

        Raises:
            Exception: what the background save raised (e.g. ``CheckpointException`` for a full disk); the staging
                directory is then removed on rank 0 and nothing is committed.
        """
        staged = staging_dir(self.path)
        try:
            self._future.result()
            if self._is_rank0:
                write_record(staged, self._record)
        except BaseException:
            if self._is_rank0:
                shutil.rmtree(staged, ignore_errors=True)
            raise
        commit_checkpoint_dir(self.path, self._barrier, self._is_rank0)
        actions, self._after_commit = self._after_commit, []
        for action in actions:
            action()


def start_async_save(
    path: str | Path,
    checkpoint: dict[str, Any],
    record: dict[str, Any],
    *,
    is_rank0: bool,
    barrier: Callable[[], None],
    process_group: Any,
) -> PendingSave:
    """Start writing a Lightning checkpoint dict (as :func:`~lightning_par.checkpoint.save_sharded` takes it) in the
    background. Collective: every rank of the default group calls it.

    Args:
        path: the checkpoint directory, in place once :meth:`PendingSave.commit` returns.
        checkpoint: ``{"state_dict": ..., "optimizer_states": [...], **metadata}``; consumed. Its tensors are copied
            before this returns.
        record: what wrote it, for the commit record.
        is_rank0: whether this rank writes ``meta.pt`` and the record and commits.
        barrier: waits for every rank (on the training process group).
        process_group: a group with a CPU backend (gloo) used only by background saves.

    Returns:
        The save in flight; call :meth:`PendingSave.commit` on every rank to finish it.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    staged = staging_dir(path)
    if is_rank0 and staged.exists():
        shutil.rmtree(staged)
    barrier()
    staged.mkdir(parents=True, exist_ok=True)
    tensors = snapshot(split_tensors(checkpoint))
    try:
        if is_rank0:
            save_file(checkpoint, staged / METADATA_FILENAME)
        future = dcp.async_save(
            tensors,
            storage_writer=dcp.FileSystemWriter(staged, overwrite=True),
            process_group=process_group,
            async_stager=_AlreadyStaged(),
        )
    except BaseException:
        if is_rank0:
            shutil.rmtree(staged, ignore_errors=True)
        raise
    return PendingSave(path, future, record, is_rank0, barrier)
