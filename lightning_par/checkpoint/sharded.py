"""The one checkpoint format of every lightning_par strategy: a sharded, atomically committed, self-describing directory.

Layout (Lightning ``ModelParallelStrategy``'s, written with ``torch.distributed.checkpoint`` (DCP)):

* the tensors ``{"state_dict": {name: tensor}, "optimizer_0": {"state": {name: {key: tensor}}, "param_groups": [...]},
  ...}`` as DCP shards: each rank writes the parts it owns, a tensor replicated on several ranks is written once, and
  no rank ever gathers the model;
* ``meta.pt``: rank 0's ``torch.save`` of everything else Lightning puts in a checkpoint (loops, LR schedulers,
  callbacks, hyper-parameters);
* ``lightning_par.json``: what wrote it (format version, strategy, layout, dp mode, step) and every other file with
  its size and CRC-32 (:mod:`lightning_par.checkpoint.verify`), written last: the commit record.

Every engine keys tensors by parameter name and gives sharded tensors as DTensors of their global shape, so DCP reads
any saved layout into any requested one: another dp, tp or pp size, another dp mode or strategy, or plain full
tensors in one process (:func:`load_model_weights`). A save goes into a staging directory that replaces the target
only when every rank has finished (:mod:`lightning_par.checkpoint.atomic`), so a crash mid-save leaves the previous
checkpoint whole. Loading checks the directory first (:func:`read_record`, :func:`verify_checkpoint`) and says what
is wrong and what to do.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_par.checkpoint.atomic import commit_checkpoint_dir, staging_dir
from lightning_par.checkpoint.safe import (
    UnsafeCheckpointError,
    check_bytes_entries,
    load_metadata_file,
    read_dcp_metadata,
    safe_dcp_load,
)
from lightning_par.checkpoint.verify import FILES_KEY, check_files, file_manifest

__all__ = [
    "FORMAT_VERSION",
    "METADATA_FILENAME",
    "RECORD_FILENAME",
    "consolidate_checkpoint",
    "is_sharded_checkpoint",
    "load_model_weights",
    "load_sharded",
    "read_record",
    "save_sharded",
    "verify_checkpoint",
]

#: Name of the non-tensor part of a checkpoint (the name Lightning's ``ModelParallelStrategy`` uses).
METADATA_FILENAME = "meta.pt"
#: Name of the record of what wrote a checkpoint.
RECORD_FILENAME = "lightning_par.json"
#: Version of this format; a checkpoint of a newer version is refused.
FORMAT_VERSION = 1
_DCP_METADATA = ".metadata"


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a complete directory written by :func:`save_sharded`."""
    path = Path(path)
    return path.is_dir() and all((path / f).is_file() for f in (METADATA_FILENAME, RECORD_FILENAME, _DCP_METADATA))


def read_record(path: str | Path) -> dict[str, Any]:
    """The record of a checkpoint directory, after checking that the directory is a complete checkpoint.

    Raises:
        FileNotFoundError: nothing at ``path`` (the message says if an interrupted save left a staging directory).
        ValueError: ``path`` is a file (a single-file Lightning checkpoint), a directory missing parts (a torn save or
            not a lightning_par checkpoint), an unreadable record (garbage), or a newer format version.
    """
    path = Path(path)
    if not path.exists():
        staged = staging_dir(path)
        hint = (
            f" {str(staged)!r} exists: a save to it was interrupted before it committed, so it is incomplete and "
            f"not loadable."
            if staged.exists()
            else ""
        )
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist.{hint}")
    if path.is_file():
        raise ValueError(
            f"checkpoint {str(path)!r} is a file, not a lightning_par checkpoint: every lightning_par strategy writes a "
            f"sharded directory. A single-file Lightning checkpoint (from Lightning's own strategies) holds whole "
            f"weights: load them with module.load_state_dict(torch.load(path)['state_dict']) before fit instead of "
            f"ckpt_path=."
        )
    missing = [f for f in (_DCP_METADATA, METADATA_FILENAME, RECORD_FILENAME) if not (path / f).is_file()]
    if missing:
        raise ValueError(
            f"checkpoint {str(path)!r} is incomplete or not a lightning_par checkpoint: it lacks {missing}. A "
            f"lightning_par save commits a directory only once every rank has written it, so this one was written by "
            f"something else or copied partially; resume from another checkpoint."
        )
    try:
        record = json.loads((path / RECORD_FILENAME).read_text())
        version = int(record["format_version"])
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"checkpoint {str(path)!r} has an unreadable {RECORD_FILENAME} ({err}): the file is damaged. Resume from "
            f"another checkpoint."
        ) from err
    if version > FORMAT_VERSION:
        raise ValueError(
            f"checkpoint {str(path)!r} has format_version={version}, newer than this lightning_par's "
            f"{FORMAT_VERSION}: upgrade lightning_par to load it."
        )
    return record


