"""The main job end to end for a few steps: through the README's command (`make train`, a fresh interpreter) once, then
the command it runs (`python recipes/train.py ARGS`) with other overrides, in a child forked from an interpreter that
has the recipe's imports done (tests/support/forked_run.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_par.models.lightning_module import lr_lambda
from tests.support.forked_run import run_forked

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
FIELDS = (
    "strategy", "world_size", "dp_size", "tp_size", "pp_size", "steps", "tokens_seen", "initial_train_loss",
    "final_train_loss", "final_val_loss", "tokens_per_s", "peak_memory_bytes", "param_bytes", "grad_bytes",
    "optimizer_state_bytes",
)


def _train(args: str, timeout: float) -> subprocess.CompletedProcess:
    """What ``make -s train ARGS="<args>"`` runs (``$(PY) recipes/train.py $(ARGS)``, the Makefile), forked."""
    return run_forked([sys.executable, "recipes/train.py", *args.split()], ROOT, timeout=timeout)


@pytest.mark.e2e
def test_make_train_runs_and_writes_summary(tmp_path):
    run_dir = tmp_path / "run"
    args = f"model=tiny data=synthetic trainer=smoke profile=true lr_scaling.rule=linear hydra.run.dir={run_dir}"
    proc = subprocess.run(["make", "-s", "train", f"ARGS={args}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    printed = proc.stdout + proc.stderr  # quiet by default: no third-party deprecation line, tip or "Epoch 0/-2"
    for noise in ("LeafSpec", "litlogger", "/-2", "Warning"):
        assert noise not in printed, (noise, printed[-3000:])
    summary = json.loads((run_dir / "summary.json").read_text())
    for field in FIELDS:
        assert summary.get(field) is not None, field
    assert summary["strategy"] == "ddp_overlap" and summary["world_size"] == 2 and summary["dp_size"] == 2
    assert summary["steps"] == 6
    assert summary["tokens_seen"] == 6 * 2 * 8 * 32  # steps * dp * micro-batch * block_size (tiny)
    assert len(summary["param_bytes"]) == 2 and summary["param_bytes"][0] == summary["param_bytes"][1]
    assert summary["final_train_loss"] < summary["initial_train_loss"]
    assert (run_dir / "logs" / "metrics.csv").exists()
    # lr_scaling: the global batch of 2 replicas of 8 sequences, against the default reference (one replica)
    assert summary["global_batch"] == 16 and summary["lr_scale_factor"] == 2.0
    # the model's own schedule (warm-up over 20 steps) still runs: at the last step (5) its factor is 6 / 20
    assert summary["lr_last"] == pytest.approx([2.0 * 3e-3 * lr_lambda(5, 20, 20, 0.1)] * 2)
    assert "lr_effective" in (run_dir / "logs" / "metrics.csv").read_text().splitlines()[0]
    # profile=true: a trace per rank and the picture, figures per rank
    assert sorted(p.name for p in (run_dir / "timeline").iterdir()) == [
        "rank0.json", "rank1.json", "timeline.json", "timeline.png"]
    assert len(summary["timeline_comm_overlap"]) == 2 and summary["timeline_png"].endswith("timeline.png")


@pytest.mark.e2e
def test_bad_layout_fails_fast_with_the_field_named(tmp_path):
    proc = _train(f"parallel.world_size=3 parallel.dp_size=2 hydra.run.dir={tmp_path}", timeout=120)
    assert proc.returncode != 0
    assert "does not equal world_size=3" in proc.stderr + proc.stdout


@pytest.mark.e2e
def test_a_bad_override_prints_one_message_and_no_traceback(tmp_path):
    """A refusal of a field before any process starts: the message alone, exit status 1."""
    proc = _train(f"trainer.max_steps=-1 hydra.run.dir={tmp_path}", timeout=120)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("make")]
    assert lines == ["Error: trainer.max_steps=-1 is not valid: expected an integer >= 1 (-1, Lightning's \"no limit\", "
                     "would never finish)."], proc.stderr
    assert proc.returncode == 1  # the recipe's own status (under make, make reports it as its own status 2)


def _smoke_run(tmp_path, overrides: str, model: str = "tiny") -> dict:
    """``make train``'s command for the tiny GPT (or ``model``) on synthetic data for the smoke trainer with
    ``overrides``; its summary.json."""
    run_dir = tmp_path / "run"
    proc = _train(f"{overrides} model={model} data=synthetic trainer=smoke hydra.run.dir={run_dir}", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.e2e
def test_recipe_runs_an_hsdp_preset(tmp_path):
    """``parallel=hsdp2x2``: 4 processes, the model state sharded over 2 ranks and replicated twice, under zero3."""
    summary = _smoke_run(tmp_path, "parallel=hsdp2x2 strategy=zero3")
    assert summary["world_size"] == 4 and summary["dp_size"] == 4 and summary["dp_replicate_size"] == 2
    assert summary["steps"] == 6 and summary["final_train_loss"] < summary["initial_train_loss"]
    # zero3 with N = dp_shard_size = 2: each rank holds half of the fp32 parameters (within padding), not a quarter
    from lightning_par.config.build import gpt_lightning_module

    half = 4 * sum(p.numel() for p in gpt_lightning_module(preset="tiny").parameters()) / 2
    assert all(abs(b / half - 1) <= 0.02 for b in summary["param_bytes"]), (summary["param_bytes"], half)


@pytest.mark.e2e
def test_recipe_runs_a_context_parallel_preset(tmp_path):
    """``parallel=cp2``: 2 processes, each holding half of every sequence, under the default strategy."""
    summary = _smoke_run(tmp_path, "parallel=cp2")
    assert summary["world_size"] == 2 and summary["cp_size"] == 2 and summary["dp_size"] == 1
    assert summary["cp_method"] == "ring" and summary["cp_tokens_per_sequence"] == 32 // 2  # tiny: block_size 32
    assert summary["steps"] == 6 and summary["final_train_loss"] < summary["initial_train_loss"]


@pytest.mark.e2e
def test_recipe_runs_the_moe_model_on_an_expert_parallel_preset(tmp_path):
    """``model=moe_tiny parallel=ep2 strategy=zero2``: each of 2 ranks holds 2 of the 4 experts, ZeRO-2 on the rest;
    ``model.moe_balance=bias``: DeepSeek-V3's bias balancing, with each layer's imbalance logged and summed up."""
    summary = _smoke_run(tmp_path, "parallel=ep2 strategy=zero2 model.moe_balance=bias", model="moe_tiny")
    assert summary["ep_size"] == 2 and summary["experts_per_rank"] == {"blocks.1.mlp.experts": 2}
    assert summary["steps"] == 6 and summary["final_train_loss"] < summary["initial_train_loss"]
    metrics = (tmp_path / "run" / "logs" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"parallel/ep_all_to_all_bytes", "parallel/moe_load_imbalance", "parallel/moe_aux_loss"} <= set(metrics)
    assert "parallel/moe_load_imbalance/blocks.1.mlp" in metrics
    assert set(summary["moe_load_imbalance_per_layer"]) == {"blocks.1.mlp"}
    assert summary["moe_steps"] == 6 and summary["moe_dropped_tokens_total"] == 0  # dropless
