"""Sharded checkpoints that reshard: save at any ZeRO stage and dp size, load into any other or into one process.

Format (a directory, written with ``torch.distributed.checkpoint`` (DCP), the layout of Lightning's
``ModelParallelStrategy``): the tensors ``{"state_dict": {name: tensor}, "optimizer_0": {"state": {name: {key:
tensor}}, "param_groups": [...]}, ...}`` as DCP shards (each rank writes the parts it owns; a tensor replicated on
several ranks is written once), plus ``meta.pt``, rank 0's ``torch.save`` of everything else Lightning puts in a
checkpoint (loops, LR schedulers, callbacks, hyper-parameters).

Every stage keys tensors by parameter name and keeps sharded tensors as ``Shard(0)`` DTensors of their full shape
(FSDP2's layout, which stages 1 and 2 share, see :mod:`lightning_par.data_parallel.shard_layout`), so DCP reads any
saved layout into any requested one: another dp size, another stage, or plain full tensors in a single process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["METADATA_FILENAME", "is_sharded_checkpoint", "load_model_weights", "load_sharded", "save_sharded"]

#: Name of the non-tensor part of a checkpoint (the name Lightning's ``ModelParallelStrategy`` uses).
METADATA_FILENAME = "meta.pt"


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a directory written by :func:`save_sharded`."""
    path = Path(path)
    return path.is_dir() and (path / METADATA_FILENAME).is_file()


def save_sharded(path: str | Path, checkpoint: dict[str, Any], is_rank0: bool) -> None:
    """Write a Lightning checkpoint dict whose ``"state_dict"`` and ``"optimizer_states"`` hold sharded tensors.

    Collective: every rank of the default group calls it with its own shards. ``checkpoint`` is consumed (its
    ``state_dict`` and ``optimizer_states`` entries are popped).

    Args:
        path: the checkpoint directory (created; a file of that name is replaced).
        checkpoint: ``{"state_dict": ..., "optimizer_states": [...], **metadata}``.
        is_rank0: whether this rank writes ``meta.pt``.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    if path.is_file():
        path.unlink()
    path.mkdir(parents=True, exist_ok=True)
    tensors = {"state_dict": checkpoint.pop("state_dict")}
    for i, state in enumerate(checkpoint.pop("optimizer_states", [])):
        tensors[f"optimizer_{i}"] = state
    # An explicit writer: replacing an older checkpoint of the same name (``last.ckpt``) is intended.
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(path, overwrite=True))
    if is_rank0:
        torch.save(checkpoint, path / METADATA_FILENAME)


def load_sharded(
    path: str | Path, model_state: dict[str, Any], optimizer_states: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Fill ``model_state`` (and ``optimizer_states``) in place from a :func:`save_sharded` directory.

    The requested tensors may be laid out differently from the saved ones (another dp size or stage): DCP reads the
    overlapping pieces of every saved shard. Collective when a process group exists.

    Args:
        path: the checkpoint directory.
        model_state: ``{name: tensor}`` with the tensors to fill (plain or DTensor), e.g. a ZeRO engine's
            ``model_state_dict()`` or a plain ``module.state_dict()``.
        optimizer_states: per optimizer, a ``get_optimizer_state_dict``-format dict with its state already created.

    Returns:
        The metadata (``meta.pt``): everything else the checkpoint holds.

    Raises:
        FileNotFoundError: ``path`` is not a sharded checkpoint directory.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(f"{str(path)!r} is not a sharded checkpoint directory (no {METADATA_FILENAME}).")
    request: dict[str, Any] = {"state_dict": model_state}
    for i, state in enumerate(optimizer_states or []):
        request[f"optimizer_{i}"] = state
    dcp.load(request, checkpoint_id=path)
    for i in range(len(optimizer_states or [])):
        optimizer_states[i] = request[f"optimizer_{i}"]  # type: ignore[index]
    return torch.load(path / METADATA_FILENAME, weights_only=False)


def load_model_weights(path: str | Path, module: nn.Module, strict: bool = True) -> dict[str, Any]:
    """Load the model part of a sharded checkpoint into a plain ``module`` (one process, no process group needed).

    Args:
        path: the checkpoint directory.
        module: a module with the checkpoint's parameter names (e.g. a fresh LightningModule).
        strict: passed to ``module.load_state_dict``.

    Returns:
        The metadata (``meta.pt``).
    """
    state = module.state_dict()
    meta = load_sharded(path, state)
    module.load_state_dict(state, strict=strict)
    return meta
