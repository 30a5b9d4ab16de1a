"""The per-rank timeline of real runs (one launch of 2 ranks): what the profiler traces show must be what the
strategies do.

* ``1f1b`` at pp 2 with 4 micro-batches: each rank runs torch's 1F1B order (rank 0 ``F0 F1 B0 F2 B1 F3 B2 B3``, rank 1
  ``F0 B0 F1 B1 ...``), rank 1 idles until rank 0's first forward is done (the bubble at the start) and rank 0 idles
  after its last forward until rank 1's last backward is done (the bubble at the end).
* ``ddp_overlap`` at dp 2 with small buckets: on every rank and step an all-reduce runs while backward still computes.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lightning_par.launcher import run_distributed
from lightning_par.profiling import RankTimeline
from tests.support.helpers import TIMEOUT_S, quiet_trainer
from tests.support.p3d import _loader, make_gpt, token_data

pytestmark = pytest.mark.distributed

STEPS = 2  # recorded: steps 1 and 2 of 3


def _worker(root: str) -> dict:
    from lightning_par.callbacks import TimelineCallback
    from lightning_par.strategies import DDPOverlapStrategy, PipelineStrategy

    torch.set_num_threads(1)
    env = dict(os.environ)
    rank = int(os.environ["RANK"])
    out = {}
    for name, strategy, dp in (
        ("1f1b", lambda: PipelineStrategy(pp_size=2, schedule="1f1b", num_microbatches=4, timeout_s=120), 1),
        ("ddp_overlap", lambda: DDPOverlapStrategy(bucket_cap_mb=0.005, timeout_s=120), 2),
    ):
        os.environ.update(env)
        callback = TimelineCallback(Path(root) / name, start_step=1, num_steps=STEPS)
        trainer = quiet_trainer(strategy(), 2, max_steps=3, limit_val_batches=0, callbacks=[callback])
        trainer.fit(make_gpt(), _loader(token_data(48), 8, dp, rank if dp > 1 else 0))
        out[name] = {"timelines": [t.to_dict() for t in callback.timelines], "extras": callback.summary_extras()}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("timeline")
    return root, run_distributed(_worker, 2, (str(root),), timeout_s=TIMEOUT_S)[0]


def _timelines(out: dict, name: str) -> list[RankTimeline]:
    return [RankTimeline.from_dict(d) for d in out[name]["timelines"]]


def _in(step: tuple[float, float], timeline: RankTimeline, row: str) -> list:
    return [s for s in timeline.row(row) if step[0] <= s.start < step[1]]


def test_files_and_figures(runs):
    root, out = runs
    for name in ("1f1b", "ddp_overlap"):
        assert sorted(p.name for p in (root / name).iterdir()) == ["rank0.json", "rank1.json", "timeline.json",
                                                                    "timeline.png"]
        extras = out[name]["extras"]
        assert extras["timeline_png"] == str(root / name / "timeline.png")
        assert all(c > 0 for c in extras["timeline_compute_s"]) and all(c > 0 for c in extras["timeline_comm_s"])
    assert "timeline_pp_idle_fraction" in out["1f1b"]["extras"]


def test_1f1b_pp2_shows_its_order_and_the_bubble_at_both_ends(runs):
    first, second = _timelines(runs[1], "1f1b")
    orders = {0: "F0 F1 B0 F2 B1 F3 B2 B3", 1: "F0 B0 F1 B1 F2 B2 F3 B3"}
    for i in range(STEPS):
        calls = []
        for rank, timeline in enumerate((first, second)):
            step = timeline.steps[i]
            mine = [s for s in _in(step, timeline, "compute") if s.label[:1] in ("F", "B")]
            assert " ".join(s.label for s in mine) == orders[rank]
            calls.append(mine)
        # start: rank 1 computes nothing until rank 0's first forward has been sent
        assert calls[1][0].start >= calls[0][0].end
        # end: rank 0's last backward needs rank 1's last backward; rank 0 idles after its last forward meanwhile
        assert calls[0][-1].start >= calls[1][-1].end
        last_forward = next(s for s in reversed(calls[0]) if s.label.startswith("F"))
        assert calls[0][-2].start - last_forward.end >= 0  # B2 after F3, then idle until rank 1's B3 lands
        assert calls[0][-1].start - calls[0][-2].end > 0


def test_ddp_overlap_all_reduce_runs_during_backward(runs):
    for timeline in _timelines(runs[1], "ddp_overlap"):
        for step in timeline.steps:
            backward = [s for s in _in(step, timeline, "compute") if s.kind == "backward"]
            assert len(backward) == 1
            reduces = [s for s in _in(step, timeline, "comm") if s.kind == "all_reduce"]
            assert len(reduces) > 1
            assert any(backward[0].start < s.start < backward[0].end for s in reduces)
    assert all(f > 0 for f in runs[1]["ddp_overlap"]["extras"]["timeline_comm_overlap"])
