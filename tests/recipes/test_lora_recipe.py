"""The recipe fine-tunes a Hugging Face model with LoRA from a config alone: ``model=hf model.lora.r=8`` under zero3,
with the bytes per rank of the trainable adapters, the frozen base and the optimizer state in ``summary.json``."""

from __future__ import annotations

import json
import sys

import pytest

from tests.support.recipe_run import ROOT, run, tail

pytestmark = pytest.mark.e2e

pytest.importorskip("transformers")
pytest.importorskip("peft")


@pytest.mark.e2e
def test_recipe_fine_tunes_model_hf_with_lora_under_zero3(tmp_path):
    run_dir = tmp_path / "run"
    proc = run([sys.executable, str(ROOT / "recipes" / "train.py"), "model=hf", "model.lora.r=8",
                "model.lora.target_modules=[q_proj,v_proj,down_proj]", "data=synthetic", "trainer=smoke",
                "strategy=zero3", "parallel=dp2", "logger=csv", f"hydra.run.dir={run_dir}"], tmp_path,
               TRANSFORMERS_VERBOSITY="error")
    assert proc.returncode == 0, tail(proc)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["config"]["model"]["lora"]["r"] == 8 and summary["dp_size"] == 2
    assert summary["final_train_loss"] < summary["initial_train_loss"]
    from omegaconf import OmegaConf

    from lightning_par.hf.module import recipe_model

    base = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / "hf.yaml").base_config)
    module = recipe_model(model_type="llama", base_config=base,
                          lora={"r": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]})
    trainable = 4 * sum(p.numel() for p in module.parameters() if p.requires_grad)
    frozen = 4 * sum(p.numel() for p in module.parameters() if not p.requires_grad)
    # zero3 over 2 ranks: each holds half of each (FSDP2 pads a dim-0 shard to an equal size)
    assert sum(summary["trainable_param_bytes"]) >= trainable, (summary["trainable_param_bytes"], trainable)
    assert all(b <= 0.6 * trainable for b in summary["trainable_param_bytes"]), summary["trainable_param_bytes"]
    assert all(b <= 0.6 * frozen for b in summary["frozen_param_bytes"]), summary["frozen_param_bytes"]
    # AdamW's two moments of this rank's adapter shards (plus a 4-byte step per tensor), none of the frozen base
    for state, mine in zip(summary["optimizer_state_bytes"], summary["trainable_param_bytes"]):
        assert 2 * mine <= state <= 2 * mine + 4 * 64, (state, mine)
