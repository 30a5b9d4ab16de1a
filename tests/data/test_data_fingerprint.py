"""The data a run trains on, fingerprinted in its checkpoints (issue 50): a tokenizer edited in place, another token
cache or other packing settings are refused on resume, naming what changed (old -> new); the same tokenizer files at
another path are accepted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lightning_par.checkpoint.compat import check_resume, resume_changes
from lightning_par.data.datasets import DocumentDataModule
from tests.data.test_tokenizer import word_level

WORDS = "alpha beta gamma delta epsilon zeta eta theta".split()


def _dm(tmp_path: Path, tokenizer: Path, **kwargs) -> DocumentDataModule:
    path = tmp_path / "train.jsonl"
    if not path.exists():
        path.write_text("".join(json.dumps({"text": " ".join(WORDS[(i + j) % 8] for j in range(3 + i % 5))}) + "\n"
                                for i in range(80)))
    return DocumentDataModule(source="json", path=str(path), tokenizer=str(tokenizer), block_size=16, batch_size=2,
                              cache_dir=str(tmp_path / "c"), **kwargs)


def _swap_two_ids(tokenizer: Path) -> None:
    """Edit ``tokenizer.json`` in place: two words exchange their ids (same vocabulary size, same lengths)."""
    spec = json.loads((tokenizer / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["alpha"], vocab["beta"] = vocab["beta"], vocab["alpha"]
    (tokenizer / "tokenizer.json").write_text(json.dumps(spec))


def _meta(dm: DocumentDataModule) -> dict:
    """What a checkpoint's meta.pt holds of the data: its hyper-parameters and its state."""
    return {"hyper_parameters": {}, "datamodule_hyper_parameters": dict(dm.hparams),
            type(dm).__qualname__: dm.state_dict()}


def test_a_tokenizer_edited_in_place_is_refused_naming_it(tmp_path: Path) -> None:
    tok = word_level(tmp_path / "tokA", WORDS)
    saved = _dm(tmp_path, tok)
    saved.setup()
    meta = _meta(saved)
    assert meta["DocumentDataModule"]["fingerprint"]["tokenizer"].startswith("sha256:")
    _swap_two_ids(tok)
    resumed = _dm(tmp_path, tok)
    refused, _ = resume_changes(meta, {}, dict(resumed.hparams), data_fingerprint=resumed.fingerprint())
    named = "data tokenizer files' contents (data.tokenizer): 'sha256:"
    assert any(line.startswith(named) for line in refused), refused
    assert any(line.startswith("data token cache key: 'docs-") for line in refused), refused
    with pytest.raises(ValueError, match=r"cannot be resumed with these settings: data tokenizer files' contents "
                                         r"\(data.tokenizer\): 'sha256:[0-9a-f]{16}' -> 'sha256:[0-9a-f]{16}'"):
        check_resume("ckpt", meta, {}, dict(resumed.hparams), data_fingerprint=resumed.fingerprint())
    # the ranks check too (a resume outside the recipe's preflight): when the data is built
    resumed.load_state_dict(meta["DocumentDataModule"])
    with pytest.raises(ValueError, match=r"the data is not the checkpoint's: data tokenizer files' contents"):
        resumed.setup()


def test_the_same_tokenizer_at_another_path_is_accepted(tmp_path: Path) -> None:
    tok = word_level(tmp_path / "tokA", WORDS)
    saved = _dm(tmp_path, tok)
    saved.setup()
    meta = _meta(saved)
    copy = Path(shutil.copytree(tok, tmp_path / "elsewhere" / "tokB"))
    resumed = _dm(tmp_path, copy)
    refused, applied = resume_changes(meta, {}, dict(resumed.hparams), data_fingerprint=resumed.fingerprint())
    assert refused == []
    assert applied == [f"data tokenizer: {str(tok)!r} -> {str(copy)!r} (the same tokenizer files)"]
    resumed.load_state_dict(meta["DocumentDataModule"])
    resumed.setup()  # the ranks' check passes too
    # without fingerprints (a checkpoint of an older version) a new tokenizer path is still refused
    refused, _ = resume_changes({k: v for k, v in meta.items() if k != "DocumentDataModule"}, {},
                                dict(resumed.hparams))
    assert refused == [f"data tokenizer: {str(tok)!r} -> {str(copy)!r}"]


def test_other_packing_settings_are_named(tmp_path: Path) -> None:
    tok = word_level(tmp_path / "tokA", WORDS)
    saved = _dm(tmp_path, tok)
    saved.setup()
    resumed = _dm(tmp_path, tok, buffer_blocks=8)
    refused, _ = resume_changes(_meta(saved), {}, None, data_fingerprint=resumed.fingerprint())
    assert refused == ["data packing.buffer_blocks: 64 -> 8"]
