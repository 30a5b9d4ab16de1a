"""``data.tokenizer=DIR``: a local tokenizer (built here with ``tokenizers``, nothing downloaded) tokenizes the corpus
once into the token cache; its vocabulary size reaches the run's vocabulary check."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from lightning_par.data import ByteCorpusDataModule
from lightning_par.data.corpus import load_tokens
from lightning_par.data.tokenize import build_tokenized_file, load_tokenizer

WORDS = [f"w{i}" for i in range(298)]  # + [UNK] + [PAD] = 300 ids: more than a byte holds


def word_level(directory: Path, words: list[str] = WORDS) -> Path:
    """A WordLevel tokenizer over ``words`` (whitespace split), saved as ``DIR/tokenizer.json``."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[UNK]": 0, "[PAD]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory


def bpe_for_auto_tokenizer(directory: Path, text: str) -> Path:
    """A byte-level BPE trained on ``text``, saved as ``vocab.json`` + ``merges.txt`` + ``tokenizer_config.json``
    (no ``tokenizer.json``): only ``AutoTokenizer`` reads it."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([text], vocab_size=300, min_frequency=1, show_progress=False)
    directory.mkdir(parents=True, exist_ok=True)
    bpe.save_model(str(directory))
    (directory / "tokenizer_config.json").write_text('{"tokenizer_class": "GPT2Tokenizer"}')
    return directory


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    rng = np.random.default_rng(0)
    (root / "b.txt").write_text(" ".join(WORDS[i] for i in rng.integers(0, len(WORDS), 3000)))
    (root / "a.txt").write_text("w1 w299 w297\n")  # w299 is unknown
    (root / "blob.bin").write_bytes(b"\0\1\2")  # binary: skipped
    return root


def test_corpus_tokenized_once_into_the_cache(corpus, tmp_path, monkeypatch):
    tok = word_level(tmp_path / "tok")
    encode, vocab = load_tokenizer(tok)
    path, size = build_tokenized_file(corpus, tok, tmp_path / "cache")
    assert (size, vocab) == (300, 300)
    ids = load_tokens(path)
    assert ids.dtype == np.uint16
    expected = encode((corpus / "a.txt").read_text()) + encode((corpus / "b.txt").read_text())  # sorted order
    assert ids.tolist() == expected
    assert expected[:3] == [3, 0, 299] and ids.max() > 255
    # A second build reads nothing: the cache is found by name.
    read_bytes = Path.read_bytes

    def no_corpus_reads(self: Path) -> bytes:
        if corpus in self.parents:
            pytest.fail(f"{self} was read again")
        return read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", no_corpus_reads)
    assert build_tokenized_file(corpus, tok, tmp_path / "cache") == (path, 300)
    monkeypatch.undo()
    # Another tokenizer, another cache file.
    other = word_level(tmp_path / "tok2", WORDS[:10])
    assert build_tokenized_file(corpus, other, tmp_path / "cache")[0] != path


def test_auto_tokenizer_directory_without_tokenizer_json(corpus, tmp_path):
    from transformers import AutoTokenizer

    tok = bpe_for_auto_tokenizer(tmp_path / "bpe", (corpus / "b.txt").read_text())
    assert not (tok / "tokenizer.json").exists()
    path, vocab = build_tokenized_file(corpus / "a.txt", tok, tmp_path / "cache")
    auto = AutoTokenizer.from_pretrained(str(tok), local_files_only=True)
    assert vocab == len(auto) > 256
    assert load_tokens(path).tolist() == auto.encode("w1 w299 w297\n", add_special_tokens=False)


def test_datamodule_serves_tokenizer_ids_and_its_vocab_size(corpus, tmp_path):
    tok = word_level(tmp_path / "tok")
    data = ByteCorpusDataModule(path=str(corpus), tokenizer=str(tok), block_size=8, batch_size=2,
                                cache_dir=str(tmp_path / "cache"))
    assert data.vocab_size == 300
    data.check_corpus(replicas=2)
    data.setup("fit")
    x, y = next(iter(data.train_dataloader()))
    assert x.shape == (2, 8) and (x[:, 1:] == y[:, :-1]).all()
    windows = np.concatenate([data.train_dataset[i][0].numpy() for i in range(len(data.train_dataset))])
    assert windows.max() > 255 and windows.max() < 300


@pytest.mark.parametrize(("make", "kwargs", "message"), [
    (lambda d: d / "missing", {}, "data.tokenizer='{dir}' is not valid: it is not a directory"),
    (lambda d: d, {}, "data.tokenizer='{dir}' is not valid: no tokenizer could be read from it"),
    (lambda d: word_level(d / "tok"), {"synthetic": True}, "tokenizer='{dir}' is not valid with synthetic=True"),
])
def test_bad_tokenizer_refused_when_the_data_is_built(tmp_path, make, kwargs, message):
    directory = make(tmp_path)
    with pytest.raises(ValueError, match=re.escape(message.format(dir=directory))):
        ByteCorpusDataModule(tokenizer=str(directory), **kwargs)


def test_model_vocab_smaller_than_tokenizer_refused_before_start(corpus, tmp_path, monkeypatch):
    """Through the recipe: a model whose vocabulary is smaller than the tokenizer's fails in preflight; a large
    enough one gets to the launch."""
    from hydra import compose, initialize_config_dir

    import lightning_par.train as train
    from lightning_par.config.schema import register_configs
    from tests.config.test_compose import CONF

    class Launched(Exception):
        pass

    def launched(*args, **kwargs):
        raise Launched

    register_configs()
    monkeypatch.setattr(train, "run_distributed", launched)
    monkeypatch.setattr(train, "train_worker", launched)
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    tok = word_level(tmp_path / "tok")
    base = ["model=tiny", "data=stdlib", f"data.path={corpus}", f"data.tokenizer={tok}", "trainer=smoke",
            f"data.cache_dir={tmp_path / 'cache'}", "data.batch_size=2", "data.block_size=8"]
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        small, large = compose("config", overrides=base), compose("config", overrides=[*base, "model.vocab_size=300"])
    message = (f"model.vocab_size=256 is not valid for this data: its token ids go up to 299 (data.tokenizer='{tok}' "
               f"has 300 tokens). Expected model.vocab_size >= 300")
    with pytest.raises(ValueError, match=re.escape(message)):
        train.launch_job(small, tmp_path / "run1")
    with pytest.raises(Launched):
        train.launch_job(large, tmp_path / "run2")


@pytest.mark.parametrize("content", [b'{"version": "1.0", "model": \xff\xfe}', b'{"version": "1.0", "mod'])
def test_a_broken_tokenizer_json_names_the_field_and_the_file(tmp_path, content):
    """Not UTF-8, or truncated: ``tokenizers`` says ``stream did not contain valid UTF-8`` / ``EOF while parsing``
    and nothing else; the error names ``data.tokenizer`` and the file."""
    (tmp_path / "tokenizer.json").write_bytes(content)
    with pytest.raises(ValueError, match=re.escape(f"data.tokenizer={str(tmp_path)!r} is not valid: "
                                                   f"{str(tmp_path / 'tokenizer.json')!r} could not be read")):
        load_tokenizer(tmp_path)
