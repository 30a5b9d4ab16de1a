"""3D parallelism (dp 2 x tp 2 x pp 2 on 8 processes) against one process, and its sharded checkpoints.

One 8-process launch runs, in order:

* parity: 4 optimizer steps (2 epochs) for every ``dp_mode`` (ddp, zero1, zero2, zero3), with sequence parallelism
  and global-norm clipping in some cases, compared with a one-process reference that sums the micro-batch gradients
  in the pipeline's order (losses within ``rtol=1e-5``, gathered parameters within ``assert_params_close``);
* a zero3 fit of 2 steps (one epoch) that validates and saves a checkpoint; a resumed fit from it to step 4, whose
  losses must equal the uninterrupted parity run's; then a save over the same path that crashes after writing its
  shards: the earlier checkpoint must stay in place and loadable;
* the resharding round trip: the checkpoint (saved at dp2·tp2·pp2, zero3) validated at dp4·tp2·pp1 (ddp), and loaded
  in one process here: the same validation loss within 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import assert_params_close, global_losses
from tests.p3d_helpers import make_gpt, reference_val_loss, run_plan, token_data
from tests.pp_helpers import one_thread, reference_fit_microbatched

pytestmark = pytest.mark.distributed

MICRO, M, DP, HALF = 4, 2, 2, 2  # samples per replica batch, micro-batches, dp size, steps per epoch
CLIP = 0.5
LAYOUT = dict(dp_size=DP, tp_size=2, pp_size=2, num_microbatches=M, schedule="1f1b")
PARITY = {
    "ddp_sp": (dict(dp_mode="ddp", sequence_parallel=True), None),
    "zero1_clip": (dict(dp_mode="zero1"), CLIP),
    "zero2_sp_clip": (dict(dp_mode="zero2", sequence_parallel=True), CLIP),
    "zero3": (dict(dp_mode="zero3"), None),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    ckpt = str(tmp_path_factory.mktemp("p3d") / "p3d.ckpt")
    train, val = token_data(MICRO * DP * HALF), token_data(16, seed=1)
    plan = [
        {"kind": "fit", "name": name, "options": {**LAYOUT, **opts}, "steps": 2 * HALF, "micro_batch": MICRO,
         "clip": clip}
        for name, (opts, clip) in PARITY.items()
    ]
    zero3 = {**LAYOUT, "dp_mode": "zero3"}
    plan += [
        {"kind": "fit", "name": "first", "options": zero3, "steps": HALF, "micro_batch": MICRO, "val": True,
         "save": ckpt},
        {"kind": "fit", "name": "resumed", "options": zero3, "steps": 2 * HALF, "micro_batch": MICRO,
         "resume": ckpt, "crash_save": ckpt, "val": True, "val_every": HALF},
        {"kind": "validate", "name": "dp4_tp2", "micro_batch": MICRO, "ckpt": ckpt,
         "options": dict(dp_size=4, tp_size=2, pp_size=1, dp_mode="ddp", num_microbatches=M)},
    ]
    return run_plan(8, plan, train, val, timeout_s=300), ckpt


@pytest.mark.parametrize("name", list(PARITY))
def test_parity_dp2_tp2_pp2(results, name: str) -> None:
    out, _ = results
    _, clip = PARITY[name]
    with one_thread():
        ref_losses, ref_params = reference_fit_microbatched(
            make_gpt, token_data(MICRO * DP * HALF), MICRO, 2 * HALF, M, DP, clip_norm=clip
        )
    torch.testing.assert_close(torch.tensor(global_losses(out[name])), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for r in out[name]:
        assert_params_close(r["state"], ref_params)


def test_resume_same_layout_continues_the_uninterrupted_run(results) -> None:
    out, _ = results
    uninterrupted = global_losses(out["zero3"])
    first, resumed = global_losses(out["first"]), global_losses(out["resumed"])
    assert len(first) == HALF and len(resumed) == HALF
    torch.testing.assert_close(torch.tensor(first), torch.tensor(uninterrupted[:HALF]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(uninterrupted[HALF:]), rtol=1e-5, atol=0)
    for a, b in zip(out["resumed"], out["zero3"]):
        assert_params_close(a["state"], b["state"])


def test_resharding_round_trip_and_crashed_save(results) -> None:
    out, ckpt = results
    assert all(r.get("crashed") for r in out["resumed"])  # the second save really failed on every rank
    with one_thread():
        _, params = reference_fit_microbatched(make_gpt, token_data(MICRO * DP * HALF), MICRO, HALF, M, DP)
        expected = reference_val_loss(params, token_data(16, seed=1))
        one_process = reference_val_loss(None, token_data(16, seed=1), path=ckpt)
    saved_at_dp2_tp2_pp2 = out["first"][0]["val_loss"]
    loaded_at_dp4_tp2 = out["dp4_tp2"][0]["val_loss"]
    print(f"val_loss: reference {expected:.7f}, dp2-tp2-pp2 {saved_at_dp2_tp2_pp2:.7f}, dp4-tp2 "
          f"{loaded_at_dp4_tp2:.7f}, one process {one_process:.7f}")
    # The checkpoint in place is the first one (2 steps), not the crashed save's (4 steps).
    assert saved_at_dp2_tp2_pp2 == pytest.approx(expected, rel=1e-5)
    assert loaded_at_dp4_tp2 == pytest.approx(saved_at_dp2_tp2_pp2, rel=1e-5)
    assert one_process == pytest.approx(saved_at_dp2_tp2_pp2, rel=1e-5)
    assert all(r["val_loss"] == pytest.approx(loaded_at_dp4_tp2, rel=1e-6) for r in out["dp4_tp2"])
