"""LitGPT's ``GPT`` (a pythia-style and a llama-style config, random weights) as a client of lightning_par in a Fabric
loop written as ``litgpt/pretrain.py`` writes it: zero3, dp (ddp_overlap) and tp2 match one process."""

from __future__ import annotations

import pytest
import torch

from lightning_par.launcher import run_distributed
from tests.support.helpers import TIMEOUT_S, assert_params_close

pytest.importorskip("litgpt")

from tests.support.litgpt import litgpt_worker, pretrain_loop  # noqa: E402

pytestmark = pytest.mark.distributed

MICRO, STEPS, ACC = 4, 2, 2


def _check(cases: list[tuple[str, str, str, int]]) -> None:
    results = run_distributed(litgpt_worker, 2, ([c[:3] for c in cases], MICRO, STEPS, ACC), timeout_s=TIMEOUT_S)[0]
    for (family, strategy, optimizer, dp), (losses, state) in zip(cases, results):
        ref_losses, ref_state = pretrain_loop(None, family, MICRO * dp, STEPS, ACC, optimizer)
        label = f"{family} {strategy} {optimizer}"
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0, msg=lambda m, l=label: f"{l}: {m}")
        try:
            assert_params_close(state, ref_state)
        except AssertionError as err:
            raise AssertionError(f"{label}: {err}") from None


def test_litgpt_gpt_zero3_and_tp2_match_one_process() -> None:
    """(family, strategy, optimizer, dp_size): each family under zero3 and tp2 (the plan of
    tests/litgpt_helpers.litgpt_tp_plan), SGD with momentum and AdamW."""
    _check([
        ("pythia", "zero3", "adamw", 2),
        ("llama", "zero3", "sgd", 2),
        ("pythia", "tp2", "sgd", 1),
        ("llama", "tp2", "adamw", 1),
        ("pythia", "zero3", "sgd", 2),
        ("llama", "zero3", "adamw", 2),
        ("pythia", "tp2", "adamw", 1),
        ("llama", "tp2", "sgd", 1),
    ])


@pytest.mark.slow
def test_litgpt_gpt_other_cells() -> None:
    _check([
        ("pythia", "ddp_overlap", "adamw", 2),
        ("llama", "ddp_overlap", "sgd", 2),
    ])
