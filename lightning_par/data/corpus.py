"""Byte-level token files: the Python standard library (the default corpus) or any file or directory.

A token is one byte (vocabulary 256, no tokenizer to download or train). The default corpus is every ``*.py`` file
of the standard library of the running interpreter, concatenated in sorted path order. On the development machine
(CPython 3.11.7) that is 1,790 files and 31,525,224 bytes (about 31.5 MB, the ``test`` package included); other
Python versions give a somewhat different figure.

Tokens are cached as a raw ``uint8`` file (read back with ``numpy.memmap``) named by a hash of the source's
``(path, size, mtime)`` list, so a second call costs a directory walk and no reading. The file is written under a
temporary name and moved into place with ``os.replace``, so concurrent processes never read a half-written cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

__all__ = [
    "build_token_file",
    "corpus_files",
    "default_cache_dir",
    "is_text",
    "load_tokens",
    "stdlib_files",
    "token_file_dtype",
]

_CACHE_FORMAT = 1  # bump when the way bytes are gathered changes, so old caches are not reused
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages"})
_SNIFF_BYTES = 8192


def default_cache_dir() -> Path:
    """``$LP_CACHE_DIR`` if set and non-empty, else ``~/.cache/lightning_par``."""
    return Path(os.environ.get("LP_CACHE_DIR") or "~/.cache/lightning_par").expanduser()


def stdlib_files() -> list[Path]:
    """Every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``, sorted, without third-party packages.

    Directories named ``site-packages`` or ``dist-packages`` are skipped, as are symlinked directories.

    Returns:
        Absolute paths in sorted order (1,790 files on CPython 3.11.7).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        found.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(p for p in found if p.is_file())


def is_text(path: Path) -> bool:
    """Whether ``path`` looks like text: no NUL byte in its first 8 KiB."""
    with open(path, "rb") as f:
        return b"\0" not in f.read(_SNIFF_BYTES)


def _directory_files(root: Path, exclude: Path) -> list[Path]:
    """Regular files under ``root``, sorted, skipping hidden entries and anything under ``exclude``."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and (here / d).resolve() != exclude]
        found.extend(here / f for f in filenames if not f.startswith("."))
    return sorted(p for p in found if p.is_file())


def corpus_files(source: Path | None, cache_dir: Path) -> tuple[str, list[Path]]:
    """``(kind, files)`` of a corpus: ``("stdlib", ...)`` for None, ``("file", [source])``, or ``("dir", every
    non-hidden file under it, sorted, outside ``cache_dir``)``; a directory's binary files are skipped when read.

    Raises:
        ValueError: ``source`` does not exist or is neither a regular file nor a directory.
    """
    if source is None:
        return "stdlib", stdlib_files()
    if not source.exists():
        raise ValueError(
            f"corpus path={str(source)!r} is not valid: it does not exist. Expected an existing file, a directory "
            f"of text files, or None for the Python standard library."
        )
    if source.is_file():
        return "file", [source.resolve()]
    if source.is_dir():
        return "dir", [p.resolve() for p in _directory_files(source, cache_dir.resolve())]
    raise ValueError(f"corpus path={str(source)!r} is not valid: expected a regular file or a directory.")


def build_token_file(source: str | Path | None = None, cache_dir: str | Path | None = None) -> Path:
    """Byte tokens of ``source`` as a cached ``uint8`` file, built on first use.

    Args:
        source: None for the standard-library corpus (:func:`stdlib_files`); a file for its bytes; a directory for
            the bytes of all its text files (no NUL byte in the first 8 KiB), recursively, in sorted path order,
            skipping hidden files and directories.
        cache_dir: where the ``.bin`` goes; :func:`default_cache_dir` if None. Created if missing.

    Returns:
        Path of the token file (``<cache_dir>/corpus-<hash>.bin``); one byte per token.

    Raises:
        ValueError: ``source`` does not exist, or it holds no bytes (an empty file, or a directory without text).
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    src = Path(source).expanduser() if source is not None else None
    kind, files = corpus_files(src, cache)
    if not files:
        raise ValueError(f"corpus path={str(src)!r} is not valid: it holds no files. Expected at least one text file.")
    target = cache / f"corpus-{cache_key(kind, files)}.bin"

    def write(data: bytes, out: BinaryIO) -> int:
        out.write(data)
        return len(data)

    what = "corpus" if src is None else f"corpus path={str(src)!r}"
    return write_token_file(target, kind, files, write,
                            f"{what} is not valid: it holds 0 bytes of text. Expected a non-empty text corpus.")


def cache_key(kind: str, files: list[Path], *extra: Any) -> str:
    """A 20-hex-digit digest of the corpus files (paths, sizes, modification times), their kind and ``extra`` (a
    tokenizer's digest): a cached token file is reused only while all of them are unchanged."""
    stats = [(str(p), st.st_size, st.st_mtime_ns) for p in files for st in (p.stat(),)]
    return hashlib.sha256(json.dumps([_CACHE_FORMAT, kind, stats, *extra]).encode()).hexdigest()[:20]


def write_token_file(target: Path, kind: str, files: list[Path], write: Callable[[bytes, BinaryIO], int],
                     empty_message: str) -> Path:
    """Build ``target`` unless it exists: ``write(file bytes, out)`` for each file (only the text files of a
    directory corpus, ``kind == "dir"``), returning the tokens it wrote; into a temporary file of the same directory
    that replaces ``target`` only when complete, so an interrupted build never leaves a partial cache.

    Raises:
        ValueError: ``empty_message``, when the files give no token.
    """
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".tmp-{target.name.split('-')[0]}-", suffix=".bin")
    try:
        total = 0
        with os.fdopen(fd, "wb") as out:
            for path in files:
                if kind == "dir" and not is_text(path):
                    continue
                total += write(path.read_bytes(), out)
        if total == 0:
            raise ValueError(empty_message)
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return target


def load_tokens(path: str | Path) -> np.ndarray:
    """Read-only ``numpy.memmap`` of a token file, shape ``(n_tokens,)``: ``uint8`` for byte tokens, or the dtype a
    tokenized file's name ends with (``...-uint16.bin``, ``...-uint32.bin``; see :mod:`lightning_par.data.tokenize`)."""
    return np.memmap(path, dtype=token_file_dtype(path), mode="r")


def token_file_dtype(path: str | Path) -> np.dtype:
    """The dtype of a token file, from its name: ``uint16``/``uint32`` when it ends ``-uint16.bin``/``-uint32.bin``,
    else ``uint8`` (bytes)."""
    stem = Path(path).stem
    for name in ("uint16", "uint32"):
        if stem.endswith(f"-{name}"):
            return np.dtype(name)
    return np.dtype(np.uint8)
