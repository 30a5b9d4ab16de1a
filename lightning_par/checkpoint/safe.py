"""Reading a checkpoint without running any of its code: a checkpoint is data (tensors and plain values), never code.

Three files of a sharded checkpoint are pickles, and a pickle can call any importable function while it is read
(``os.system`` included). Each is read here through an unpickler that constructs only an allow-list of types:

* ``meta.pt`` (loops, LR schedulers, callbacks, hyper-parameters): ``torch.load(weights_only=True)``, torch's own
  restricted unpickler: tensors, containers, numbers, strings and the types registered with
  ``torch.serialization.add_safe_globals`` (a user's own hyper-parameter class is loaded once its user registers it);
* DCP's ``.metadata`` (which tensor is where): torch's ``FileSystemReader.read_metadata`` uses plain ``pickle.load``;
  :func:`safe_reader` reads it through :class:`_MetadataUnpickler` instead, which builds only the
  ``torch.distributed.checkpoint`` metadata dataclasses, ``torch.Size``, dtypes, layouts, paths and plain containers,
  and sets attributes only on instances of those (the C unpickler's BUILD sets them on any object, a class included,
  so the pure-Python one is subclassed: the same choice torch's weights-only unpickler makes). Every shard file it
  names must be a plain file name of the checkpoint directory;
* the non-tensor entries of the shards (optimizer ``param_groups`` values): DCP's ``DefaultLoadPlanner.load_bytes``
  calls ``torch.load(weights_only=False)``; :func:`safe_load_planner` calls it with ``weights_only=True``.

A file that asks for anything else is refused before anything is loaded, with an :class:`UnsafeCheckpointError` (a
``ValueError``) naming the checkpoint, the file and the global it asked for. The CRC-32 of the commit record cannot
protect against this (anyone who can write the file can rewrite the record): only the reader can.
"""

from __future__ import annotations

import functools
import io
import pickle
import re
from pathlib import Path, PurePath
from typing import Any

import torch

__all__ = [
    "UnsafeCheckpointError",
    "check_bytes_entries",
    "confined_file",
    "load_metadata_file",
    "read_dcp_metadata",
    "safe_dcp_load",
    "safe_load_planner",
    "safe_reader",
]

_DCP_METADATA = ".metadata"


class UnsafeCheckpointError(ValueError):
    """A checkpoint file that would run code (or read outside its directory) if it were loaded. ``file`` names the
    file (relative to the checkpoint directory) and ``forbidden`` what it asked for."""

    def __init__(self, path: Path, file: str, forbidden: str, outside: bool = False) -> None:
        self.path, self.file, self.forbidden = path, file, forbidden
        if outside:
            super().__init__(
                f"checkpoint {str(path)!r} is refused: its {file} names {forbidden}, which is not a file directly in "
                f"the checkpoint directory (no absolute path, no '..', no link out of it). Nothing was read. Do not "
                f"resume from a checkpoint of unknown origin."
            )
            return
        super().__init__(
            f"checkpoint {str(path)!r} is refused: its {file} asks for {forbidden}, which a checkpoint may not hold "
            f"(a checkpoint is data: tensors and plain values, never code). Nothing was loaded. Do not resume from a "
            f"checkpoint of unknown origin; if {file} holds a class of your own that you trust, register it with "
            f"torch.serialization.add_safe_globals([...]) before loading."
        )


def confined_file(directory: str | Path, name: Any, what: str) -> Path:
    """``directory / name`` for a file name read from a checkpoint (a commit-record entry, a DCP shard name), after
    checking that it names a file directly inside ``directory``: a plain relative name, no ``..``, no absolute path,
    not a link (a link could point anywhere).

    Raises:
        UnsafeCheckpointError: ``name`` is not such a name; the message names ``what`` and the name.
    """
    directory = Path(directory)
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise UnsafeCheckpointError(directory, what, f"the file {name!r:.200}", outside=True)
    path = directory / name
    if path.is_symlink() or (path.exists() and path.resolve().parent != directory.resolve()):
        raise UnsafeCheckpointError(directory, what, f"the file {name!r:.200}", outside=True)
    return path


_FORBIDDEN = re.compile(r"GLOBAL ([\w.]+)")
#: What torch's weights-only unpickler says when a pickle asks for more than data (not when it is merely damaged).
_REFUSALS = ("GLOBAL", "Can only build", "reduce", "Unsupported operand", "persistent")


def _refusal(err: BaseException) -> str | None:
    """What a ``weights_only=True`` load refused (``"the global posix.system"``), or ``None`` for a damaged file."""
    text = str(err)
    forbidden = _FORBIDDEN.search(text)
    if forbidden is not None:
        return f"the global {forbidden.group(1)}"
    detail = text.split("WeightsUnpickler error:", 1)[-1]
    return _first(detail) if any(word in detail for word in _REFUSALS) else None


