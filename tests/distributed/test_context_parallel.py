"""Context parallelism against one process: the sequence split over cp ranks (causal load balancing), ring and
all-to-all attention, alone and with every dp mode and with tensor parallelism.

Models: the reference GPT (AdamW) and a user's causal LM with its own fused-qkv attention and learned positions read
from ``position_ids`` (:class:`tests.user_models.AttentionLM`, SGD with momentum and AdamW). Each rank's loss is the
mean over the tokens it holds, every rank holds as many, so the global batch's loss is the mean over the (dp, cp)
ranks; it must match one process on the whole batch (``rtol=1e-5``), and the gathered parameters too.
"""

from __future__ import annotations

import pytest
import torch

from lightning_par.parallel_dims import ParallelDims
from tests.helpers import assert_params_close, reference_fit
from tests.p3d_helpers import make_gpt, run_plan, token_data
from tests.user_models import make_attention_lm

pytestmark = pytest.mark.distributed

STEPS, MICRO = 3, 2
METHODS = ("ring", "all_to_all")


def _fit(name: str, model: str, **options) -> dict:
    return {"kind": "fit", "name": name, "model": model, "strategy": "parallel_3d", "options": options,
            "steps": STEPS, "micro_batch": MICRO}


WORLD2 = {f"cp2-{model}-{m}": _fit(f"cp2-{model}-{m}", model, cp_size=2, method=m)
          for model in ("gpt", "attn-sgd", "attn-adamw") for m in METHODS}
WORLD4 = {
    **{f"cp4-{model}-{m}": _fit(f"cp4-{model}-{m}", model, cp_size=4, method=m)
       for model, m in (("gpt", "ring"), ("attn-sgd", "ring"), ("attn-sgd", "all_to_all"))},
    **{f"cp2dp2-{mode}-attn-sgd": _fit(f"cp2dp2-{mode}-attn-sgd", "attn-sgd", cp_size=2, dp_size=2, dp_mode=mode)
       for mode in ("ddp", "zero1", "zero2", "zero3")},
    "cp2dp2-zero3-gpt-all_to_all": _fit("cp2dp2-zero3-gpt-all_to_all", "gpt", cp_size=2, dp_size=2, dp_mode="zero3",
                                        method="all_to_all"),
    **{f"cp2tp2-sp-gpt-{m}": _fit(f"cp2tp2-sp-gpt-{m}", "gpt", cp_size=2, tp_size=2, sequence_parallel=True,
                                  method=m) for m in ("ring",)},
}


def _samples() -> int:
    return MICRO * 2 * STEPS


@pytest.fixture(scope="module")
def world2() -> dict:
    return run_plan(2, list(WORLD2.values()), token_data(_samples()), token_data(8, seed=1), timeout_s=900)


@pytest.fixture(scope="module")
def world4() -> dict:
    return run_plan(4, list(WORLD4.values()), token_data(_samples()), token_data(8, seed=1), timeout_s=900)


def _factory(model: str):
    if model == "gpt":
        return make_gpt
    return lambda: make_attention_lm(optimizer=model.rsplit("-", 1)[1])


def _check(runs: list[dict], case: dict) -> None:
    options = case["options"]
    world = len(runs)
    dims = ParallelDims(dp_size=options.get("dp_size", -1), tp_size=options.get("tp_size", 1),
                        cp_size=options["cp_size"], world_size=world)
    one_per_piece = {}
    for r in runs:  # one rank per (dp, cp) piece of the global batch: tp ranks hold the same loss
        c = dims.coordinates(r["rank"])
        one_per_piece.setdefault((c["dp"], c["cp"]), r["losses"])
    losses = [sum(v[i] for v in one_per_piece.values()) / len(one_per_piece) for i in range(STEPS)]
    ref_losses, ref_params = reference_fit(_factory(case["model"]), token_data(_samples()), MICRO * dims.dp_size,
                                           STEPS)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for r in runs:
        assert_params_close(r["state"], ref_params)


@pytest.mark.parametrize("name", list(WORLD2))
def test_cp2_matches_one_process(world2, name):
    _check(world2[name], WORLD2[name])


@pytest.mark.parametrize("name", list(WORLD4))
def test_cp4_and_cp_with_dp_modes_and_tp_match_one_process(world4, name):
    _check(world4[name], WORLD4[name])
