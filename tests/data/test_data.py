"""Unit tests of the byte corpus, the windows, the split and the DataModule (single process, seconds)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_par.data import (
    ByteCorpusDataModule,
    TokenWindowDataset,
    build_token_file,
    default_cache_dir,
    load_tokens,
    make_synthetic_tokens,
    split_tokens,
    stdlib_files,
)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("LP_CACHE_DIR", str(path))
    return path


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "b.txt").write_bytes(b"second file\n")
    (root / "sub" / "a.py").write_bytes(b"print('first')\n")
    (root / "blob.bin").write_bytes(b"\x00\x01binary")
    (root / ".hidden").write_bytes(b"hidden")
    return root


def test_split_is_deterministic_disjoint_and_complete() -> None:
    tokens = np.arange(45 * 10, dtype=np.int64)  # 45 chunks of 10: chunks 19 and 39 are validation
    train, val = split_tokens(tokens, val_every=20, chunk=10)
    np.testing.assert_array_equal(val, np.r_[190:200, 390:400])
    assert len(train) + len(val) == len(tokens)
    assert not set(train.tolist()) & set(val.tolist())
    again_train, again_val = split_tokens(tokens, val_every=20, chunk=10)
    np.testing.assert_array_equal(train, again_train)
    np.testing.assert_array_equal(val, again_val)
    assert len(split_tokens(tokens[:100], chunk=10)[1]) == 0
    with pytest.raises(ValueError, match="val_every=1"):
        split_tokens(tokens, val_every=1)


def test_windows_are_shifted_by_one() -> None:
    tokens = np.arange(100, dtype=np.uint8)
    ds = TokenWindowDataset(tokens, block_size=8)
    assert len(ds) == (100 - 1) // 8
    x, y = ds[2]
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (8,)
    assert x.tolist() == list(range(16, 24)) and y.tolist() == list(range(17, 25))
    last_x, last_y = ds[len(ds) - 1]
    assert last_y[-1].item() <= 99
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(ValueError, match="block_size=0"):
        TokenWindowDataset(tokens, block_size=0)


def test_user_directory_and_cache_reuse(cache: Path, corpus_dir: Path) -> None:
    assert default_cache_dir() == cache
    path = build_token_file(corpus_dir, None)
    assert path.parent == cache and path.suffix == ".bin"
    assert load_tokens(path).tobytes() == b"second file\nprint('first')\n"  # sorted, binary and hidden skipped
    mtime = path.stat().st_mtime_ns
    assert build_token_file(corpus_dir, None) == path
    assert path.stat().st_mtime_ns == mtime
    assert not list(cache.glob(".tmp-*"))
    (corpus_dir / "c.txt").write_bytes(b"third\n")
    assert build_token_file(corpus_dir, None) != path


def test_single_file_and_errors(tmp_path: Path, cache: Path) -> None:
    text = tmp_path / "one.txt"
    text.write_bytes(b"hello bytes")
    assert load_tokens(build_token_file(text, tmp_path / "c2")).tobytes() == b"hello bytes"
    with pytest.raises(ValueError, match="does not exist"):
        build_token_file(tmp_path / "missing", None)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="0 bytes"):
        build_token_file(empty, None)
    with pytest.raises(ValueError, match="does not exist"):
        ByteCorpusDataModule(path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="batch_size=0"):
        ByteCorpusDataModule(batch_size=0)


def test_stdlib_files_listing() -> None:
    files = stdlib_files()
    assert files == sorted(files) and len(files) > 500
    assert all(f.suffix == ".py" for f in files)
    assert not any({"site-packages", "dist-packages"} & set(f.parts) for f in files)


def test_synthetic_datamodule_is_deterministic() -> None:
    np.testing.assert_array_equal(make_synthetic_tokens(5000, seed=3), make_synthetic_tokens(5000, seed=3))
    assert not np.array_equal(make_synthetic_tokens(5000, seed=3), make_synthetic_tokens(5000, seed=4))
    dm = ByteCorpusDataModule(synthetic=True, synthetic_tokens=50_000, block_size=16, batch_size=4, val_batches=2)
    assert dm.vocab_size == 256
    dm.prepare_data()
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert sum(1 for _ in dm.val_dataloader()) == 2


def test_datamodule_on_user_directory(cache: Path, corpus_dir: Path) -> None:
    (corpus_dir / "big.txt").write_bytes(bytes(range(32, 127)) * 200)
    dm = ByteCorpusDataModule(path=str(corpus_dir), block_size=8, batch_size=4)
    dm.prepare_data()
    dm.setup("fit")
    assert len(dm.train_dataset) >= 4 and len(dm.val_dataset) >= 1
    x, _ = next(iter(dm.val_dataloader()))
    assert x.shape[1] == 8
    tiny = ByteCorpusDataModule(path=str(corpus_dir / "b.txt"), block_size=8, batch_size=4)
    with pytest.raises(ValueError, match="too small"):
        tiny.setup("fit")


@pytest.mark.e2e
def test_stdlib_corpus_builds(tmp_path: Path) -> None:
    path = build_token_file(None, tmp_path)
    assert path.stat().st_size > 5_000_000
    assert path.stat().st_size == sum(f.stat().st_size for f in stdlib_files())
