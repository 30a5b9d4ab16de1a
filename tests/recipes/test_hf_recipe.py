"""The recipe trains a Hugging Face model from a config alone: ``model=hf`` (a tiny llama) under tp2 with sequence
parallelism, the plan read from the model's own ``tp_plan``."""

from __future__ import annotations

import json
import sys

import pytest

from tests.support.recipe_run import ROOT, run, tail

pytestmark = pytest.mark.e2e

pytest.importorskip("transformers")


@pytest.mark.e2e
def test_recipe_trains_model_hf_under_tp2_with_sequence_parallelism(tmp_path):
    run_dir = tmp_path / "run"
    proc = run([sys.executable, str(ROOT / "recipes" / "train.py"), "model=hf", "data=synthetic", "trainer=smoke",
                "strategy=tensor_parallel", "parallel=tp2", "strategy.tensor_parallel.sequence_parallel=true",
                "logger=csv", f"hydra.run.dir={run_dir}"], tmp_path, TRANSFORMERS_VERBOSITY="error")
    assert proc.returncode == 0, tail(proc)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["tp_size"] == 2 and summary["sequence_parallel"] is True and summary["steps"] == 6
    assert summary["config"]["model"]["model_type"] == "llama"
    assert summary["final_train_loss"] < summary["initial_train_loss"]
    from omegaconf import OmegaConf

    from lightning_par.hf.module import recipe_model

    base = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / "hf.yaml").base_config)
    full = 4 * sum(p.numel() for p in recipe_model(model_type="llama", base_config=base).parameters())
    assert all(b < 0.6 * full for b in summary["param_bytes"]), (summary["param_bytes"], full)
