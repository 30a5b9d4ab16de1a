"""The data people keep: JSONL / Parquet / text files read with Hugging Face ``datasets``, or a ``litdata.optimize``
output read with litdata's ``StreamingDataset``; tokenized once into a cached document file, then packed
(:mod:`lightning_par.data.packing`) or cut into windows.

Records and fields:

* ``source="json"`` (JSON Lines or a JSON array) and ``"parquet"``: each record is a document; its text is the
  ``text_field`` column, or, with ``messages_field``, a chat (a list of ``{"role", "content"}``) rendered and tokenized
  by the tokenizer's chat template (``apply_chat_template``; needs ``tokenizer``).
* ``source="text"``: each file is one document (``datasets``' ``text`` builder with ``sample_by="document"``).
* ``source="litdata"``: ``path`` is an output directory of ``litdata.optimize``; each item is a document: a ``str``, a
  mapping with ``text_field`` (or ``messages_field``), or a 1-D array / tensor / list of token ids (already tokenized).

Bad records (checked while the cache is built, on one process, before any training process starts):

* a record without the field (the column is absent, or the record's value is null / missing): ``ValueError`` naming
  ``data.text_field`` (or ``data.messages_field``), the record and the file; nothing is trained, and no partial
  cache file stays. A record is named as an editor counts it: ``line L`` of a JSON Lines file, ``row R`` of a Parquet
  file, ``record R`` of a JSON array (all from 1); ``item i`` of a litdata dataset (its index);
* a value of the wrong type (not a string, not a list of messages): ``ValueError`` likewise;
* an empty text (or one of a single token): skipped and counted (``data_skipped_documents`` in ``summary.json``); a file
  where every record is empty is refused (``ValueError``: it gives no document);
* a record longer than any block under ``packing=documents``: ``data.long_documents`` (``split`` by default, ``truncate``
  or ``error``), see :mod:`lightning_par.data.packing`;
* a file ``datasets`` cannot parse (a broken JSON line): ``ValueError`` naming ``data.path`` and the parser's message.

The cache: ``<cache_dir>/docs-<hash>.tokens`` (token ids back to back, ``uint8``/``uint16``/``uint32``) with
``docs-<hash>.json`` (document offsets, counts), under a hash of the files' ``(path, size, mtime)``, the fields, the
tokenizer files' contents and the format, so a second run, or another rank, reuses it. Both libraries are optional
extras (``pip install lightning-par[datasets]`` / ``[litdata]``); the default data stays the standard-library corpus.

Split: document ``d`` (in record order, empty ones left out) is validation when ``d % val_every == val_every - 1``;
with fewer than ``val_every`` documents, the last one is.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset

from lightning_par.data.corpus import default_cache_dir
from lightning_par.data.datamodule import TokenWindowDataset
from lightning_par.data.fingerprint import fingerprint_changes, tokenizer_digest, tokenizer_file_digests
from lightning_par.data.packing import LONG_DOCUMENTS, PACKING, PackedBlocks
from lightning_par.data.resumable import ResumableDataLoader
from lightning_par.data.tokenize import load_tokenizer, token_dtype

__all__ = ["SOURCES", "DocumentDataModule", "PackingMetricsCallback", "build_document_cache"]

#: ``data.source`` values.
SOURCES = ("json", "parquet", "text", "litdata")
_FORMAT = 1
_SUFFIXES = {"json": (".json", ".jsonl"), "parquet": (".parquet",), "text": (".txt", ".md", ".text")}


def _files(source: str, path: str) -> list[Path]:
    """The files of ``path`` (a file, a directory, or a glob) for ``source``, sorted."""
    p = Path(path).expanduser()
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in _SUFFIXES[source])
    else:
        files = sorted(Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file())
    if not files:
        raise ValueError(
            f"data.path={path!r} is not valid for data.source={source!r}: it names no file (a file, a directory with "
            f"{'/'.join(_SUFFIXES[source])} files, or a glob). Expected existing {source} files."
        )
    return files


def _litdata_files(path: str) -> list[Path]:
    p = Path(path).expanduser()
    if not (p / "index.json").is_file():
        raise ValueError(
            f"data.path={path!r} is not valid for data.source='litdata': it has no index.json. Expected the "
            f"output_dir of litdata.optimize(...)."
        )
    return sorted(f for f in p.iterdir() if f.is_file())


def _records(source: str, files: list[Path], cache: Path, path: str) -> Iterator[tuple[Any, str]]:
    """``(record, where)`` in order; ``where`` names the record for error messages."""
    if source == "litdata":
        try:
            from litdata import StreamingDataset
        except ImportError as err:
            raise ValueError(
                "data.source='litdata' needs the litdata package: pip install 'lightning-par[litdata]'."
            ) from err
        dataset = StreamingDataset(str(Path(path).expanduser()), cache_dir=str(cache / "litdata"))
        for i in range(len(dataset)):
            yield dataset[i], f"item {i} of data.path={path!r}"
        return
    try:
        import datasets
    except ImportError as err:
        raise ValueError(
            f"data.source={source!r} needs the Hugging Face datasets package: pip install 'lightning-par[datasets]'."
        ) from err
    kwargs: dict[str, Any] = {"sample_by": "document"} if source == "text" else {}
    for file in files:  # one file at a time: a record's error names its file
        try:
            table = datasets.load_dataset(source, data_files=[str(file)], split="train",
                                          cache_dir=str(cache / "hf-datasets"), **kwargs)
        except Exception as err:  # noqa: BLE001 - datasets raises many kinds; the user needs the file and the message
            cause = err.__cause__ or err
            raise ValueError(
                f"data.path={path!r} is not valid for data.source={source!r}: {str(file)!r} could not be read "
                f"({type(cause).__name__}: {str(cause).splitlines()[0][:300] if str(cause) else ''}). Expected "
                f"well-formed {source} records."
            ) from None
        lines = _record_lines(source, file, len(table))
        for i, record in enumerate(table):
            yield record, f"{lines(i)} of {str(file)!r}"


def _record_lines(source: str, file: Path, n: int) -> Any:
    """``i -> "line L"`` (JSON Lines: the 1-based line of record ``i``, blank lines skipped as the reader does),
    ``"row R"`` (Parquet, 1-based) or ``"record R"`` (a JSON array, a text file: 1-based): the numbers an editor
    shows."""
    if source == "parquet":
        return lambda i: f"row {i + 1}"
    if source == "json":
        with open(file, "rb") as f:
            head = f.read(4096).lstrip()
            if not head.startswith(b"["):  # JSON Lines: one record per non-blank line
                f.seek(0)
                numbers = [k for k, line in enumerate(f, start=1) if line.strip()]
                if len(numbers) == n:
                    return lambda i: f"line {numbers[i]}"
    return lambda i: f"record {i + 1}"


class _Encoder:
    """Text or chat -> token ids: bytes (``tokenizer=None``) or a local Hugging Face tokenizer."""

    def __init__(self, tokenizer: str | None, chat: bool) -> None:
        self.tokenizer, self.chat = tokenizer, chat
        if tokenizer is None:
            self.vocab_size = 256
            self._encode = lambda text: list(text.encode("utf-8"))
        else:
            self._encode, self.vocab_size = load_tokenizer(tokenizer)
        self._auto: Any = None
        if chat:
            if tokenizer is None:
                raise ValueError(
                    "data.messages_field is not valid with data.tokenizer=None: chats are rendered by the tokenizer's "
                    "chat template. Expected a local tokenizer directory with a chat_template."
                )
            from transformers import AutoTokenizer

            from lightning_par.hf.load import trust_remote_code

            self._auto = AutoTokenizer.from_pretrained(str(Path(tokenizer).expanduser()), local_files_only=True,
                                                       trust_remote_code=trust_remote_code())
            if not getattr(self._auto, "chat_template", None):
                raise ValueError(
                    f"data.tokenizer={tokenizer!r} is not valid with data.messages_field: it has no chat_template. "
                    f"Expected a tokenizer whose tokenizer_config.json holds one, or data.text_field for plain text."
                )
            self.vocab_size = max(self.vocab_size, len(self._auto))

    def text(self, text: str) -> list[int]:
        return self._encode(text)

    def messages(self, messages: list[Any]) -> list[int]:
        out = self._auto.apply_chat_template(messages, tokenize=True, return_dict=False)
        return list(out["input_ids"] if isinstance(out, Mapping) else out)


def _document(record: Any, where: str, text_field: str, messages_field: str | None, encoder: _Encoder) -> list[int]:
    """The token ids of one record (see the module docstring for what is refused)."""
    field = messages_field or text_field
    name = "data.messages_field" if messages_field else "data.text_field"
    if isinstance(record, str) and not messages_field:
        return encoder.text(record)
    if isinstance(record, (np.ndarray, torch.Tensor, list, tuple)) and not messages_field:
        ids = np.asarray(record)
        if ids.ndim == 1 and np.issubdtype(ids.dtype, np.integer):
            if len(ids) and (ids.min() < 0 or ids.max() >= encoder.vocab_size):
                raise ValueError(
                    f"{where} is not valid: its token ids span [{ids.min()}, {ids.max()}], outside the vocabulary of "
                    f"{encoder.vocab_size} (data.tokenizer={encoder.tokenizer!r})."
                )
            return ids.astype(np.int64).tolist()
    if not isinstance(record, Mapping):
        raise ValueError(
            f"{where} of type {type(record).__name__} is not valid: expected a mapping with {name}={field!r}, a "
            f"string, or a 1-D array of token ids."
        )
    if field not in record or record[field] is None:
        what = (f"the record has no such field (its fields: {sorted(record)})" if field not in record else
                f"the record has no value for it ({field!r} is missing or null in this record; the file's fields: "
                f"{sorted(record)})")
        raise ValueError(
            f"{name}={field!r} is not valid for {where}: {what}. Expected every record to have it; set {name} to the "
            f"field holding the {'chat messages' if messages_field else 'text'}, or fix the record."
        )
    value = record[field]
    if messages_field:
        if not isinstance(value, list) or not all(isinstance(m, Mapping) and "role" in m and "content" in m
                                                  for m in value):
            raise ValueError(
                f"{name}={field!r} of {where} is not valid: {str(value)[:120]!r}. Expected a list of "
                f"{{'role': ..., 'content': ...}} messages."
            )
        return encoder.messages([dict(m) for m in value])
    if not isinstance(value, str):
        raise ValueError(
            f"{name}={field!r} of {where} is not valid: a {type(value).__name__} ({str(value)[:80]!r}). Expected a "
            f"string."
        )
    return encoder.text(value)


def _digest(source: str, files: list[Path], *extra: Any) -> str:
    h = hashlib.sha256(repr((_FORMAT, source, *extra)).encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:24]


def document_cache_key(source: str, path: str, text_field: str = "text", messages_field: str | None = None,
                       tokenizer: str | None = None) -> str:
    """The document cache's key: a hash of the files' ``(path, size, mtime)``, the fields, the tokenizer files'
    contents and the format (``docs-<key>.tokens``)."""
    files = _litdata_files(path) if source == "litdata" else _files(source, path)
    return _digest(source, files, text_field, messages_field, tokenizer_file_digests(tokenizer))


def build_document_cache(source: str, path: str, text_field: str = "text", messages_field: str | None = None,
                         tokenizer: str | None = None, cache_dir: str | Path | None = None) -> tuple[Path, dict]:
    """Tokenize every record of ``path`` once into the document cache (see the module docstring), or reuse it.

    Returns:
        ``(token file, meta)``: ``meta`` holds ``offsets`` (``n_documents + 1`` ints), ``names`` (where each document
        came from), ``vocab_size``, ``records`` and ``skipped`` (empty records left out).

    Raises:
        ValueError: an unknown source, missing files, a bad record (see the module docstring), or no document.
    """
    if source not in SOURCES:
        raise ValueError(f"data.source={source!r} is not valid: expected one of {list(SOURCES)}.")
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    key = document_cache_key(source, path, text_field, messages_field, tokenizer)
    files = _litdata_files(path) if source == "litdata" else _files(source, path)
    token_path, meta_path = cache / f"docs-{key}.tokens", cache / f"docs-{key}.json"
    if token_path.is_file() and meta_path.is_file():
        return token_path, json.loads(meta_path.read_text())
    cache.mkdir(parents=True, exist_ok=True)
    encoder = _Encoder(tokenizer, messages_field is not None)
    dtype = token_dtype(encoder.vocab_size)
    offsets, names, records, skipped = [0], [], 0, 0
    tmp = token_path.with_suffix(f".tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as out:
            for record, where in _records(source, files, cache, path):
                records += 1
                ids = _document(record, where, text_field, messages_field, encoder)
                if len(ids) < 2:
                    skipped += 1
                    continue
                np.asarray(ids, dtype=dtype).tofile(out)
                offsets.append(offsets[-1] + len(ids))
                names.append(where)
    except BaseException:  # a refused record (or an interrupt): no partial file stays in the cache
        tmp.unlink(missing_ok=True)
        raise
    if len(offsets) < 2:
        tmp.unlink(missing_ok=True)
        raise ValueError(
            f"data.path={path!r} is not valid for data.source={source!r}: its {records} records give no document "
            f"(every text is empty or a single token). Expected records with text in "
            f"{'data.messages_field' if messages_field else 'data.text_field'}="
            f"{messages_field or text_field!r}."
        )
    if skipped:
        warnings.warn(f"data.path={path!r}: {skipped} of {records} records are empty (fewer than 2 tokens) and were "
                      f"left out.", stacklevel=2)
    meta = {"offsets": offsets, "names": names, "vocab_size": encoder.vocab_size, "dtype": dtype.name,
            "records": records, "skipped": skipped}
    os.replace(tmp, token_path)
    meta_tmp = meta_path.with_suffix(f".tmp{os.getpid()}")
    meta_tmp.write_text(json.dumps(meta))
    os.replace(meta_tmp, meta_path)
    return token_path, meta


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"data.{name}={value!r} is not valid: expected an integer >= {minimum}.")


class DocumentDataModule(L.LightningDataModule):
    """Documents from JSONL / Parquet / text files or a litdata dataset, packed into blocks (see the module
    docstring and :mod:`lightning_par.data.packing`).

    Args:
        source: ``"json"``, ``"parquet"``, ``"text"`` or ``"litdata"``.
        path: a file, a directory or a glob (``litdata``: the ``optimize`` output directory).
        text_field: the field holding a record's text.
        messages_field: the field holding a chat (list of messages), rendered with the tokenizer's chat template;
            ``None``: plain text from ``text_field``.
        tokenizer: a local Hugging Face tokenizer directory; ``None``: one token per byte (vocabulary 256).
        block_size: tokens per block (``seq`` of the model input).
        batch_size: blocks per micro-batch per dp replica.
        packing: ``"documents"`` (whole documents per block, attention masked per document; batches are mappings
            ``{"input_ids", "labels", "position_ids", "document_ids"}``) or ``"concat"`` (windows over the documents
            back to back, across their boundaries; batches ``(x, y)``).
        long_documents: ``"split"``, ``"truncate"`` or ``"error"`` (documents longer than a block, ``documents``).
        buffer_blocks: open blocks of the first-fit packer.
        val_every: one document in ``val_every`` is validation.
        val_batches: if set, validation uses at most ``val_batches * batch_size`` blocks.
        num_workers: DataLoader worker processes.
        seed: seed of the single-process shuffle.
        cache_dir: the token cache directory (``$LP_CACHE_DIR`` or ``~/.cache/lightning_par`` if None).

    Raises:
        ValueError: an invalid argument (naming ``data.<field>``), before anything is read.
    """

    def __init__(self, source: str = "json", path: str | None = None, text_field: str = "text",
                 messages_field: str | None = None, tokenizer: str | None = None, block_size: int = 128,
                 batch_size: int = 16, packing: str = "documents", long_documents: str = "split",
                 buffer_blocks: int = 64, val_every: int = 20, val_batches: int | None = None, num_workers: int = 0,
                 seed: int = 1234, cache_dir: str | None = None) -> None:
        super().__init__()
        if source not in SOURCES:
            raise ValueError(f"data.source={source!r} is not valid: expected one of {list(SOURCES)}.")
        if path is None:
            raise ValueError(f"data.path=None is not valid for data.source={source!r}: expected a file, directory or "
                             f"glob of your data.")
        if packing not in PACKING:
            raise ValueError(f"data.packing={packing!r} is not valid: expected one of {list(PACKING)}.")
        if long_documents not in LONG_DOCUMENTS:
            raise ValueError(
                f"data.long_documents={long_documents!r} is not valid: expected one of {list(LONG_DOCUMENTS)}.")
        for name, value, minimum in (("block_size", block_size, 1), ("batch_size", batch_size, 1),
                                     ("buffer_blocks", buffer_blocks, 1), ("val_every", val_every, 2),
                                     ("num_workers", num_workers, 0), ("seed", seed, 0)):
            _check_int(name, value, minimum)
        if val_batches is not None:
            _check_int("val_batches", val_batches, 1)
        if not isinstance(text_field, str) or not text_field:
            raise ValueError(f"data.text_field={text_field!r} is not valid: expected a field name.")
        self.save_hyperparameters()
        self.source, self.path, self.text_field, self.messages_field = source, path, text_field, messages_field
        self.tokenizer, self.block_size, self.batch_size, self.packing = tokenizer, block_size, batch_size, packing
        self.long_documents, self.buffer_blocks, self.val_every = long_documents, buffer_blocks, val_every
        self.val_batches, self.num_workers, self.seed, self.cache_dir = val_batches, num_workers, seed, cache_dir
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self._meta: dict | None = None
        self._pending_state: dict | None = None
        self._fingerprint: dict | None = None

    # ------------------------------------------------------------------ the cache
    def documents(self) -> tuple[np.ndarray, dict]:
        """``(tokens, meta)`` of the document cache, built on first use (:func:`build_document_cache`)."""
        fingerprint = self.fingerprint()  # of the files read now (an edit after this is another run's data)
        path, meta = build_document_cache(self.source, self.path, self.text_field, self.messages_field,
                                          self.tokenizer, self.cache_dir)
        self._meta, self._fingerprint = meta, fingerprint
        return np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r"), meta

    def fingerprint(self) -> dict[str, Any]:
        """What the run trains on (:mod:`lightning_par.data.fingerprint`): the tokenizer files' contents, the token
        cache's key and the packing settings; saved in checkpoints, compared on resume. Once the data is read, the
        fingerprint of what was read."""
        if self._fingerprint is not None:
            return dict(self._fingerprint)
        return {
            "tokenizer": tokenizer_digest(self.tokenizer),
            "token_cache": "docs-" + document_cache_key(self.source, self.path, self.text_field, self.messages_field,
                                                        self.tokenizer),
            "packing": {"packing": self.packing, "block_size": self.block_size, "long_documents": self.long_documents,
                        "buffer_blocks": self.buffer_blocks, "val_every": self.val_every},
        }

    @property
    def vocab_size(self) -> int:
        """Token ids are below this: 256 for bytes, else the tokenizer's vocabulary (added tokens included)."""
        if self._meta is not None:
            return int(self._meta["vocab_size"])
        if self.tokenizer is None:
            return 256
        return load_tokenizer(self.tokenizer)[1]

    def prepare_data(self) -> None:
        """Build the document cache (Lightning calls this on local rank 0 only)."""
        self.documents()

    def _split(self, n: int) -> tuple[list[int], list[int]]:
        val = [d for d in range(n) if d % self.val_every == self.val_every - 1] or [n - 1]
        chosen = set(val)
        return [d for d in range(n) if d not in chosen], val

    def _dataset(self, tokens: np.ndarray, offsets: np.ndarray, docs: list[int], names: list[str]) -> Dataset:
        lengths = np.diff(offsets)[docs]
        sub_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        flat = np.concatenate([np.asarray(tokens[offsets[d]:offsets[d + 1]]) for d in docs]) if docs else \
            np.empty(0, dtype=tokens.dtype)
        if self.packing == "concat":
            return TokenWindowDataset(flat, self.block_size)
        return PackedBlocks(flat, sub_offsets, self.block_size, self.long_documents, self.buffer_blocks,
                            names=[names[d] for d in docs])

    def setup(self, stage: str | None = None) -> None:
        """Read the cache, split the documents and pack them; idempotent.

        Raises:
            ValueError: a document too long under ``long_documents="error"``, or too little data for one training
                batch and one validation block.
        """
        if self.train_dataset is not None:
            return
        tokens, meta = self.documents()
        offsets = np.asarray(meta["offsets"], dtype=np.int64)
        n = len(offsets) - 1
        if n < 2:
            raise ValueError(
                f"data.path={self.path!r} gives {n} document: expected at least 2 (one for training, one for "
                f"validation)."
            )
        train_docs, val_docs = self._split(n)
        self.train_dataset = self._dataset(tokens, offsets, train_docs, meta["names"])
        val = self._dataset(tokens, offsets, val_docs, meta["names"])
        if self.val_batches is not None:
            val = Subset(val, range(min(len(val), self.val_batches * self.batch_size)))
        self.val_dataset = val
        if self._pending_state is not None:
            self.load_state_dict(self._pending_state)

    def check_corpus(self, replicas: int = 1) -> None:
        """Build the cache, pack, and check that every dp replica gets one training batch, before any process starts.

        Raises:
            ValueError: a bad record (see the module docstring), or too little data.
        """
        self.setup("fit")
        n_train = len(self.train_dataset)  # type: ignore[arg-type]
        per_replica = n_train // replicas
        unit = "blocks" if self.packing == "documents" else "windows"
        if per_replica < self.batch_size or len(self.val_dataset) < 1:  # type: ignore[arg-type]
            raise ValueError(
                f"data.path={self.path!r} is too small for data.batch_size={self.batch_size}, "
                f"data.block_size={self.block_size} and dp_size={replicas}: it gives {n_train} training {unit} "
                f"({per_replica} per dp replica) and {len(self.val_dataset)} validation {unit}. Expected at least "
                f"{replicas * self.batch_size} and 1; use more data or smaller sizes."  # type: ignore[arg-type]
            )

    # ------------------------------------------------------------------ loaders
    def train_dataloader(self) -> DataLoader:
        """Shuffled, ``drop_last`` batches of blocks (resumable mid-epoch, see
        :class:`~lightning_par.data.resumable.ResumableDataLoader`); under a distributed strategy Lightning's sampler
        splits them over the dp ranks."""
        self.setup("fit")
        return ResumableDataLoader(self.train_dataset, batch_size=self.batch_size, shuffle=True, drop_last=True,
                                   num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
                                   generator=torch.Generator().manual_seed(self.seed))

    def val_dataloader(self) -> DataLoader:
        """Validation blocks in order (the last batch may be short)."""
        self.setup("validate")
        return DataLoader(self.val_dataset, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers,
                          persistent_workers=self.num_workers > 0)

    # ------------------------------------------------------------------ state and figures
    def state_dict(self) -> dict[str, Any]:
        """The packing's identity (:meth:`PackedBlocks.state_dict`) for the checkpoint; the position within the epoch
        is the training loader's (Lightning saves it too)."""
        ds = self.train_dataset
        state = {"packing": ds.state_dict()} if isinstance(ds, PackedBlocks) else {}
        return {**state, "fingerprint": self.fingerprint()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Check, on resume, that the checkpoint was made from the same data: its fingerprint (tokenizer files, token
        cache key, packing settings), then the packing itself.

        Raises:
            ValueError: naming what changed (old -> new); see also :meth:`PackedBlocks.load_state_dict`.
        """
        if "packing" not in state_dict and "fingerprint" not in state_dict:
            return
        if self.train_dataset is None:  # Lightning restores before setup: check when the data is built
            self._pending_state = state_dict
            return
        self._pending_state = None
        changes = fingerprint_changes(state_dict.get("fingerprint"), self.fingerprint())
        if changes:
            raise ValueError(
                f"the data is not the checkpoint's: {'; '.join(changes)}. A resume continues the same token stream: "
                f"resume with the checkpoint's data and tokenizer, or start a new run from the checkpoint's weights "
                f"(lightning_par.checkpoint.load_model_weights)."
            )
        if isinstance(self.train_dataset, PackedBlocks) and "packing" in state_dict:
            self.train_dataset.load_state_dict(state_dict["packing"])

    def packing_stats(self) -> dict[str, Any]:
        """The training packing's figures (``data_*`` keys: blocks, documents, padding fraction, documents per block,
        skipped and split documents, counted tokens per block)."""
        self.setup("fit")
        meta = self._meta or {}
        out: dict[str, Any] = {"data_source": self.source, "data_packing": self.packing,
                               "data_documents_total": len(meta.get("offsets", [0])) - 1,
                               "data_skipped_documents": meta.get("skipped", 0)}
        ds = self.train_dataset
        if isinstance(ds, PackedBlocks):
            s = ds.stats
            out.update(data_blocks=s.blocks, data_documents=s.documents, data_padding_fraction=s.padding_fraction,
                       data_documents_per_block=s.documents_per_block, data_split_documents=s.split,
                       data_tokens_per_block=s.tokens / s.blocks if s.blocks else 0.0)
        return out

    def metrics_callback(self) -> PackingMetricsCallback:
        """The callback that logs the figures per step and puts them in ``summary.json``."""
        return PackingMetricsCallback(self)


class PackingMetricsCallback(L.Callback):
    """Logs, each training step, ``data/tokens_counted`` (the global batch's tokens that count: labels that are not
    ignored, summed over the dp replicas), ``data/padding_fraction`` and ``data/documents_per_block`` (of this
    rank's micro-batch), and gives the packing's figures to ``summary.json`` (``summary_extras``).

    Args:
        datamodule: the :class:`DocumentDataModule` (or anything with ``packing_stats()``).
    """

    def __init__(self, datamodule: Any) -> None:
        self.datamodule = datamodule
        self.counted: list[float] = []

    @staticmethod
    def _sum_over_dp(trainer: L.Trainer, value: float) -> float:
        """``value`` summed over the dp replicas (collective over the dp group of a lightning_par strategy; over the
        world under another multi-process strategy, whose every rank is a replica)."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return value
        dims = getattr(getattr(trainer.strategy, "parallel", None), "dims", None)
        if dims is not None and dims.dp_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=trainer.strategy.root_device)
        dist.all_reduce(t, group=dims.group("dp") if dims is not None else None)
        return float(t[0])

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not isinstance(batch, Mapping) or "labels" not in batch:
            labels = batch[1] if isinstance(batch, (tuple, list)) and len(batch) > 1 else None
            if labels is None:
                return
            counted, padding, docs = float(labels.numel()), 0.0, None
        else:
            labels = batch["labels"]
            counted = float((labels != -100).sum())
            padding = 1.0 - counted / max(1, labels.numel())
            documents = batch.get("document_ids")
            # documents per block: the padding (if any) is one more document id of its own
            docs = None
            if documents is not None:
                per = (documents.max(dim=1).values + 1).float() - (labels[:, -1] == -100).float()
                docs = float(per.mean())
        # The loader's batch is the whole micro-batch on every rank of a replica: summed over the dp replicas.
        total = self._sum_over_dp(trainer, counted)
        self.counted.append(total)
        pl_module.log("data/tokens_counted", total, on_step=True, on_epoch=False)
        pl_module.log("data/padding_fraction", padding, on_step=True, on_epoch=False)
        if docs is not None:
            pl_module.log("data/documents_per_block", docs, on_step=True, on_epoch=False)

    def summary_extras(self) -> dict[str, Any]:
        """The packing figures and the mean counted tokens per step (``data_tokens_counted_per_step``)."""
        out = dict(self.datamodule.packing_stats())
        if self.counted:
            out["data_tokens_counted_per_step"] = sum(self.counted) / len(self.counted)
        return out
