"""What a checkpoint's commit record says about its files, and the check that the files still say the same.

At save, rank 0 lists every file of the finished checkpoint directory (each rank's DCP shards, DCP's ``.metadata``,
``meta.pt``) with its size in bytes and a CRC-32 of its contents (``zlib.crc32``, read in 1 MiB blocks), and stores
the list in the record (``lightning_par.json``), which is written last. At resume the list is checked before
anything is loaded: a file missing, of another size, or with another checksum names the damaged checkpoint and the
file, so a resume can skip it and take the newest intact one (:func:`lightning_par.fault.resume.latest_checkpoint`).

CRC-32 detects truncation, emptied files and random corruption; it is not a defence against deliberate tampering
(that would need a cryptographic hash, several times slower: see the checkpoint figures in docs/benchmarks.md).
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

__all__ = ["DamagedCheckpointError", "FILES_KEY", "check_files", "file_manifest"]

#: Key of the file list in the record.
FILES_KEY = "files"
_BLOCK = 1 << 20


class DamagedCheckpointError(ValueError):
    """A checkpoint whose files do not match its commit record. ``file`` names the first bad file (relative to the
    checkpoint directory) and ``problem`` says what is wrong with it."""

    def __init__(self, path: Path, file: str, problem: str) -> None:
        self.path, self.file, self.problem = path, file, problem
        super().__init__(
            f"checkpoint {str(path)!r} is damaged: {file} {problem}. Resume from another checkpoint (a resume with "
            f"ckpt_path=null or 'last' skips damaged ones by itself)."
        )


def _crc32(path: Path) -> str:
    value = 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            value = zlib.crc32(block, value)
    return f"{value:08x}"


def file_manifest(directory: str | Path, exclude: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    """``{name: {"bytes": size, "crc32": "8 hex digits"}}`` for every regular file directly in ``directory`` but
    ``exclude``; reads every byte once."""
    directory = Path(directory)
    return {
        p.name: {"bytes": p.stat().st_size, "crc32": _crc32(p)}
        for p in sorted(directory.iterdir())
        if p.is_file() and p.name not in exclude
    }


def check_files(path: str | Path, manifest: dict[str, Any], checksums: bool = True) -> None:
    """Check that every file of ``manifest`` is in ``path`` with its recorded size (and checksum).

    Args:
        path: the checkpoint directory.
        manifest: the record's :data:`FILES_KEY` entry.
        checksums: also read every file and compare its CRC-32 (``False``: presence and sizes only, no reads).

    Raises:
        DamagedCheckpointError: the first file (in name order) that is missing, has another size or checksum.
        lightning_par.checkpoint.safe.UnsafeCheckpointError: a name that is not a file directly in ``path`` (an
            absolute path, ``..``, a link), checked before anything is read.
    """
    path = Path(path)
    if not isinstance(manifest, dict) or not manifest:
        raise DamagedCheckpointError(path, "lightning_par.json", f"has an unreadable file list ({manifest!r:.80})")
    from lightning_par.checkpoint.safe import confined_file

    for name in sorted(manifest):
        entry = manifest[name]
        file = confined_file(path, name, "lightning_par.json")  # never a file outside the checkpoint
        if not isinstance(entry, dict):
            raise DamagedCheckpointError(path, "lightning_par.json", f"has an unreadable entry for {name!r}")
        if not file.is_file():
            raise DamagedCheckpointError(path, name, "is missing")
        size = file.stat().st_size
        if size != entry.get("bytes"):
            what = "is empty" if size == 0 else f"has {size} bytes"
            raise DamagedCheckpointError(path, name, f"{what}, the record says {entry.get('bytes')} (truncated?)")
        if checksums and _crc32(file) != entry.get("crc32"):
            raise DamagedCheckpointError(
                path, name, f"has CRC-32 {_crc32(file)}, the record says {entry.get('crc32')} (its contents changed)"
            )
