"""recipes/plan.py end to end: the ranked table, plan.md / plan.csv, and the multirun of the best layouts."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

from tests.support.forked_run import run_forked

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_plan_recipe_writes_the_table_and_a_ready_multirun(tmp_path):
    out = tmp_path / "plan"
    cmd = [sys.executable, "recipes/plan.py", "model=small", "parallel.world_size=16", "planner.device=a100-40gb",
           "planner.global_batch_size=64", "planner.top_k=2", f"hydra.run.dir={out}"]
    proc = run_forked(cmd, ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "16 x a100-40gb (8 per node); global batch 64 sequences of 128 tokens" in proc.stdout
    rows = list(csv.DictReader((out / "plan.csv").open()))
    assert rows and all(int(r["dp_size"]) * int(r["tp_size"]) * int(r["pp_size"]) == 16 for r in rows)
    assert (out / "plan.md").read_text().count("\n|") == len(rows) + 2  # header, rule, rows
    recipes = sorted((out / "layouts" / "recipe").glob("plan_*.yaml"))
    assert [p.stem for p in recipes] == ["plan_1", "plan_2"]
    assert f"recipes/train.py -m --config-dir {out / 'layouts'} +recipe=plan_1,plan_2 model=small" in proc.stdout
    assert "given layout" not in proc.stdout  # no layout on the command line: conf/plan.yaml's defaults are not one


@pytest.mark.e2e
def test_plan_recipe_refuses_a_model_it_cannot_read_with_one_message(tmp_path):
    """A Hugging Face model: the field named (model.preset), not the config dict, and no traceback; status 1."""
    cmd = [sys.executable, "recipes/plan.py", "model=hf", f"hydra.run.dir={tmp_path}"]
    proc = run_forked(cmd, ROOT, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "base_config" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "Error: model.preset is missing: the planner reads the reference GPT's config"), proc.stderr
