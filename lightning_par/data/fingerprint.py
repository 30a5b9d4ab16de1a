"""What a run trains on, recorded in its checkpoints so that a resume on other data is refused, naming what changed.

A data module's fingerprint (:meth:`lightning_par.data.DocumentDataModule.fingerprint`) holds

* ``tokenizer``: a SHA-256 of the tokenizer directory's files' contents (:data:`~lightning_par.data.tokenize.
  TOKENIZER_FILES`; ``None``: one token per byte). The directory's path is not part of it: the same files elsewhere
  are the same tokenizer, and the same path with an edited ``tokenizer.json`` is another one;
* ``token_cache``: the token cache's key (the data files' ``(path, size, mtime)``, the fields, the tokenizer's
  contents and the format): another key is another token stream;
* ``packing``: the settings that cut the stream into samples (``packing``, ``block_size``, ``long_documents``,
  ``buffer_blocks``, ``val_every``).

The checkpoint keeps it in the data module's state (Lightning saves ``state_dict()``), read back before any process
starts (:func:`lightning_par.checkpoint.compat.resume_changes`) and again when the ranks restore it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["fingerprint_changes", "tokenizer_digest", "tokenizer_file_digests"]


def tokenizer_file_digests(tokenizer: str | Path | None) -> list[str]:
    """``"<file>:<sha256>"`` of each tokenizer file of the directory ``tokenizer`` (``[]`` for ``None``)."""
    from lightning_par.data.tokenize import TOKENIZER_FILES

    if tokenizer is None:
        return []
    directory = Path(tokenizer).expanduser()
    return [f"{n}:{hashlib.sha256((directory / n).read_bytes()).hexdigest()}" for n in TOKENIZER_FILES
            if (directory / n).is_file()]


def tokenizer_digest(tokenizer: str | Path | None) -> str | None:
    """One SHA-256 (16 hex digits) of the tokenizer directory's files' contents; ``None`` for bytes."""
    if tokenizer is None:
        return None
    return "sha256:" + hashlib.sha256("\n".join(tokenizer_file_digests(tokenizer)).encode()).hexdigest()[:16]


#: How each fingerprint entry is named in a refusal.
_NAMES = {"tokenizer": "tokenizer files' contents (data.tokenizer)", "token_cache": "token cache key"}


def fingerprint_changes(saved: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> list[str]:
    """``"data <what>: <old> -> <new>"`` for every entry of the two fingerprints that differs (entries only one side
    has, e.g. a checkpoint of an older version, are not compared)."""
    if not isinstance(saved, Mapping) or not isinstance(new, Mapping):
        return []
    out = []
    for key in saved:
        if key not in new:
            continue
        old, now = saved[key], new[key]
        if isinstance(old, Mapping) and isinstance(now, Mapping):
            out += [f"data {key}.{k}: {old[k]!r} -> {now[k]!r}" for k in old if k in now and old[k] != now[k]]
        elif old != now:
            out.append(f"data {_NAMES.get(key, key)}: {old!r} -> {now!r}")
    return out