def verify_checkpoint(path: str | Path, checksums: bool = True) -> dict[str, Any]:
    """:func:`read_record`, then every file the record lists checked against its recorded size and CRC-32
    (:func:`lightning_par.checkpoint.verify.check_files`; every name confined to the directory), then, with
    ``checksums``, ``meta.pt`` and DCP's ``.metadata`` read through restricted unpicklers
    (:mod:`lightning_par.checkpoint.safe`): a checkpoint that would run code is refused here, before any rank loads
    it. A checkpoint written before records listed files is checked for presence only.

    Args:
        path: the checkpoint directory.
        checksums: also read every file (``False``: sizes only, no reads).

    Returns:
        The record.

    Raises:
        FileNotFoundError, ValueError: see :func:`read_record`.
        lightning_par.checkpoint.verify.DamagedCheckpointError: (a ``ValueError``) a listed file is missing, has
            another size or checksum; the message names the file.
        lightning_par.checkpoint.safe.UnsafeCheckpointError: (a ``ValueError``) a record name outside the directory,
            or a pickle asking for a global outside the allow-list; the message names the file and the global.
    """
    record = read_record(path)
    if FILES_KEY in record:
        check_files(Path(path), record[FILES_KEY], checksums=checksums)
    if checksums:
        check_loadable(path)
    return record


def check_loadable(path: str | Path) -> dict[str, Any]:
    """Read ``meta.pt`` and DCP's ``.metadata`` of the checkpoint directory ``path`` without running code
    (:mod:`lightning_par.checkpoint.safe`) and return ``meta.pt``'s contents.

    Raises:
        lightning_par.checkpoint.safe.UnsafeCheckpointError: either file asks for a global outside the allow-list, or
            ``.metadata`` names a shard outside the directory.
        ValueError: either file is unreadable.
    """
    return _read_safely(Path(path))[1]


def _read_safely(path: Path) -> tuple[Any, dict[str, Any]]:
    """DCP's metadata (its non-tensor entries checked too) and ``meta.pt``, each read without running code."""
    metadata = read_dcp_metadata(path)
    check_bytes_entries(path, metadata)
    return metadata, load_metadata_file(path / METADATA_FILENAME)


def split_tensors(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Pop the DCP part (``state_dict``, ``optimizer_states``) out of a Lightning checkpoint dict, keyed as saved."""
    tensors = {"state_dict": checkpoint.pop("state_dict")}
    for i, state in enumerate(checkpoint.pop("optimizer_states", [])):
        tensors[f"optimizer_{i}"] = state
    return tensors


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Rank 0, once every other file of ``path`` is written: the record with the list of files (the commit record)."""
    full = {"format_version": FORMAT_VERSION, "format": "lightning_par sharded (torch.distributed.checkpoint)"}
    files = file_manifest(path, exclude=(RECORD_FILENAME,))
    (path / RECORD_FILENAME).write_text(json.dumps({**full, **record, FILES_KEY: files}, indent=2, default=str))


def _write(path: Path, checkpoint: dict[str, Any], record: dict[str, Any], is_rank0: bool) -> None:
    """Write the shards (collective), then on rank 0 ``meta.pt`` and the record, into ``path``."""
    import torch.distributed.checkpoint as dcp

    path.mkdir(parents=True, exist_ok=True)
    tensors = split_tensors(checkpoint)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(path, overwrite=True))
    except CheckpointException as err:
        raise OSError(
            f"writing the shards of {str(path)!r} failed ({_first_line(err)}): a full disk, or a file-size limit such "
            f"as ulimit -f. Nothing of this save is kept."
        ) from err
    if is_rank0:
        save_file(checkpoint, path / METADATA_FILENAME)
        write_record(path, record)


def save_file(obj: Any, file: Path) -> None:
    """``torch.save(obj, file)``; a write that fails names the file (torch's own message, ``unexpected pos 704 vs
    598``, names nothing).

    Raises:
        OSError: the file could not be written whole (a full disk, a file-size limit, ...), naming it.
    """
    try:
        torch.save(obj, file)
    except (RuntimeError, OSError) as err:
        text = str(err).strip().splitlines()
        raise OSError(
            f"writing {str(file)!r} failed ({type(err).__name__}: {text[0][:200] if text else ''}): the file could not "
            f"be written whole (a full disk, or a file-size limit such as ulimit -f). Nothing of this save is kept."
        ) from err


