"""Packing whole documents into fixed-length blocks (``data.packing=documents``), and the blocks as a dataset.

A document of ``L`` tokens gives ``L - 1`` next-token pairs (``x = doc[:-1]``, ``y = doc[1:]``): its pairs go into
one block, never across two, so no label is the first token of another document. :class:`DocumentPacker` is a
first-fit packer over a bounded buffer of open blocks (Johnson 1973's first-fit, with at most ``buffer_blocks`` blocks
open: a document goes into the first open block with room for it, else a new block is opened and, when more than
``buffer_blocks`` are open, the oldest is closed). Documents keep their order within a block; the order of the
closed blocks depends only on the documents' lengths and order, never on a seed or the number of ranks.

A block (:class:`PackedBlocks`, item ``i``) is a mapping of ``(block_size,)`` int64 tensors:

* ``input_ids``: the documents' ``x`` back to back, then padding (token 0);
* ``labels``: their ``y``, then :data:`~lightning_par.contract.IGNORE_INDEX` (-100) on the padding, so a token-mean
  loss counts the documents' tokens only;
* ``position_ids``: ``0 .. len - 1`` for each document (positions restart), and for the padding;
* ``document_ids``: ``0, 0, ..., 1, 1, ...`` in the block, the padding one more document of its own: attention is
  masked per document (:mod:`lightning_par.data.doc_mask`).

Documents longer than a block (``L - 1 > block_size``) are handled by ``long_documents``: ``"split"`` (default: cut
into pieces of ``block_size`` pairs, each packed as a document of its own, positions restarting), ``"truncate"`` (its
first ``block_size`` pairs only) or ``"error"`` (a ``ValueError`` naming the document and its length, before
training). A document of fewer than 2 tokens gives no pair and is skipped (counted in :attr:`PackingStats.skipped`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["LONG_DOCUMENTS", "PACKING", "DocumentPacker", "PackedBlocks", "PackingStats", "pieces_of", "pack"]

#: ``data.packing`` values: ``concat`` (fixed windows over the documents back to back, across their boundaries) or
#: ``documents`` (whole documents per block, attention masked per document).
PACKING = ("concat", "documents")
#: ``data.long_documents`` values (documents longer than a block under ``packing=documents``).
LONG_DOCUMENTS = ("split", "truncate", "error")

IGNORE_INDEX = -100


@dataclass
class PackingStats:
    """Figures of a packing.

    Attributes:
        blocks: blocks made.
        documents: documents (pieces, after ``long_documents="split"``) packed.
        tokens: counted tokens (label positions that are not padding) over all blocks.
        padding_fraction: padding tokens / (``blocks * block_size``), in ``[0, 1)``.
        documents_per_block: ``documents / blocks``.
        skipped: documents of fewer than 2 tokens (no next-token pair), left out.
        split: documents longer than a block that were cut into pieces (``"split"``) or cut short (``"truncate"``).
    """

    blocks: int
    documents: int
    tokens: int
    padding_fraction: float
    documents_per_block: float
    skipped: int
    split: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def pieces_of(length: int, block_size: int, long_documents: str, where: str = "") -> list[tuple[int, int]]:
    """The ``(start, stop)`` token ranges a document of ``length`` tokens is packed as: ``[(0, length)]`` when its
    ``length - 1`` pairs fit a block, else per ``long_documents`` (see the module docstring). Ranges overlap by one
    token so that every pair is kept; empty for ``length < 2``.

    Raises:
        ValueError: ``long_documents="error"`` and the document is longer than a block (``where`` names it).
    """
    if length < 2:
        return []
    if length - 1 <= block_size:
        return [(0, length)]
    if long_documents == "error":
        raise ValueError(
            f"{where or 'a document'} of {length} tokens ({length - 1} next-token pairs) is not valid with "
            f"data.long_documents='error': it is longer than a block (block_size={block_size}). Expected documents of "
            f"at most block_size + 1 tokens, or data.long_documents='split' (pieces of block_size pairs, each its own "
            f"document) or 'truncate' (its first block_size pairs)."
        )
    if long_documents == "truncate":
        return [(0, block_size + 1)]
    return [(s, min(s + block_size + 1, length)) for s in range(0, length - 1, block_size)]


class DocumentPacker:
    """First-fit packing of documents (given by their pair counts) into blocks of ``block_size`` pairs, over at most
    ``buffer_blocks`` open blocks (see the module docstring). Stateful, so that a stream can be packed in pieces and
    resumed: :meth:`state_dict` holds the open blocks and the count of blocks closed so far.

    Args:
        block_size: pairs (tokens of ``input_ids``) per block.
        buffer_blocks: open blocks a document may go into; more packs tighter and holds more documents back.

    Raises:
        ValueError: a size that is not a positive integer.
    """

    def __init__(self, block_size: int, buffer_blocks: int = 64) -> None:
        for name, value in (("block_size", block_size), ("buffer_blocks", buffer_blocks)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DocumentPacker {name}={value!r} is not valid: expected a positive integer.")
        self.block_size, self.buffer_blocks = block_size, buffer_blocks
        self._open: list[list[tuple[Any, int]]] = []  # per open block: (document key, pairs)
        self._free: list[int] = []
        self.closed = 0

    def add(self, key: Any, pairs: int) -> list[list[tuple[Any, int]]]:
        """Put a document of ``pairs`` pairs (``1 <= pairs <= block_size``) into the first open block with room;
        returns the blocks this closes (oldest first), each a list of ``(key, pairs)``.

        Raises:
            ValueError: ``pairs`` outside ``[1, block_size]``.
        """
        if not 1 <= pairs <= self.block_size:
            raise ValueError(f"document {key!r} of {pairs} pairs does not fit a block of {self.block_size}.")
        for i, free in enumerate(self._free):
            if pairs <= free:
                self._open[i].append((key, pairs))
                self._free[i] -= pairs
                break
        else:
            self._open.append([(key, pairs)])
            self._free.append(self.block_size - pairs)
        closed = []
        while len(self._open) > self.buffer_blocks or (self._free and self._free[0] == 0):
            closed.append(self._open.pop(0))
            self._free.pop(0)
        self.closed += len(closed)
        return closed

    def flush(self) -> list[list[tuple[Any, int]]]:
        """Close every open block (the end of the data)."""
        closed, self._open, self._free = self._open, [], []
        self.closed += len(closed)
        return closed

    def state_dict(self) -> dict[str, Any]:
        """``{"open", "closed", "block_size", "buffer_blocks"}``: the open blocks (the packer buffer) and how many were
        closed."""
        return {"open": [list(b) for b in self._open], "closed": self.closed, "block_size": self.block_size,
                "buffer_blocks": self.buffer_blocks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`.

        Raises:
            ValueError: the state was made with another ``block_size``.
        """
        if state["block_size"] != self.block_size:
            raise ValueError(
                f"block_size={self.block_size} is not valid for this packer state: it was packed with "
                f"block_size={state['block_size']}. Resume with data.block_size={state['block_size']}."
            )
        self._open = [[tuple(d) for d in b] for b in state["open"]]
        self._free = [self.block_size - sum(p for _, p in b) for b in self._open]
        self.closed = int(state["closed"])


