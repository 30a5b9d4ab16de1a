"""The user's own exception is the last thing raised and printed: an ``IndexError`` in ``validation_step`` under
``zero3`` (a token id out of the embedding's range, raised inside the model's forward) used to end with FSDP2's
teardown error (``'Parameter' object has no attribute '_local_tensor'``: Lightning's ``teardown()`` moves the module
to the CPU while FSDP2 is mid-forward), the user's error buried above it as the context.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import pytest
from torch.utils.data import DataLoader

from lightning_par.launcher import run_distributed
from tests.support.helpers import TIMEOUT_S
from tests.support.reparallel import MICRO, EvalLM, _trainer, datasets, make_lm

pytestmark = pytest.mark.distributed


class BrokenValidation(EvalLM):
    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return super().validation_step((x + 1000, y), batch_idx)  # the user's bug: ids past the vocabulary


def _worker(strategy: str) -> list[dict[str, Any]]:
    world = int(os.environ["WORLD_SIZE"])
    train, evaluation = datasets()
    out = []
    for how in ("fit", "validate"):
        module = make_lm("sgd")
        module.__class__ = BrokenValidation
        loader = DataLoader(evaluation, batch_size=MICRO)
        try:
            if how == "fit":
                trainer = _trainer({"strategy": strategy}, world, max_steps=2, val_check_interval=2,
                                   limit_val_batches=1)
                trainer.fit(module, DataLoader(train, batch_size=MICRO), loader)
            else:
                _trainer({"strategy": strategy}, world).validate(module, loader)
        except BaseException as err:  # noqa: BLE001 - what the user's script would see
            printed = "".join(traceback.format_exception(err))
            out.append({"how": how, "type": type(err).__name__, "printed": printed})
            continue
        out.append({"how": how, "type": None, "printed": ""})
    return out


@pytest.mark.parametrize("strategy", ["zero3"])
def test_user_error_is_raised_last(strategy: str) -> None:
    for runs in run_distributed(_worker, 2, (strategy,), timeout_s=TIMEOUT_S):
        for run in runs:
            assert run["type"] == "IndexError", (run["how"], run["printed"])
            assert "During handling of the above exception" not in run["printed"], run["printed"]
            assert run["printed"].strip().splitlines()[-1] == "IndexError: index out of range in self", run["printed"]
