"""A user's own LightningModule, in a directory on PYTHONPATH, trained through the recipe by its ``_target_``."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.support.recipe_run import ROOT, run, tail

pytestmark = pytest.mark.e2e

USER_MODULE = Path(__file__).with_name("user_lm.py")
COMMON = ["model=custom", "model._target_=user_lm.UserLM", "+model.hidden=48", "data=synthetic", "trainer=smoke"]


def _user_dir(tmp_path: Path) -> Path:
    user = tmp_path / "user"
    user.mkdir()
    shutil.copy(USER_MODULE, user / "user_lm.py")
    return user


def _summaries(sweep: Path) -> dict[str, dict]:
    return {json.loads(p.read_text())["strategy"]: json.loads(p.read_text()) for p in sweep.glob("*/summary.json")}


@pytest.mark.e2e
def test_user_module_trains_under_ddp_overlap_and_zero3_with_the_same_losses(tmp_path):
    """One sweep, two strategies (each job its own world of 2 processes): same data, seed and SGD+momentum, so
    ZeRO-3 must follow ddp_overlap's loss trajectory. The recipe scales the user's learning rate (sqrt of 16 samples
    per step over 4 = 2) and warms it up over 32 samples (2 steps)."""
    sweep = tmp_path / "sweep"
    scaling = ["lr_scaling.rule=sqrt", "lr_scaling.reference_batch=4", "lr_scaling.warmup_samples=32"]
    proc = run([sys.executable, str(ROOT / "recipes" / "train.py"), "-m", "hydra/launcher=lightning_par",
                "strategy=ddp_overlap,zero3", "parallel=dp2", *COMMON, *scaling, f"hydra.sweep.dir={sweep}"],
               tmp_path, _user_dir(tmp_path))
    assert proc.returncode == 0, tail(proc)
    runs = _summaries(sweep)
    assert set(runs) == {"ddp_overlap", "zero3"}, tail(proc)
    ddp, zero3 = runs["ddp_overlap"], runs["zero3"]
    assert ddp["config"]["model"]["_target_"] == "user_lm.UserLM" and ddp["config"]["model"]["hidden"] == 48
    assert ddp["final_train_loss"] < ddp["initial_train_loss"]
    for key in ("initial_train_loss", "final_train_loss", "final_val_loss"):
        assert zero3[key] == pytest.approx(ddp[key], rel=1e-5), key
    # ZeRO-3 shards parameters, gradients and optimizer state over dp=2.
    assert zero3["param_bytes"][0] * 2 == pytest.approx(ddp["param_bytes"][0], rel=0.05)
    for summary in (ddp, zero3):
        assert summary["global_batch"] == 16 and summary["lr_scale_factor"] == 2.0 and summary["lr_warmup_steps"] == 2
        assert summary["lr_after_warmup"] == pytest.approx([0.1]) and summary["lr_last"] == pytest.approx([0.1])
    report = (sweep / "report.csv").read_text()
    assert "ddp_overlap" in report and "zero3" in report


def _has_model_contract() -> bool:
    """The strategy core reads ``tp_plan()`` from the network (lightning_par/contract.py)."""
    return (ROOT / "lightning_par" / "contract.py").exists()


@pytest.mark.e2e
@pytest.mark.skipif(not _has_model_contract(),
                    reason="needs the model contract (tp_plan() on the network, lightning_par/contract.py)")
def test_user_module_trains_under_tensor_parallel_with_its_own_plan(tmp_path):
    run_dir = tmp_path / "run"
    proc = run([sys.executable, str(ROOT / "recipes" / "train.py"), "strategy=tensor_parallel", "parallel=tp2",
                *COMMON, f"hydra.run.dir={run_dir}"], tmp_path, _user_dir(tmp_path))
    assert proc.returncode == 0, tail(proc)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["tp_size"] == 2 and summary["final_train_loss"] < summary["initial_train_loss"]
    # The plan splits up/down over tp=2: each rank holds half of those and all of the rest.
    from tests.recipes.user_lm import UserLM

    net = UserLM(hidden=48).model
    full = sum(p.numel() for p in net.parameters()) * 4
    split = sum(p.numel() for m in (net.up, net.down) for p in m.parameters()) * 4
    assert summary["param_bytes"][0] == pytest.approx(full - split / 2, rel=0.01)
