"""float8 training (``strategy.float8``) against one process: zero3 dp2 with the float8 all-gather and tp2 with
torchao's float8 styles, AdamW and SGD with momentum, 8 steps on a learnable token rule (AdamW takes the loss from 5.55
to 5.23, so a wrong gradient shows), within rel 1e-3 on the losses.

Why 1e-3 and not 1e-5: tensorwise dynamic scaling takes each activation's scale from the amax of the tensor this rank
holds. Under dp a rank holds half the batch, so its activations are rounded to float8 with another scale than in one
process (torchao and torchtitan do the same; measured: rel 5.0e-4 at zero3 dp2, 1.8e-4 at tp2, where only the
row-parallel partial sums are added in another order). float8 itself moves these losses by rel 4.0e-4 from fp32.
"""

from __future__ import annotations

import pytest
import torch

from lightning_par.launcher import run_distributed
from tests.support.float8 import cases_worker, dataset, global_losses, make_gpt, reference_float8
from tests.support.helpers import LossRecorder, TIMEOUT_S, quiet_trainer

pytestmark = pytest.mark.distributed

STEPS = 8
GLOBAL_BATCH = 8
F8 = {"enabled": True}

#: name -> (strategy class, its options, micro-batch, optimizer)
CASES: dict[str, tuple[str, dict, int, str]] = {
    "zero3_dp2_adamw": ("ZeroStrategy", {"stage": 3, "float8": F8}, 4, "adamw"),
    "tp2_adamw": ("TensorParallelStrategy", {"tp_size": 2, "float8": F8}, 8, "adamw"),
    "zero3_dp2_sgd": ("ZeroStrategy", {"stage": 3, "float8": F8}, 4, "sgd"),
    "tp2_sgd": ("TensorParallelStrategy", {"tp_size": 2, "float8": F8}, 8, "sgd"),
}


#: Beyond CI: the rowwise recipe (no float8 all-gather), bf16, zero1 (plain weights). (tp with sequence parallelism
#: is refused on the CPU: gloo has no float8 all-gather.)
SLOW_CASES: dict[str, tuple] = {
    "zero3_dp2_rowwise": ("ZeroStrategy", {"stage": 3, "float8": {**F8, "recipe": "rowwise"}}, 4, "adamw"),
    "ddp_dp2_rowwise": ("DDPOverlapStrategy", {"float8": {**F8, "recipe": "rowwise"}}, 4, "adamw"),
    "zero1_dp2": ("ZeroStrategy", {"stage": 1, "float8": F8}, 4, "adamw"),
    "zero3_dp2_bf16": ("ZeroStrategy", {"stage": 3, "float8": F8}, 4, "adamw", "bf16-mixed"),
}


def _cases(names: list[str], table: dict) -> list[dict]:
    return [
        {"name": n, "strategy": table[n][0], "options": table[n][1], "micro_batch": table[n][2],
         "optimizer": table[n][3], "steps": STEPS, **({"precision": table[n][4]} if len(table[n]) > 4 else {})}
        for n in names
    ]


@pytest.fixture(scope="module")
def world2() -> dict[str, list[dict]]:
    cases = _cases(list(CASES), CASES)
    per_rank = run_distributed(cases_worker, 2, (cases,), timeout_s=TIMEOUT_S)
    return {c["name"]: [per_rank[r][i] for r in range(2)] for i, c in enumerate(cases)}


def _rel(actual: list[float], expected: list[float]) -> float:
    assert len(actual) == len(expected) == STEPS
    return max(abs(a - e) / abs(e) for a, e in zip(actual, expected))


