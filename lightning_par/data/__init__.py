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

__all__ = [
    "VOCAB_SIZE",
    "ByteCorpusDataModule",
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
