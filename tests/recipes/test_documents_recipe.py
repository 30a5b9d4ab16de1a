"""Your data through the recipe: ``data=jsonl``, ``data=parquet`` and ``data=litdata`` each train the tiny GPT on packed,
document-masked blocks and report the packing in ``summary.json``; a bad record is refused before any process starts,
naming the field, the record and the file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.recipe_run import ROOT, run, tail

pytestmark = pytest.mark.e2e

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


def _texts(n: int = 200) -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(2, 9)))) for _ in range(n)]


def _litdata_item(text: str) -> dict:
    return {"text": text}


def _write(kind: str, directory: Path) -> Path:
    texts = _texts()
    if kind == "jsonl":
        path = directory / "train.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        return path
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = directory / "train.parquet"
        pq.write_table(pa.table({"text": texts}), path)
        return path
    import litdata

    path = directory / "optimized"
    litdata.optimize(fn=_litdata_item, inputs=texts, output_dir=str(path), chunk_bytes="1MB", num_workers=1,
                     verbose=False, start_method="fork")
    return path


def _train(tmp_path: Path, data: str, path: Path, *extra: str) -> tuple[object, Path]:
    run_dir = tmp_path / "run"
    proc = run([sys.executable, "recipes/train.py", "model=tiny", f"data={data}", f"data.path={path}",
                "data.batch_size=4", f"data.cache_dir={tmp_path / 'cache'}", "trainer=smoke", "trainer.max_steps=4",
                "trainer.val_check_interval=2", "data.val_batches=2", f"hydra.run.dir={run_dir}", *extra],
               ROOT, timeout=400)
    return proc, run_dir


@pytest.mark.parametrize("data,extra", [
    ("jsonl", ()),  # 2 processes, ddp_overlap (the default layout)
    ("parquet", ("parallel=dp1",)),
    ("litdata", ("parallel=dp1",)),
])
def test_documents_train_through_the_recipe(tmp_path, data, extra):
    path = _write(data, tmp_path)
    proc, run_dir = _train(tmp_path, data, path, *extra)
    assert proc.returncode == 0, tail(proc)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["data_packing"] == "documents"
    assert summary["data_documents_total"] == 200 and summary["data_documents_per_block"] > 1
    assert 0 <= summary["data_padding_fraction"] < 0.5
    world = summary["world_size"]
    # tokens that count per step: at most the blocks' tokens (4 blocks of 32 per replica), at least the non-padding
    assert 0 < summary["data_tokens_counted_per_step"] <= 4 * 32 * world
    header = (run_dir / "logs" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"data/tokens_counted", "data/padding_fraction", "data/documents_per_block"} <= set(header)
    assert summary["final_val_loss"] is not None and np.isfinite(summary["final_val_loss"])


def test_a_bad_record_is_refused_before_start(tmp_path):
    path = tmp_path / "bad.jsonl"
    records = [{"text": t} for t in _texts(20)]
    records.insert(5, {"body": "no text field here"})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    proc, run_dir = _train(tmp_path, "jsonl", path)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "data.text_field='text' is not valid for line 6 of" in out and "bad.jsonl" in out, tail(proc)
    assert not (run_dir / "summary.json").exists()