def pack(lengths: Iterable[int], block_size: int, long_documents: str = "split", buffer_blocks: int = 64,
         names: Sequence[str] | None = None) -> tuple[list[list[tuple[int, int, int]]], PackingStats]:
    """Pack documents of the given token lengths into blocks.

    Args:
        lengths: tokens per document, in order.
        block_size: pairs per block.
        long_documents: ``"split"``, ``"truncate"`` or ``"error"`` (see the module docstring).
        buffer_blocks: see :class:`DocumentPacker`.
        names: optional names of the documents for error messages (``"record 3 of data.jsonl"``).

    Returns:
        ``(blocks, stats)``: each block a list of ``(document index, start, stop)`` token ranges (``stop - start - 1``
        pairs each), and the :class:`PackingStats`.

    Raises:
        ValueError: an invalid ``long_documents``, or a document too long under ``"error"``.
    """
    if long_documents not in LONG_DOCUMENTS:
        raise ValueError(f"data.long_documents={long_documents!r} is not valid: expected one of {list(LONG_DOCUMENTS)}.")
    packer = DocumentPacker(block_size, buffer_blocks)
    blocks: list[list[tuple[int, int, int]]] = []
    skipped = split = pieces_total = tokens = 0
    for index, length in enumerate(lengths):
        where = names[index] if names is not None else f"document {index}"
        pieces = pieces_of(int(length), block_size, long_documents, where)
        if not pieces:
            skipped += 1
            continue
        split += len(pieces) > 1 or pieces[0][1] < length
        for start, stop in pieces:
            pieces_total += 1
            tokens += stop - start - 1
            for block in packer.add((index, start, stop), stop - start - 1):
                blocks.append([key for key, _ in block])
    blocks.extend([key for key, _ in block] for block in packer.flush())
    n = len(blocks)
    stats = PackingStats(blocks=n, documents=pieces_total, tokens=tokens,
                         padding_fraction=(1.0 - tokens / (n * block_size)) if n else 0.0,
                         documents_per_block=pieces_total / n if n else 0.0, skipped=skipped, split=split)
    return blocks, stats


