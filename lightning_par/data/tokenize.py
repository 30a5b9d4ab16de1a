"""Token files made with a local Hugging Face tokenizer (``data.tokenizer=DIR``), cached like the byte corpus.

The corpus is gathered as in :mod:`lightning_par.data.corpus` (the standard library, a file, or a directory's text
files in sorted order); each file is decoded as UTF-8 (undecodable bytes replaced) and encoded on its own, without
special tokens, and the ids are concatenated. They are written once as ``uint16`` (vocabularies up to 65,536) or
``uint32``, under a name hashing the corpus's ``(path, size, mtime)`` list and the tokenizer files' contents, so a
second run, or another rank, reuses the file. The tokenizer is read with ``tokenizers.Tokenizer.from_file``
(``tokenizer.json``) or, without that file, ``transformers.AutoTokenizer.from_pretrained(DIR,
local_files_only=True)``: nothing is downloaded.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import BinaryIO
from pathlib import Path

import numpy as np

from lightning_par.data.corpus import cache_key, corpus_files, default_cache_dir, write_token_file

__all__ = ["TOKENIZER_FILE", "TOKENIZER_FILES", "build_tokenized_file", "load_tokenizer", "token_dtype"]

#: The one-file tokenizer ``tokenizers`` and ``save_pretrained`` write.
TOKENIZER_FILE = "tokenizer.json"
_TOKENS_FORMAT = 1
#: The files a tokenizer directory may hold (what ``save_pretrained`` of the common tokenizers writes).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "vocab.txt",
                    "tokenizer.model", "special_tokens_map.json", "added_tokens.json")


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype holding ids below ``vocab_size``: ``uint8``, ``uint16`` or ``uint32``."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    raise ValueError(f"vocab_size={vocab_size} is not valid: expected at most 2**32.")


def load_tokenizer(directory: str | Path) -> tuple[Callable[[str], list[int]], int]:
    """``(encode, vocab_size)`` of the tokenizer in a local directory.

    Args:
        directory: a directory with ``tokenizer.json`` (``tokenizers``), or one that
            ``AutoTokenizer.from_pretrained`` reads offline.

    Returns:
        ``encode(text) -> ids`` (no special tokens added) and the vocabulary size, added tokens included.

    Raises:
        ValueError: ``directory`` does not exist, holds no tokenizer, or its ``tokenizer.json`` is unreadable (the
            message names ``data.tokenizer`` and the file).
    """
    path = Path(directory).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"data.tokenizer={str(directory)!r} is not valid: it is not a directory. Expected a local tokenizer "
            f"directory (with {TOKENIZER_FILE}, as tokenizer.save_pretrained(DIR) writes), or null for bytes."
        )
    if (path / TOKENIZER_FILE).is_file():
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(path / TOKENIZER_FILE))
        except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception for every parse error
            raise ValueError(
                f"data.tokenizer={str(directory)!r} is not valid: {str(path / TOKENIZER_FILE)!r} could not be read "
                f"({type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}); the file is damaged or "
                f"not a tokenizers file. Expected the {TOKENIZER_FILE} that tokenizer.save_pretrained(DIR) writes."
            ) from None
        return (lambda text: tok.encode(text, add_special_tokens=False).ids), tok.get_vocab_size(with_added_tokens=True)
    try:
        from transformers import AutoTokenizer

        from lightning_par.hf.load import trust_remote_code

        auto = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code())
    except (OSError, ValueError, ImportError) as err:
        raise ValueError(
            f"data.tokenizer={str(directory)!r} is not valid: no tokenizer could be read from it ({type(err).__name__}:"
            f" {str(err).splitlines()[0][:200] if str(err) else ''}). Expected a directory with {TOKENIZER_FILE} or "
            f"one AutoTokenizer.from_pretrained reads offline."
        ) from None
    return (lambda text: auto.encode(text, add_special_tokens=False)), len(auto)


def _tokenizer_digest(directory: Path) -> list[str]:
    return [
        f"{name}:{hashlib.sha256((directory / name).read_bytes()).hexdigest()}"
        for name in TOKENIZER_FILES
        if (directory / name).is_file()
    ]


def build_tokenized_file(
    source: str | Path | None, tokenizer: str | Path, cache_dir: str | Path | None = None
) -> tuple[Path, int]:
    """Token ids of ``source`` under ``tokenizer`` as a cached file, built on first use.

    Args:
        source: as :func:`lightning_par.data.corpus.build_token_file` (None: the standard library).
        tokenizer: a local tokenizer directory (:func:`load_tokenizer`).
        cache_dir: where the file goes; :func:`lightning_par.data.corpus.default_cache_dir` if None.

    Returns:
        ``(path, vocab_size)``: the token file (``<cache_dir>/tokens-<hash>-<dtype>.bin``, read back with
        :func:`lightning_par.data.corpus.load_tokens`) and the tokenizer's vocabulary size.

    Raises:
        ValueError: see :func:`load_tokenizer`; ``source`` is missing or holds no text; the text gives no token.
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    src = Path(source).expanduser() if source is not None else None
    encode, vocab_size = load_tokenizer(tokenizer)
    dtype = token_dtype(vocab_size)
    kind, files = corpus_files(src, cache)
    digest = cache_key(kind, files, _TOKENS_FORMAT, _tokenizer_digest(Path(tokenizer).expanduser()), vocab_size)
    target = cache / f"tokens-{digest}-{dtype.name}.bin"

    def write(data: bytes, out: BinaryIO) -> int:
        ids = encode(data.decode("utf-8", errors="replace"))
        np.asarray(ids, dtype=dtype).tofile(out)
        return len(ids)

    what = "corpus" if src is None else f"corpus path={str(src)!r}"
    write_token_file(target, kind, files, write, f"{what} is not valid with data.tokenizer={str(tokenizer)!r}: it "
                     f"gives 0 tokens. Expected a non-empty text corpus.")
    return target, vocab_size