@pytest.mark.parametrize("name", list(CASES))
def test_float8_matches_one_process_float8(world2, name):
    runs = world2[name]
    optimizer = CASES[name][3]
    expected = reference_float8(STEPS, GLOBAL_BATCH, optimizer=optimizer)
    losses = global_losses(runs)
    assert _rel(losses, expected) < 1e-3, (losses, expected)
    assert max(expected) - min(expected) > 0.05  # training moves the loss (by 0.32 with AdamW): the comparison sees the
    # gradients
    # float8 is in effect where the options say: 12 layers (q, k, v, c_proj, c_fc, mlp.c_proj of 2 blocks), the LM head
    # left in high precision (the default exclude)
    for run in runs:
        assert len(run["float8_layers"]) == 12 and not any(n.endswith("lm_head") for n in run["float8_layers"])
        assert run["summary"]["float8_linears"] == 12
    if name.startswith("zero3"):
        # weights all-gathered in float8, their scales precomputed after each optimizer step
        assert runs[0]["summary"]["float8_fsdp_all_gather"] is True
        assert runs[0]["weight_kind"] == "WeightWithDynamicFloat8CastTensor"
        assert runs[0]["precomputed_scales"] == 12
    else:
        assert runs[0]["summary"]["float8_fsdp_all_gather"] is False


def test_float8_one_process_under_the_strategy_matches_plain_torchao():
    """One process through the strategy (ddp_overlap at world 1, Lightning's loop) against plain torch + torchao: the
    same float8 arithmetic, so the losses agree to fp32 rounding."""
    from torch.utils.data import DataLoader

    from lightning_par.strategies import DDPOverlapStrategy

    module = make_gpt()
    recorder = LossRecorder()
    loader = DataLoader(dataset(), batch_size=GLOBAL_BATCH, shuffle=False, drop_last=True)
    trainer = quiet_trainer(DDPOverlapStrategy(float8=F8), 1, max_steps=STEPS, limit_val_batches=0,
                            callbacks=[recorder])
    trainer.fit(module, loader)
    expected = reference_float8(STEPS, GLOBAL_BATCH)
    assert _rel(recorder.losses, expected) < 1e-5, (recorder.losses, expected)
    plain = reference_float8(STEPS, GLOBAL_BATCH, float8=False)
    assert _rel(recorder.losses, plain) > 1e-5  # and float8 did change the numbers
    assert sum(type(m).__name__ == "Float8Linear" for m in module.modules()) == 12
    # a second Trainer without float8 takes the plain module back (nn.Linear again), with the trained values
    trained = {k: v.detach().clone() for k, v in module.state_dict().items()}
    second = quiet_trainer(DDPOverlapStrategy(), 1, max_steps=1, limit_val_batches=0)
    second.fit(module, loader)
    assert not any(type(m).__name__ == "Float8Linear" for m in module.modules())
    assert type(module.model.get_submodule("blocks.0.mlp.c_fc")) is torch.nn.Linear
    moved = [k for k, v in module.state_dict().items() if not torch.equal(v, trained[k])]
    assert moved and all(k in trained for k in moved)  # it trained one more step from the float8 run's weights


@pytest.fixture(scope="module")
def world2_slow() -> dict[str, list[dict]]:
    cases = _cases(list(SLOW_CASES), SLOW_CASES)
    per_rank = run_distributed(cases_worker, 2, (cases,), timeout_s=TIMEOUT_S * 2)
    return {c["name"]: [per_rank[r][i] for r in range(2)] for i, c in enumerate(cases)}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_CASES))
def test_float8_more_layouts_match_one_process_float8(world2_slow, name):
    case = SLOW_CASES[name]
    recipe = case[1]["float8"].get("recipe", "tensorwise")
    precision = case[4] if len(case) > 4 else "32-true"
    expected = reference_float8(STEPS, GLOBAL_BATCH, recipe=recipe, precision=precision)
    losses = global_losses(world2_slow[name])
    assert _rel(losses, expected) < 1e-3, (losses, expected)
    assert world2_slow[name][0]["summary"]["float8_linears"] == 12


@pytest.mark.slow
def test_float8_hsdp_2x2_matches_one_process_float8():
    cases = _cases(["hsdp"], {"hsdp": ("ZeroStrategy", {"stage": 3, "dp_replicate_size": 2, "float8": F8}, 2, "adamw")})
    per_rank = run_distributed(cases_worker, 4, (cases,), timeout_s=TIMEOUT_S * 2)
    runs = [per_rank[r][0] for r in range(4)]
    expected = reference_float8(STEPS, GLOBAL_BATCH)
    assert _rel(global_losses(runs), expected) < 1e-3, (global_losses(runs), expected)
    assert runs[0]["summary"]["float8_fsdp_all_gather"] is True and runs[0]["precomputed_scales"] == 12
