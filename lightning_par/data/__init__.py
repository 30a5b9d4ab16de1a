"""Byte-level corpora (the Python standard library by default) and the DataModule that serves them."""

from lightning_par.data.corpus import build_token_file, default_cache_dir, load_tokens, stdlib_files
from lightning_par.data.datamodule import (
    VOCAB_SIZE,
    ByteCorpusDataModule,
    TokenWindowDataset,
    make_synthetic_tokens,
    split_lengths,
    split_tokens,
)
from lightning_par.data.resumable import ResumableDataLoader


def __getattr__(name: str):  # the document data (optional extras) loads on first use
    if name in ("DocumentDataModule", "PackingMetricsCallback", "build_document_cache"):
        from lightning_par.data import datasets

        return getattr(datasets, name)
    if name in ("PackedBlocks", "DocumentPacker", "PackingStats"):
        from lightning_par.data import packing

        return getattr(packing, name)
    if name in ("document_attention", "DocumentAttentionMode", "document_mask"):
        from lightning_par.data import doc_mask

        return getattr(doc_mask, name)
    raise AttributeError(f"module 'lightning_par.data' has no attribute {name!r}")

__all__ = [
    "VOCAB_SIZE",
    "ByteCorpusDataModule",
    "DocumentAttentionMode",
    "DocumentDataModule",
    "DocumentPacker",
    "PackedBlocks",
    "PackingMetricsCallback",
    "PackingStats",
    "build_document_cache",
    "document_attention",
    "document_mask",
    "ResumableDataLoader",
    "TokenWindowDataset",
    "build_token_file",
    "default_cache_dir",
    "load_tokens",
    "make_synthetic_tokens",
    "split_lengths",
    "split_tokens",
    "stdlib_files",
]
