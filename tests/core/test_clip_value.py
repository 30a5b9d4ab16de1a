"""``gradient_clip_algorithm="value"`` under every layout, against one process's ``clip_grad_value_``.

Clipping by value is elementwise, so each rank clamps its own gradient shards (a DTensor's local tensor, a ZeRO chunk,
its pipeline stage's parameters) and gets exactly the one process's result. Before, Lightning's
``clip_grad_value_`` crashed under tensor parallelism (``_foreach_clamp_min_ got mixed torch.Tensor and DTensor``).
Losses of every step and the final parameters at rel 1e-5 (fp32), Lightning's shuffling sampler, SGD with momentum and
AdamW; the clip value (1e-3) changes the one-process run (checked).
"""

from __future__ import annotations

import pytest
import torch

from lightning_par.launcher import run_distributed
from tests.support.helpers import TIMEOUT_S, assert_params_close
from tests.support.reparallel import global_losses, reference, worker

pytestmark = pytest.mark.distributed

CLIP = 1e-3


def _case(name: str, strategy: str, optimizer: str, dp: int, **options: int) -> dict:
    return {"name": name, "strategy": strategy, "options": options, "optimizer": optimizer, "dp": dp,
            "fits": [("new", 3)], "clip_value": CLIP}


def _check(cases: list[dict], world: int) -> None:
    results = run_distributed(worker, world, (cases,), timeout_s=TIMEOUT_S)
    for case in cases:
        ref = reference(case)
        unclipped = reference({**case, "clip_value": None})
        assert max((ref["params"][n] - unclipped["params"][n]).abs().max() for n in ref["params"]) > 1e-3
        runs = [r[case["name"]] for r in results]
        torch.testing.assert_close(torch.tensor(global_losses(runs)), torch.tensor(ref["losses"]), rtol=1e-5, atol=0,
                                   msg=lambda m, c=case["name"]: f"{c}: {m}")
        for run in runs:
            assert_params_close(run["params"], ref["params"])


def test_clip_by_value_tp2_and_zero2() -> None:
    _check([_case("tp2", "tensor_parallel", "adamw", 1, tp_size=2), _case("zero2", "zero2", "sgd", 2)], 2)


def test_clip_by_value_dp2_tp2() -> None:
    _check([_case("dp2_tp2", "tensor_parallel", "sgd", 2, tp_size=2)], 4)


@pytest.mark.slow
def test_clip_by_value_other_layouts_world2() -> None:
    _check([_case("zero1", "zero1", "adamw", 2), _case("zero3", "zero3", "sgd", 2), _case("pp2", "1f1b", "adamw", 1)],
           2)


@pytest.mark.slow
def test_clip_by_value_dp2_pp2() -> None:
    _check([_case("dp2_pp2", "1f1b", "sgd", 2)], 4)
