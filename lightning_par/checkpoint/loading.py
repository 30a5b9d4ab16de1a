"""``LightningModule.load_from_checkpoint`` for the sharded checkpoint directories every lightning_par strategy writes.

Lightning's ``load_from_checkpoint`` opens its argument as one file, so a ``*.ckpt`` directory failed with
``IsADirectoryError``; importing lightning_par installs :func:`install_directory_loading`, so that any module's
``load_from_checkpoint(DIR)`` reads one. :func:`load_from_checkpoint` reads such a directory in one process (the model's weights in
full, from the DCP shards of any layout, plus ``meta.pt``: hyper-parameters, loops, callbacks) into the dict a
single-file checkpoint holds and hands it to Lightning's own ``load_from_checkpoint`` (hyper-parameters, ``strict``,
``on_load_checkpoint``, keyword overrides all as usual). :class:`ShardedCheckpointLoading` makes a LightningModule's
``load_from_checkpoint`` accept both kinds; lightning_par's modules (``GPTLightningModule``, ``HFCausalLM``) have it.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import Any

import torch

from lightning_par.checkpoint.safe import load_metadata_file, safe_dcp_load, safe_reader
from lightning_par.checkpoint.sharded import METADATA_FILENAME, RECORD_FILENAME, verify_checkpoint

__all__ = [
    "ShardedCheckpointLoading",
    "install_directory_loading",
    "load_from_checkpoint",
    "load_in_one_process",
    "read_full_checkpoint",
]


def load_in_one_process(request: dict[str, Any], path: str | Path) -> None:
    """``torch.distributed.checkpoint.load(request, checkpoint_id=path, no_dist=True)`` through the restricted
    readers of :mod:`lightning_par.checkpoint.safe`, without DCP's warning that no process group exists (here that is
    the intent)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        safe_dcp_load(request, path, no_dist=True)


def read_full_checkpoint(path: str | Path) -> dict[str, Any]:
    """A sharded checkpoint directory as a single-file checkpoint's dict: ``meta.pt``'s entries plus
    ``"state_dict"``, the whole model in full (no optimizer state). One process; memory for the whole model.

    Raises:
        FileNotFoundError, ValueError: a missing, torn or damaged checkpoint, or one that would run code if loaded
            (see :func:`lightning_par.checkpoint.verify_checkpoint`).
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = Path(path)
    verify_checkpoint(path)
    saved = safe_reader(path).read_metadata().state_dict_metadata
    head = "state_dict."
    state = {
        key[len(head):]: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in saved.items()
        if key.startswith(head) and isinstance(entry, TensorStorageMetadata)
    }
    load_in_one_process({"state_dict": state}, path)
    checkpoint = load_metadata_file(path / METADATA_FILENAME)
    checkpoint["state_dict"] = state
    return checkpoint


def load_from_checkpoint(cls: Any, checkpoint_path: str | Path, *args: Any, **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint(checkpoint_path, **kwargs)`` for any LightningModule class, also when
    ``checkpoint_path`` is a lightning_par checkpoint directory (of any strategy and layout).

    Args:
        cls: a ``LightningModule`` subclass (a user's own too).
        checkpoint_path: a sharded checkpoint directory, or anything Lightning's ``load_from_checkpoint`` takes.
        args, kwargs: Lightning's ``load_from_checkpoint`` arguments (``map_location``, ``strict``, hyper-parameter
            overrides...).

    Returns:
        The module with the checkpoint's weights, in eval mode as Lightning returns it.

    Raises:
        FileNotFoundError, ValueError: see :func:`read_full_checkpoint`; what Lightning raises.
    """
    if isinstance(checkpoint_path, (str, Path)) and Path(checkpoint_path).is_dir():
        buffer = io.BytesIO()
        torch.save(read_full_checkpoint(checkpoint_path), buffer)
        buffer.seek(0)
        checkpoint_path = buffer  # type: ignore[assignment] - Lightning reads a file object as a file
    return cls.load_from_checkpoint(checkpoint_path, *args, **kwargs)


class ShardedCheckpointLoading:
    """Mixin (before ``LightningModule`` in the bases) whose ``load_from_checkpoint`` also reads lightning_par
    checkpoint directories (:func:`load_from_checkpoint`)."""

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning's ``load_from_checkpoint``; a lightning_par checkpoint directory is read in full first (one
        process, memory for the whole model).

        Raises:
            FileNotFoundError, ValueError: a missing, torn or damaged checkpoint directory; what Lightning raises.
        """
        if isinstance(checkpoint_path, (str, Path)) and Path(checkpoint_path).is_dir():
            return load_from_checkpoint(cls, checkpoint_path, *args, **kwargs)
        return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)  # type: ignore[misc]


def _is_our_directory(path: Any) -> bool:
    return isinstance(path, (str, Path)) and Path(path).is_dir() and (Path(path) / RECORD_FILENAME).is_file()


def install_directory_loading() -> None:
    """Make every LightningModule's ``load_from_checkpoint(path)`` read a lightning_par checkpoint directory (a user's
    module without :class:`ShardedCheckpointLoading` too), as :func:`load_from_checkpoint` does. Idempotent; called
    when ``lightning_par`` is imported.

    Lightning 2.6 offers no hook for this: ``LightningModule.load_from_checkpoint`` calls
    ``lightning.pytorch.core.module._load_from_checkpoint``, which opens its argument as one file through fsspec
    before any code of the module or a strategy runs, so a directory raised ``IsADirectoryError``. This wraps that one
    function: a directory holding a lightning_par record is read in full (one process) into the dict a single-file
    checkpoint holds, and handed to Lightning's own function as a file object; every other argument goes to Lightning
    unchanged.
    """
    from lightning_par.compat.lightning import checkpoint_loader, set_checkpoint_loader

    original = checkpoint_loader()
    if getattr(original, "_lightning_par_directories", False):
        return

    def _load_from_checkpoint(cls: Any, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        if _is_our_directory(checkpoint_path):
            buffer = io.BytesIO()
            torch.save(read_full_checkpoint(checkpoint_path), buffer)
            buffer.seek(0)
            checkpoint_path = buffer
        return original(cls, checkpoint_path, *args, **kwargs)

    _load_from_checkpoint._lightning_par_directories = True  # type: ignore[attr-defined]
    set_checkpoint_loader(_load_from_checkpoint)