class PackedBlocks(Dataset):
    """Blocks of whole documents over a flat token array (see the module docstring for an item).

    Args:
        tokens: ``(n_tokens,)`` integer array: every document's tokens back to back.
        offsets: ``(n_documents + 1,)`` int64, document ``d`` is ``tokens[offsets[d]:offsets[d + 1]]``.
        block_size: tokens per block.
        long_documents: see the module docstring.
        buffer_blocks: see :class:`DocumentPacker`.
        names: optional document names for error messages.

    Raises:
        ValueError: see :func:`pack`; or no document gives a pair.
    """

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray, block_size: int, long_documents: str = "split",
                 buffer_blocks: int = 64, names: Sequence[str] | None = None) -> None:
        self.tokens, self.offsets, self.block_size = tokens, np.asarray(offsets, dtype=np.int64), block_size
        lengths = np.diff(self.offsets)
        self.blocks, self.stats = pack(lengths.tolist(), block_size, long_documents, buffer_blocks, names)
        self._digest = hashlib.sha256(repr((block_size, long_documents, buffer_blocks, lengths.tolist())).encode())

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"block index {index} is out of range for {n} blocks.")
        b = self.block_size
        ids = np.zeros(b, dtype=np.int64)
        labels = np.full(b, IGNORE_INDEX, dtype=np.int64)
        positions = np.zeros(b, dtype=np.int64)
        documents = np.zeros(b, dtype=np.int64)
        at = 0
        pieces = self.blocks[index % n]
        for d, (doc, start, stop) in enumerate(pieces):
            base = int(self.offsets[doc])
            window = np.asarray(self.tokens[base + start: base + stop], dtype=np.int64)
            k = len(window) - 1
            ids[at:at + k], labels[at:at + k] = window[:-1], window[1:]
            positions[at:at + k] = np.arange(k)
            documents[at:at + k] = d
            at += k
        positions[at:] = np.arange(b - at)
        documents[at:] = len(pieces)
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels),
                "position_ids": torch.from_numpy(positions), "document_ids": torch.from_numpy(documents)}

    def documents_of(self, index: int) -> list[tuple[int, int, int]]:
        """The ``(document index, start, stop)`` ranges block ``index`` holds, in order."""
        return list(self.blocks[index])

    def state_dict(self) -> dict[str, Any]:
        """What identifies this packing (blocks, block size, a digest of the document lengths and options): the
        packing is made once, whole, so a position in it is a block index (the loader's, see
        :class:`~lightning_par.data.resumable.ResumableDataLoader`)."""
        return {"blocks": len(self.blocks), "block_size": self.block_size, "digest": self._digest.hexdigest()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Check that a checkpoint's packing is this one.

        Raises:
            ValueError: the checkpoint was made on other documents, another ``block_size`` or other packing options:
                its block indices would name other blocks.
        """
        mine = self.state_dict()
        if state.get("digest") != mine["digest"]:
            raise ValueError(
                f"the data's packing is not the checkpoint's: it has {mine['blocks']} blocks of "
                f"{mine['block_size']} tokens, the checkpoint's had {state.get('blocks')} blocks of "
                f"{state.get('block_size')} (other documents, block_size or long_documents/buffer_blocks). Resume "
                f"on the same data with the same data.block_size and packing options."
            )