def save_sharded(
    path: str | Path,
    checkpoint: dict[str, Any],
    record: dict[str, Any],
    *,
    is_rank0: bool,
    barrier: Callable[[], None],
) -> None:
    """Write a Lightning checkpoint dict whose ``"state_dict"`` and ``"optimizer_states"`` hold this rank's shards,
    atomically. Collective: every rank of the default group calls it.

    Args:
        path: the checkpoint directory (replaced, file or directory, once the new one is whole).
        checkpoint: ``{"state_dict": ..., "optimizer_states": [...], **metadata}``; consumed (the tensor parts are
            popped).
        record: what wrote it (strategy, layout, step, ...), stored in ``lightning_par.json``.
        is_rank0: whether this rank writes ``meta.pt`` and the record and commits.
        barrier: waits for every rank.
    """
    path = Path(path)
    staged = staging_dir(path)
    if is_rank0 and staged.exists():
        shutil.rmtree(staged)  # a save that crashed earlier
    barrier()
    try:
        _write(staged, checkpoint, record, is_rank0)
    except BaseException:
        if is_rank0:  # a full disk, a failed rank: nothing of this save is kept (a kill leaves it to the next start)
            shutil.rmtree(staged, ignore_errors=True)
        raise
    commit_checkpoint_dir(path, barrier, is_rank0)


