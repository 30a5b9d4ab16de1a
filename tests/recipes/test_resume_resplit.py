"""The recipe resumes a mid-epoch checkpoint with more dp replicas and the same global batch (issue 35, item 4):
``parallel.world_size`` 2 -> 4 with half the ``data.batch_size`` passes the resume check (before any process starts,
and in the strategy's load) and the run continues from the checkpoint; another global batch is refused before start.
Which samples the resumed steps see is proved in tests/data/test_exact_resume.py."""

from __future__ import annotations

import pytest

from lightning_par.train import launch_job
from tests.fault.test_faults import _cfg, _losses

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]


def test_the_recipe_resumes_mid_epoch_at_dp4_with_half_the_batch(tmp_path):
    batch = int(_cfg().data.batch_size)
    first = launch_job(_cfg("strategy=ddp_overlap", "parallel.world_size=2", "trainer.max_steps=4"), tmp_path)
    assert first is not None and first["steps"] == 4
    with pytest.raises(ValueError, match=r"data-parallel replicas \(dp_size\): 2 -> 4 \(the checkpoint is 4 batches "
                                         r"into an epoch; it may resume with another dp_size if batch_size \* dp_size "
                                         rf"stays {batch} \* 2 = {2 * batch}\)"):
        launch_job(_cfg("strategy=ddp_overlap", "parallel.world_size=4", "trainer.max_steps=6"), tmp_path)
    resumed = launch_job(_cfg("strategy=ddp_overlap", "parallel.world_size=4", f"data.batch_size={batch // 2}",
                              "trainer.max_steps=6"), tmp_path)
    assert resumed is not None and resumed["steps"] == 6
    assert resumed["resumed_from"].endswith("step-4.ckpt")
    assert sorted(_losses(tmp_path)) == list(range(6))