def load_metadata_file(path: str | Path) -> dict[str, Any]:
    """``meta.pt`` of a checkpoint directory (or any ``torch.save`` file of a checkpoint), read with
    ``torch.load(weights_only=True)`` on the CPU.

    Raises:
        UnsafeCheckpointError: the file asks for a global outside torch's allow-list (the message names it).
        ValueError: the file is unreadable (damaged).
    """
    path = Path(path)
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        refused = _refusal(err)
        if refused is not None:
            raise UnsafeCheckpointError(path.parent, path.name, refused) from None
        raise ValueError(f"checkpoint {str(path.parent)!r} has an unreadable {path.name} ({_first(str(err))}): the "
                         f"file is damaged. Resume from another checkpoint.") from None
    except Exception as err:  # noqa: BLE001 - a damaged zip raises many types
        raise ValueError(f"checkpoint {str(path.parent)!r} has an unreadable {path.name} "
                         f"({type(err).__name__}: {_first(str(err))}): the file is damaged. Resume from another "
                         f"checkpoint.") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"checkpoint {str(path.parent)!r} has a {path.name} holding a {type(loaded).__name__}, not "
                         f"a dict: it was not written by a lightning_par strategy.")
    return loaded


def _first(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0][:300] if lines else ""


def _dcp_allowed() -> dict[tuple[str, str], Any]:
    """What DCP's ``.metadata`` may construct: ``(module, name) -> object``."""
    import collections
    import pathlib

    import torch.distributed.checkpoint.filesystem as filesystem
    import torch.distributed.checkpoint.metadata as metadata
    from lightning_par.compat import dcp_storage_info_class, serialization_get_layout

    allowed: dict[tuple[str, str], Any] = {}
    for name in ("Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"):
        allowed[(metadata.__name__, name)] = getattr(metadata, name)
    allowed[(filesystem.__name__, "_StorageInfo")] = dcp_storage_info_class()
    allowed[("torch", "Size")] = torch.Size
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = value
    allowed[("torch.serialization", "_get_layout")] = serialization_get_layout()
    for cls in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath, pathlib.Path):
        allowed[("pathlib", cls.__name__)] = cls
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    for cls in (set, frozenset):
        allowed[("builtins", cls.__name__)] = cls
    return allowed


class _MetadataUnpickler(pickle._Unpickler):  # type: ignore[name-defined,misc]
    """A pickle reader that constructs only :func:`_dcp_allowed` and sets state only on instances of those classes
    (see the module docstring for why the pure-Python unpickler)."""

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self._allowed = _dcp_allowed()
        self._buildable = tuple(v for v in self._allowed.values() if isinstance(v, type) and v not in (set, frozenset))

    def find_class(self, module: str, name: str) -> Any:
        found = self._allowed.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError(f"a persistent id ({pid!r:.60})")

    def _load_build(self) -> None:
        inst = self.stack[-2]
        if isinstance(inst, type) or not isinstance(inst, self._buildable):
            raise pickle.UnpicklingError(f"setting the state of a {type(inst).__name__}")
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]

    dispatch[pickle.BUILD[0]] = _load_build


