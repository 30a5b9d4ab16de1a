"""``torch.compile`` in ``configure_model``, run as the user does (Lightning's documented pattern): tensor parallelism
refuses it before the first step with one clear error (it used to crash inside the plan: ``plan path names a missing
module ... children: ['_orig_mod']``); ``zero3`` trains the compiled network at parity with one process (fp32,
rel 1e-5, Lightning's shuffling sampler)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_par.launcher import run_distributed
from tests.support.helpers import TIMEOUT_S, LossRecorder
from tests.support.reparallel import MICRO, EvalLM, _trainer, datasets, make_lm, reference

pytestmark = pytest.mark.distributed


class CompiledLM(EvalLM):
    def configure_model(self) -> None:
        if not hasattr(self.model, "_orig_mod"):
            self.model = torch.compile(self.model, backend="aot_eager")


def _worker() -> dict[str, Any]:
    world = int(os.environ["WORLD_SIZE"])
    train, _ = datasets()
    out: dict[str, Any] = {}
    for strategy, options in (("tensor_parallel", {"tp_size": 2}), ("zero3", {})):
        module = make_lm("sgd")
        module.__class__ = CompiledLM
        recorder = LossRecorder()
        trainer = _trainer({"strategy": strategy, "options": options}, world, max_steps=3, limit_val_batches=0,
                           callbacks=[recorder])
        try:
            trainer.fit(module, DataLoader(train, batch_size=MICRO, drop_last=True))
        except ValueError as err:
            out[strategy] = {"error": str(err), "global_step": trainer.global_step}
            continue
        out[strategy] = {"losses": recorder.losses}
    return out


def test_compile_in_configure_model() -> None:
    runs = run_distributed(_worker, 2, (), timeout_s=TIMEOUT_S)
    for run in runs:
        tp = run["tensor_parallel"]
        assert tp.get("global_step") == 0, tp
        assert "CompiledLM.model is a torch.compile'd module" in tp["error"]
        assert "tensor parallelism (tp_size=2) cannot run" in tp["error"]
    ref = reference({"optimizer": "sgd", "dp": 2, "fits": [("new", 3)]})["losses"][0]
    got = [(a + b) / 2 for a, b in zip(runs[0]["zero3"]["losses"], runs[1]["zero3"]["losses"])]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=0)