def load_sharded(
    path: str | Path,
    model_state: dict[str, Any],
    optimizer_states: list[dict[str, Any]] | None = None,
    before_load: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Fill ``model_state`` (and ``optimizer_states``) in place from a :func:`save_sharded` directory.

    The requested tensors may be laid out differently from the saved ones (another layout, dp mode or strategy): DCP
    reads the overlapping pieces of every saved shard. Collective when a process group exists.

    Args:
        path: the checkpoint directory.
        model_state: ``{name: tensor}`` with the tensors to fill (plain or DTensor), e.g. an engine's
            ``model_state_dict()`` or a plain ``module.state_dict()``.
        optimizer_states: per optimizer, a ``get_optimizer_state_dict``-format dict with its state already created.
        before_load: called with the metadata (``meta.pt``) before any tensor is read, e.g. to refuse a checkpoint
            of other hyper-parameters (:func:`lightning_par.checkpoint.compat.check_resume`).

    Returns:
        The metadata (``meta.pt``): everything else the checkpoint holds.

    Raises:
        FileNotFoundError, ValueError: see :func:`verify_checkpoint` (sizes only); and ``ValueError`` when the
            checkpoint does not fit the model or optimizers, naming the first missing or mismatched tensor and what
            wrote the checkpoint, or when ``.metadata`` or ``meta.pt`` cannot be read.
        lightning_par.checkpoint.safe.UnsafeCheckpointError: a file of the checkpoint would run code if loaded.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    path = Path(path)
    record = verify_checkpoint(path, checksums=False)  # sizes only: ckpt_path was checksummed when it was resolved
    request: dict[str, Any] = {"state_dict": model_state}
    for i, state in enumerate(optimizer_states or []):
        request[f"optimizer_{i}"] = state
    wrote = ", ".join(f"{k}={record[k]}" for k in ("strategy", "layout", "dp_mode", "global_step") if k in record)
    wrote = f"It was written by {wrote or 'an unknown strategy'}; the model and optimizer must have the same parameter "
    wrote += "names and shapes (a layout, dp mode or strategy may differ)."
    # Both pickles are read without running code before any tensor is loaded (lightning_par.checkpoint.safe).
    metadata, meta = _read_safely(path)
    saved = metadata.state_dict_metadata
    if before_load is not None:
        before_load(meta)
    mismatch = first_mismatch(request, saved)
    if mismatch is not None:
        raise ValueError(f"checkpoint {str(path)!r} does not fit this model or optimizer: {mismatch}. {wrote}")
    _request_saved_group_keys(request, saved)
    try:
        safe_dcp_load(request, path)
    except UnsafeCheckpointError:
        raise
    except (CheckpointException, RuntimeError, KeyError, ValueError) as err:
        unsafe = _unsafe_cause(err)
        if unsafe is not None:
            raise unsafe from None
        raise ValueError(
            f"checkpoint {str(path)!r} does not fit this model or optimizer, or a shard is unreadable "
            f"({_first_line(err)}). {wrote}"
        ) from None
    for i in range(len(optimizer_states or [])):
        optimizer_states[i] = request[f"optimizer_{i}"]  # type: ignore[index]
    return meta


def _request_saved_group_keys(request: dict[str, Any], saved: dict[str, Any]) -> None:
    """Ask for exactly the hyper-parameters each saved param group holds, as ``torch.optim.Optimizer.load_state_dict``
    does (the saved groups replace the current ones, only ``params`` is kept).

    A key the optimizer gained after the save is dropped, one it lost is read back. Example: Lightning's ``lr_find``
    saves a checkpoint, attaches its own lr scheduler (which adds ``initial_lr`` to every group) and restores the
    checkpoint; DCP refused that restore ("Missing key in checkpoint state_dict: optimizer_0.param_groups.0.initial_lr")
    under every lightning_par strategy, where Lightning's DDP restores it."""
    for key, state in request.items():
        if not key.startswith("optimizer_"):
            continue
        for g, group in enumerate(state.get("param_groups", [])):
            prefix = f"{key}.param_groups.{g}."
            held = {flat[len(prefix):] for flat in saved if flat.startswith(prefix)}
            if not held:
                continue  # a group the checkpoint lacks: first_mismatch's and DCP's errors name it
            for name in [n for n in group if n != "params" and n not in held]:
                del group[name]
            for name in held - set(group):
                if "." not in name:
                    group[name] = None  # a placeholder DCP replaces with the saved value


def first_mismatch(request: dict[str, Any], saved: dict[str, Any]) -> str | None:
    """The first tensor of ``request`` (``{"state_dict": {name: tensor}, "optimizer_<i>": {"state": {name: {key:
    tensor}}}}``) that DCP's ``saved`` metadata (``{flat key: storage metadata}``) lacks or holds with another
    shape, in plain words; ``None`` when every tensor is there with its shape."""
    wanted: list[tuple[str, str, Any]] = [
        (f"state_dict.{name}", f"parameter or buffer {name!r}", t) for name, t in request["state_dict"].items()
    ]
    for key, state in request.items():
        if key.startswith("optimizer_"):
            for name, entries in state.get("state", {}).items():
                for k, t in entries.items():
                    wanted.append((f"{key}.state.{name}.{k}", f"{key.replace('_', ' ')} state {k!r} of {name!r}", t))
    for flat, words, tensor in wanted:
        if not isinstance(tensor, torch.Tensor):
            continue
        meta = saved.get(flat)
        if meta is None:
            return f"the checkpoint has no {words} (this model has it)"
        shape = getattr(meta, "size", None)
        if shape is not None and tuple(shape) != tuple(tensor.shape):
            return f"{words} has shape {tuple(shape)} in the checkpoint and {tuple(tensor.shape)} here"
    return None


def _unsafe_cause(err: BaseException) -> UnsafeCheckpointError | None:
    """The :class:`UnsafeCheckpointError` a rank raised inside ``dcp.load`` (DCP wraps it), if any."""
    failures = getattr(err, "failures", None) or {}
    for failure in failures.values():
        failure = getattr(failure, "exc", failure)
        if isinstance(failure, tuple) and failure:
            failure = failure[0]
        if isinstance(failure, UnsafeCheckpointError):
            return failure
    return None


def _plain(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200]}" if text else type(err).__name__


def _first_line(err: BaseException) -> str:
    """The first rank's error in one line: DCP wraps each rank's as ``(exception, traceback frames)``."""
    failures = getattr(err, "failures", None)  # a CheckpointException's, by rank
    if failures:
        err = next(iter(failures.values()))
        err = getattr(err, "exc", err)
        if isinstance(err, tuple) and err and isinstance(err[0], BaseException):
            err = err[0]
    return _plain(err)


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


def consolidate_checkpoint(path: str | Path, output: str | Path) -> Path:
    """Write a single-file Lightning checkpoint (weights, hyper-parameters, loop state; no optimizer state) from a
    sharded one, for ``LightningModule.load_from_checkpoint(output)``. One process; memory for the whole model.

    Also a command: ``python -m lightning_par.checkpoint.consolidate CHECKPOINT_DIR OUTPUT_FILE``.

    Raises:
        FileNotFoundError, ValueError: see :func:`verify_checkpoint` (a checkpoint that would run code included).
    """
    from lightning_par.checkpoint.loading import read_full_checkpoint

    path, output = Path(path), Path(output)
    checkpoint = read_full_checkpoint(path)  # verified, and read without running code
    checkpoint.pop("optimizer_states", None)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".tmp-writing")
    try:
        save_file(checkpoint, tmp)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(output)
    return output