def read_dcp_metadata(directory: str | Path, data: bytes | None = None) -> Any:
    """DCP's ``.metadata`` of a checkpoint directory, read through the restricted unpickler, with every shard file it
    names checked to be a file name directly in ``directory``.

    Args:
        directory: the checkpoint directory.
        data: the file's bytes if already read (one read for check and use).

    Returns:
        The ``torch.distributed.checkpoint.metadata.Metadata``.

    Raises:
        UnsafeCheckpointError: the file asks for a global outside the allow-list, or names a shard outside the
            directory.
        ValueError: the file is unreadable (damaged) or not DCP metadata.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    directory = Path(directory)
    if data is None:
        data = (directory / _DCP_METADATA).read_bytes()
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as err:
        text = str(err)
        what = f"the global {text[len('GLOBAL '):]}" if text.startswith("GLOBAL ") else text
        if text.startswith(("GLOBAL ", "a persistent id", "setting the state")):
            raise UnsafeCheckpointError(directory, _DCP_METADATA, what) from None
        raise ValueError(f"checkpoint {str(directory)!r} has an unreadable {_DCP_METADATA} (UnpicklingError: "
                         f"{_first(text)}): the file is damaged. Resume from another checkpoint.") from None
    except Exception as err:  # noqa: BLE001 - truncated pickles raise many types
        raise ValueError(f"checkpoint {str(directory)!r} has an unreadable {_DCP_METADATA} ({type(err).__name__}: "
                         f"{_first(str(err))}): the file is damaged. Resume from another checkpoint.") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise ValueError(f"checkpoint {str(directory)!r} has a {_DCP_METADATA} that is not DCP metadata (a "
                         f"{type(metadata).__name__}): the file is damaged. Resume from another checkpoint.")
    for info in (metadata.storage_data or {}).values():
        confined_file(directory, getattr(info, "relative_path", None), _DCP_METADATA)
    return metadata


def check_bytes_entries(directory: str | Path, metadata: Any) -> None:
    """Read every non-tensor entry of the shards (``BytesStorageMetadata``: optimizer ``param_groups`` values, ...)
    with ``torch.load(weights_only=True)``, so that a shard that would run code is refused before any rank loads.
    Entries written through a storage transform (an extension such as compression) are left to
    :func:`safe_load_planner`, which reads them the same way at load.

    Raises:
        UnsafeCheckpointError: an entry asks for a global outside torch's allow-list.
        ValueError: an entry is unreadable (a damaged shard).
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    directory = Path(directory)
    byte_keys = {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    for index, info in (metadata.storage_data or {}).items():
        if getattr(index, "fqn", None) not in byte_keys or getattr(info, "transform_descriptors", None):
            continue
        file = confined_file(directory, info.relative_path, _DCP_METADATA)
        with open(file, "rb") as f:
            f.seek(int(info.offset))
            data = f.read(int(info.length))
        try:
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            refused = _refusal(err)
            if refused is not None:
                raise UnsafeCheckpointError(directory, f"{info.relative_path} (entry {index.fqn!r})", refused) from None
            raise ValueError(f"checkpoint {str(directory)!r} has an unreadable entry {index.fqn!r} in "
                             f"{info.relative_path}: the file is damaged. Resume from another checkpoint.") from None
        except Exception as err:  # noqa: BLE001 - a damaged entry raises many types
            raise ValueError(f"checkpoint {str(directory)!r} has an unreadable entry {index.fqn!r} in "
                             f"{info.relative_path} ({type(err).__name__}): the file is damaged. Resume from another "
                             f"checkpoint.") from None


@functools.cache  # one class per process: built on first use (DCP is imported lazily)
def _reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    from lightning_par.compat import dcp_metadata_path

    class _SafeFileSystemReader(FileSystemReader):
        """DCP's ``FileSystemReader`` whose ``.metadata`` is read by :func:`read_dcp_metadata` (never
        ``pickle.load``)."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            rank = kwargs.get("rank")
            path = Path(dcp_metadata_path(self, rank))
            metadata = read_dcp_metadata(path.parent, path.read_bytes())
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _SafeFileSystemReader


def safe_reader(path: str | Path) -> Any:
    """A ``torch.distributed.checkpoint.FileSystemReader`` for ``path`` that reads ``.metadata`` safely
    (:func:`read_dcp_metadata`)."""
    return _reader_class()(path)


@functools.cache  # as _reader_class
def _planner_class() -> type:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    from lightning_par.compat import dcp_set_element as set_element  # DCP's own helper, as its planner uses

    class _SafeLoadPlanner(DefaultLoadPlanner):
        """DCP's ``DefaultLoadPlanner`` whose non-tensor entries are read with ``torch.load(weights_only=True)``."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                loaded = torch.load(value, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as err:
                raise UnsafeCheckpointError(
                    Path(str(getattr(self, "_lp_path", "?"))), f"shard entry {read_item.dest_index.fqn!r}",
                    _refusal(err) or f"something it cannot read ({_first(str(err))})",
                ) from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return _SafeLoadPlanner


def safe_load_planner(path: str | Path | None = None) -> Any:
    """A ``torch.distributed.checkpoint.DefaultLoadPlanner`` whose non-tensor entries are read with
    ``weights_only=True`` (``path`` only names the checkpoint in errors)."""
    planner = _planner_class()()
    planner._lp_path = path
    return planner


def safe_dcp_load(request: dict[str, Any], path: str | Path, **kwargs: Any) -> None:
    """``torch.distributed.checkpoint.load(request, ...)`` from the directory ``path`` with
    :func:`safe_reader` and :func:`safe_load_planner`: no file of the checkpoint is unpickled unrestricted.
    ``kwargs`` go to ``dcp.load`` (``no_dist``, ``process_group``)."""
    import torch.distributed.checkpoint as dcp

    dcp.load(request, storage_reader=safe_reader(path), planner=safe_load_planner(path), **kwargs)
