"""HSDP (``dp_replicate_size > 1``): every dp mode on the 2-D ``(dp_replicate, dp_shard)`` grid, against one process.

A user's ``nn.Sequential`` (:class:`tests.support.user_models.ResidualMLP`, not the GPT) trains with SGD + momentum (which,
unlike Adam, moves twice as far on a gradient summed instead of averaged over the replicas) and with AdamW:

* world 4: dp_replicate 2 x dp_shard 2 under ``ddp``, ``zero1``, ``zero2`` and ``zero3``;
* world 8: dp_replicate 2 x dp_shard 2 x tp 2 under ``zero1``, ``zero2``, ``zero3`` (the model's own plan).

Parity: losses within ``rtol=1e-5`` of one process on the same global batch, gathered parameters within
``assert_params_close``. Memory: per-rank model-state bytes follow the ZeRO formula with ``N = dp_shard_size``
(Rajbhandari et al., SC'20, §5), not with ``N = dp_size``.
"""

from __future__ import annotations

import pytest
import torch

from lightning_par.data_parallel.zero_memory import paper_state_bytes
from tests.support.helpers import assert_params_close, global_losses
from tests.support.p3d import run_plan, token_data
from tests.support.pipeline import RegressionDataset, one_thread, reference_fit_microbatched
from tests.support.user_models import make_mlp

pytestmark = pytest.mark.distributed

STEPS, MICRO = 3, 4
MODES = ("zero1", "zero2", "zero3")


def _fit(name: str, optimizer: str, **options) -> dict:
    return {"kind": "fit", "name": name, "model": f"mlp-{optimizer}", "strategy": "parallel_3d", "bytes": True,
            "options": {"dp_replicate_size": 2, "dp_shard_size": 2, "bucket_cap_mb": 1e-4, **options},
            "steps": STEPS, "micro_batch": MICRO}


WORLD4 = {f"hsdp-{mode}-{opt}": _fit(f"hsdp-{mode}-{opt}", opt, dp_mode=mode)
          for mode in MODES for opt in ("sgd", "adamw")}
WORLD4["hsdp-ddp-sgd"] = _fit("hsdp-ddp-sgd", "sgd", dp_mode="ddp")
WORLD8 = {f"hsdp-tp2-{mode}-{opt}": _fit(f"hsdp-tp2-{mode}-{opt}", opt, dp_mode=mode, tp_size=2)
          for mode in MODES for opt in ("sgd", "adamw")}
for case in (*WORLD4.values(), *WORLD8.values()):
    if case["options"]["dp_mode"] == "zero3":
        case["options"].pop("bucket_cap_mb")  # stage 3 gathers one fully_shard unit at a time: no buckets


def _launch(world: int, cases: dict) -> dict:
    return run_plan(world, list(cases.values()), token_data(MICRO * 4 * STEPS), token_data(8, seed=1),
                    timeout_s=900)


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hsdp")
    for mode in MODES:  # each dp mode saves its checkpoint after the fit
        WORLD4[f"hsdp-{mode}-sgd"]["save"] = str(root / f"{mode}.ckpt")
    return _launch(4, WORLD4)


@pytest.fixture(scope="module")
def world8() -> dict:
    return _launch(8, WORLD8)


def _check(runs: list[dict], optimizer: str) -> None:
    with one_thread():
        ref_losses, ref_params = reference_fit_microbatched(
            lambda: make_mlp(optimizer=optimizer), RegressionDataset(n=MICRO * 4 * STEPS), MICRO, STEPS, 1, 4
        )
    torch.testing.assert_close(torch.tensor(global_losses(runs)), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for r in runs:
        assert_params_close(r["state"], ref_params)


@pytest.mark.parametrize("name", list(WORLD4))
def test_hsdp_2x2_matches_one_process(world4, name):
    _check(world4[name], name.rsplit("-", 1)[1])


@pytest.mark.parametrize("name", list(WORLD8))
def test_hsdp_2x2_tp2_matches_one_process(world8, name):
    _check(world8[name], name.rsplit("-", 1)[1])


@pytest.mark.parametrize("mode", MODES)
def test_model_state_bytes_follow_the_formula_with_n_dp_shard(world4, mode):
    """AdamW (``K = 8``): every rank's parameters, gradients and optimizer state within 2% of the formula at
    ``N = dp_shard_size = 2``; the same formula at ``N = dp_size = 4`` would be off by more (stage 3: a factor 2)."""
    stage = int(mode[-1])
    for r in world4[f"hsdp-{mode}-adamw"]:
        measured = sum(r["bytes"].values())
        expected = paper_state_bytes(stage, r["trainable_numel"], 2)
        assert abs(measured / expected - 1) <= 0.02, (mode, r["rank"], r["bytes"], expected)
        assert abs(measured / paper_state_bytes(stage, r["trainable_numel"], 4) - 1) > 0.02


@pytest.mark.parametrize("mode", MODES)
def test_a_checkpoint_saved_under_hsdp_loads_into_one_process(world4, mode):
    from lightning_par.checkpoint import load_model_weights

    module = make_mlp(optimizer="sgd")
    load_model_weights(WORLD4[f"hsdp-{mode}-sgd"]["save"], module)
    assert_params_close(world4[f"hsdp-{mode}-sgd"][0]["state"], dict(module.named_parameters()))


def test_summary_names_the_replicas(world4):
    extras = world4["hsdp-zero3-sgd"][0]["extras"]
    assert extras["dp_size"] == 4 and extras["dp_replicate_size"] == 2


def _mesh_strategy():
    from lightning_par.strategies import MeshStrategy

    return MeshStrategy(dp_replicate_size=2, dp_shard_size=2, dp_mode="zero3", timeout_s=60)


def test_mesh_strategy_with_hsdp_keywords():
    """``MeshStrategy(dp_replicate_size=2, dp_shard_size=2, dp_mode="zero3")`` under a plain ``Trainer``."""
    from tests.support.helpers import run_fit

    runs = run_fit(4, _mesh_strategy, lambda: make_mlp(optimizer="sgd"), RegressionDataset(n=MICRO * 4 * STEPS),
                   MICRO, STEPS, None, lambda module, strategy: strategy.full_state_dict())
    _check(runs, "sgd")
    assert runs[0]["extras"]["dp_replicate_size"] == 2
