"""Your data: JSONL / Parquet / text / litdata documents tokenized once, packed whole into blocks (first fit, padding
reported), attention masked per document; bad records refused or handled as documented. One process: a packed block's
loss and gradients equal each of its documents run alone (the GPT and a Hugging Face llama), with padding too."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_par.data.datasets import DocumentDataModule, build_document_cache
from lightning_par.data.doc_mask import document_attention, document_mask
from lightning_par.data.packing import DocumentPacker, PackedBlocks, pack
from tests.support.docs import documents_alone_loss, make_model, packed_blocks

# ---------------------------------------------------------------------------------------------------------- packing


def test_first_fit_packs_whole_documents_and_reports_padding():
    # pairs per document = length - 1: 9, 4, 7, 3, 2 into blocks of 10
    blocks, stats = pack([10, 5, 8, 4, 3], block_size=10)
    # first fit: document 2 (7 pairs) opens a third block, documents 3 and 4 go back into the second
    assert blocks == [[(0, 0, 10)], [(1, 0, 5), (3, 0, 4), (4, 0, 3)], [(2, 0, 8)]]
    for block in blocks:
        assert sum(stop - start - 1 for _, start, stop in block) <= 10
    assert stats.blocks == len(blocks) == 3 and stats.documents == 5 and stats.tokens == 25
    assert stats.padding_fraction == pytest.approx(1 - 25 / 30) and stats.documents_per_block == pytest.approx(5 / 3)


def test_long_documents_split_truncate_or_error():
    blocks, stats = pack([25, 3], block_size=10, long_documents="split")  # 24 pairs -> 10 + 10 + 4
    pieces = sorted(p for b in blocks for p in b if p[0] == 0)
    assert pieces == [(0, 0, 11), (0, 10, 21), (0, 20, 25)] and stats.split == 1
    blocks, _ = pack([25], block_size=10, long_documents="truncate")
    assert blocks == [[(0, 0, 11)]]
    with pytest.raises(ValueError, match=r"record 7 of 'a.jsonl' of 25 tokens .* data.long_documents='error'"):
        pack([25], block_size=10, long_documents="error", names=["record 7 of 'a.jsonl'"])
    with pytest.raises(ValueError, match="data.long_documents='nope' is not valid"):
        pack([3], block_size=10, long_documents="nope")


def test_a_block_item_restarts_positions_and_ignores_padding():
    tokens = np.arange(100, 112)
    ds = PackedBlocks(tokens, np.array([0, 4, 12]), block_size=12)  # 3 + 7 pairs, 2 of padding
    item = ds[0]
    assert item["input_ids"].tolist() == [100, 101, 102, 104, 105, 106, 107, 108, 109, 110, 0, 0]
    assert item["labels"].tolist() == [101, 102, 103, 105, 106, 107, 108, 109, 110, 111, -100, -100]
    assert item["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 0, 1]
    assert item["document_ids"].tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 2, 2]


def test_packer_state_round_trips_its_buffer():
    packer = DocumentPacker(block_size=10, buffer_blocks=2)
    for key, pairs in enumerate([6, 6, 3]):
        packer.add(key, pairs)
    state = packer.state_dict()
    other = DocumentPacker(block_size=10, buffer_blocks=2)
    other.load_state_dict(state)
    assert other.add(3, 4) == packer.add(3, 4) and other.state_dict() == packer.state_dict()
    with pytest.raises(ValueError, match="block_size=8 is not valid for this packer state"):
        DocumentPacker(block_size=8).load_state_dict(state)


def test_packed_dataset_state_refuses_other_data():
    a, b = packed_blocks(4, seed=0), packed_blocks(4, seed=1)
    a.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="the data's packing is not the checkpoint's"):
        b.load_state_dict(a.state_dict())


def test_document_mask_is_causal_within_documents():
    docs = torch.tensor([[0, 0, 1, 1, 1]])
    mask = document_mask(docs, docs)[0, 0]
    assert mask.tolist() == [[True, False, False, False, False], [True, True, False, False, False],
                             [False, False, True, False, False], [False, False, True, True, False],
                             [False, False, True, True, True]]


# --------------------------------------------------------------------------------- one process, documents alone

@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_packed_block_equals_each_document_alone_in_one_process(model):
    """Loss and every gradient of 2 packed blocks (one with padding) equal the documents run alone (rel 1e-5)."""
    rng = np.random.default_rng(3)
    lengths = [5, 9, 3, 7, 4, 6, 2, 8]
    tokens = rng.integers(0, 256, size=sum(lengths))
    blocks = PackedBlocks(tokens, np.concatenate([[0], np.cumsum(lengths)]), block_size=16)
    assert blocks.stats.padding_fraction > 0  # labels -100 on the padding
    module = make_model(model)
    ref = documents_alone_loss(module, blocks, [0, 1])
    ref.backward()
    want = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    batch = {k: torch.stack([blocks[i][k] for i in (0, 1)]) for k in blocks[0]}
    loss = module.training_step(batch, 0) if model == "llama" else module._loss(batch)
    loss.backward()
    assert float(loss) == pytest.approx(float(ref), rel=1e-5)
    flat_want = torch.cat([g.reshape(-1) for g in want.values()])
    flat_got = torch.cat([p.grad.reshape(-1) for p in module.parameters()])
    assert float((flat_got - flat_want).norm() / flat_want.norm()) <= 1e-5
    # without the document mask the same block gives another loss: the check has teeth (the llama's own
    # packed-sequence mask, which transformers builds from restarting positions, switched off as the mask is ours)
    from contextlib import nullcontext

    attention = module._document_context()
    with torch.no_grad(), (attention() if attention is not None else nullcontext()):
        unmasked = module.loss_fn(module(batch["input_ids"], position_ids=batch["position_ids"]), batch["labels"])
    assert abs(float(unmasked) - float(ref)) > 1e-4


def test_document_ids_of_another_shape_are_refused():
    q = torch.zeros(1, 2, 6, 4)
    with pytest.raises(ValueError, match=r"document_ids of shape \(1, 5\) are not valid"):
        with document_attention(torch.zeros(1, 5, dtype=torch.long)):
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)


# ------------------------------------------------------------------------------------------------ the datasets

def _jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    return [" ".join(rng.choice(words, size=int(rng.integers(2, 12)))) for _ in range(n)]


def test_jsonl_is_tokenized_once_and_packed(tmp_path, monkeypatch):
    path = _jsonl(tmp_path / "train.jsonl", [{"text": t, "id": i} for i, t in enumerate(_texts(60))])
    dm = DocumentDataModule(source="json", path=str(path), block_size=64, batch_size=2, cache_dir=str(tmp_path / "c"))
    dm.check_corpus(replicas=2)
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "labels", "position_ids", "document_ids"}
    assert batch["input_ids"].shape == (2, 64)
    stats = dm.packing_stats()
    assert stats["data_documents_total"] == 60 and 0 <= stats["data_padding_fraction"] < 0.5
    assert stats["data_documents_per_block"] > 1
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("the cache was not reused"))
    again = DocumentDataModule(source="json", path=str(path), block_size=64, batch_size=2,
                               cache_dir=str(tmp_path / "c"))
    again.setup()
    assert len(again.train_dataset) == len(dm.train_dataset)


def test_parquet_and_text_sources(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = _texts(40)
    pq.write_table(pa.table({"body": texts}), tmp_path / "a.parquet")
    dm = DocumentDataModule(source="parquet", path=str(tmp_path / "a.parquet"), text_field="body", block_size=32,
                            batch_size=2, cache_dir=str(tmp_path / "c"))
    dm.setup()
    tokens, meta = dm.documents()
    assert meta["records"] == 40 and bytes(np.asarray(tokens[:meta["offsets"][1]])).decode() == texts[0]
    docs = tmp_path / "docs"
    docs.mkdir()
    for i, t in enumerate(texts[:6]):
        (docs / f"{i}.txt").write_text(t + "\n" + t)
    dm = DocumentDataModule(source="text", path=str(docs), block_size=32, batch_size=1, val_every=3,
                            cache_dir=str(tmp_path / "c"))
    dm.setup()
    assert dm.documents()[1]["records"] == 6  # one document per file


def test_litdata_optimize_output(tmp_path):
    import litdata

    texts = _texts(30)
    out = tmp_path / "optimized"
    litdata.optimize(fn=_litdata_item, inputs=texts, output_dir=str(out), chunk_bytes="1MB", num_workers=1,
                     verbose=False, start_method="fork")
    dm = DocumentDataModule(source="litdata", path=str(out), block_size=32, batch_size=2,
                            cache_dir=str(tmp_path / "c"))
    dm.setup()
    tokens, meta = dm.documents()
    decoded = sorted(bytes(np.asarray(tokens[a:b])).decode() for a, b in zip(meta["offsets"], meta["offsets"][1:]))
    assert decoded == sorted(texts)


def _litdata_item(text: str) -> dict:
    return {"text": text}


def test_bad_records(tmp_path):
    good = [{"text": t} for t in _texts(10)]
    missing = _jsonl(tmp_path / "missing.jsonl", [*good[:3], {"body": "x y"}, *good[3:]])
    with pytest.raises(ValueError, match=r"data.text_field='text' is not valid for line 4 of .*missing.jsonl"):
        build_document_cache("json", str(missing), cache_dir=tmp_path / "c")
    absent = _jsonl(tmp_path / "absent.jsonl", [{"body": t} for t in _texts(5)])
    with pytest.raises(ValueError, match=r"data.text_field='text' is not valid for line 1 .* fields: \['body'\]"):
        build_document_cache("json", str(absent), cache_dir=tmp_path / "c")
    typed = _jsonl(tmp_path / "typed.jsonl", [*good[:2], {"text": 5}])
    with pytest.raises(ValueError, match=r"data.text_field='text' of line 3 .* a int .* Expected a string"):
        build_document_cache("json", str(typed), cache_dir=tmp_path / "c")
    empty = _jsonl(tmp_path / "empty.jsonl", [*good[:4], {"text": ""}, *good[4:]])
    with pytest.warns(UserWarning, match="1 of 11 records are empty"):
        _, meta = build_document_cache("json", str(empty), cache_dir=tmp_path / "c")
    assert meta["skipped"] == 1 and len(meta["offsets"]) == 11  # the other 10 kept: never the whole file skipped
    all_empty = _jsonl(tmp_path / "all_empty.jsonl", [{"text": ""}] * 3)
    with pytest.raises(ValueError, match="its 3 records give no document"):
        build_document_cache("json", str(all_empty), cache_dir=tmp_path / "c")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "a b"}\n{"text": "c d"\n')
    with pytest.raises(ValueError, match=r"broken.jsonl' could not be read"):
        build_document_cache("json", str(broken), cache_dir=tmp_path / "c")
    long = _jsonl(tmp_path / "long.jsonl", [*good, {"text": "z" * 200}])
    dm = DocumentDataModule(source="json", path=str(long), block_size=128, batch_size=1, long_documents="error",
                            val_every=50, cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match=r"line 11 of .*long.jsonl' of 200 tokens"):
        dm.setup()


@pytest.mark.parametrize("kwargs,message", [
    (dict(source="csv", path="x"), "data.source='csv' is not valid"),
    (dict(path=None), "data.path=None is not valid"),
    (dict(path="x", packing="pack"), "data.packing='pack' is not valid"),
    (dict(path="x", block_size=0), "data.block_size=0 is not valid"),
])
def test_bad_options_are_refused_before_reading(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DocumentDataModule(**kwargs)


def test_chat_records_through_the_chat_template(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "user", "assistant", ":", "hi", "there", "how", "are", "you", "<s>"]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    fast.save_pretrained(str(tmp_path / "tok"))
    chats = [{"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "how are you"}]}]
    path = _jsonl(tmp_path / "chat.jsonl", chats * 4)
    _, meta = build_document_cache("json", str(path), messages_field="messages", tokenizer=str(tmp_path / "tok"),
                                   cache_dir=tmp_path / "c")
    assert np.diff(meta["offsets"]).tolist() == [9] * 4  # user : hi there assistant : how are you
    with pytest.raises(ValueError, match="data.messages_field is not valid with data.tokenizer=None"):
        build_document_cache("json", str(path), messages_field="messages", cache_dir=tmp_path / "c2")


def test_bad_records_are_named_by_the_line_an_editor_shows(tmp_path):
    """Issue 50: JSON Lines records by their 1-based line (blank lines counted as an editor does), Parquet rows from 1;
    a record whose field is null is not said to lack the field; a refused build leaves no temporary file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = [json.dumps({"text": t}) for t in _texts(6)]
    path = tmp_path / "gaps.jsonl"
    path.write_text("\n".join([*good[:2], "", *good[2:4], json.dumps({"body": "x y"}), *good[4:]]) + "\n")
    cache = tmp_path / "c"
    with pytest.raises(ValueError, match=r"data.text_field='text' is not valid for line 6 of .*gaps.jsonl': the record "
                                         r"has no value for it \('text' is missing or null in this record; the file's "
                                         r"fields: \['body', 'text'\]\)"):
        build_document_cache("json", str(path), cache_dir=cache)
    assert [p.name for p in cache.iterdir() if ".tmp" in p.name] == []  # no docs-<hash>.tmp<pid> left behind
    pq.write_table(pa.table({"text": ["a b", "c d", None]}), tmp_path / "t.parquet")
    with pytest.raises(ValueError, match=r"is not valid for row 3 of .*t.parquet'"):
        build_document_cache("parquet", str(tmp_path / "t.parquet"), cache_dir=cache)
    array = tmp_path / "array.json"
    array.write_text(json.dumps([{"text": "a b"}, {"text": 7}]))
    with pytest.raises(ValueError, match=r"data.text_field='text' of record 2 of .*array.json' is not valid"):
        build_document_cache("json", str(array), cache_dir=cache)
    assert [p.name for p in cache.iterdir() if ".tmp" in p.name] == []
