"""The per-rank timeline without processes: Chrome traces written by hand (as torch.profiler writes them on CPU and
on CUDA) read into lanes, their figures, the common clock of one host, and the PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_par.callbacks import TimelineCallback
from lightning_par.profiling import align_timelines, draw_timeline, read_trace, timeline_figures
from lightning_par.profiling.__main__ import main as redraw
from lightning_par.profiling.trace import collective_name, pipeline_annotation

MAIN, GLOO = 100, 200  # thread ids


def _x(name: str, ts: float, dur: float, tid: int = MAIN, cat: str = "user_annotation") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


def _write(path: Path, events: list[dict], rank: int = 0, host: str = "h", base_ns: int = 10**18) -> Path:
    path.write_text(json.dumps({"traceEvents": events, "distributedInfo": {"rank": rank}, "host_name": host,
                                "baseTimeNanoseconds": base_ns}))
    return path


def _ddp_step(t0: float) -> list[dict]:
    """One data-parallel step (µs): forward 0-100, backward 100-300, an all-reduce 150-250 (hidden) and one 280-340
    (partly exposed), optimizer 360-400; the step 0-400."""
    return [
        _x("lp::step", t0, 400), _x("lp::forward", t0, 100), _x("lp::backward", t0 + 100, 200),
        _x("gloo:all_reduce", t0 + 150, 100, GLOO), _x("gloo:all_reduce", t0 + 280, 60, GLOO),
        _x("aten::mm", t0 + 10, 5, cat="cpu_op"), _x("lp::optimizer", t0 + 360, 40),
    ]


def test_a_data_parallel_step_becomes_compute_comm_and_idle(tmp_path):
    events = [_x("lp::align", 0, 50), _x("gloo:barrier", 10, 30, GLOO), *_ddp_step(1050)]
    timeline = read_trace(_write(tmp_path / "rank0.json", events))
    assert timeline.steps == [(1e-3, 1.4e-3)]  # seconds from the barrier's end (50 µs)
    assert [(s.kind, s.row) for s in timeline.row("compute")] == [("forward", "compute"), ("backward", "compute"),
                                                                    ("optimizer", "compute")]
    assert [s.kind for s in timeline.row("comm")] == ["all_reduce", "all_reduce"]  # the align barrier is left out
    f = timeline.figures()
    assert f["window_s"] == pytest.approx(400e-6)
    assert f["compute_s"] == pytest.approx(340e-6)
    assert f["idle_s"] == pytest.approx(60e-6)
    assert f["comm_s"] == pytest.approx(160e-6)
    assert f["comm_hidden_s"] == pytest.approx(120e-6)  # 150-250 and 280-300 lie under backward
    assert f["comm_overlap"] == pytest.approx(0.75)


def test_a_pipelined_step_draws_the_schedule_calls_not_its_container(tmp_path):
    events = [_x("lp::align", 0, 10), _x("lp::step", 10, 500), _x("lp::schedule", 10, 400),
              _x(pipeline_annotation("F", 1, 0), 100, 50), _x(pipeline_annotation("L", 1, 0), 150, 10),
              _x(pipeline_annotation("B", 1, 0), 160, 100), _x("gloo:recv", 20, 80, GLOO),
              _x("lp::optimizer", 450, 50)]
    timeline = read_trace(_write(tmp_path / "rank1.json", events, rank=1))
    assert timeline.rank == 1 and timeline.schedules == [(0.0, 400e-6)]
    assert [(s.kind, s.label) for s in timeline.row("compute")] == [
        ("forward", "F0"), ("loss", "L0"), ("backward", "B0"), ("optimizer", "")]
    assert [s.kind for s in timeline.row("comm")] == ["recv"]
    figures = timeline_figures([timeline])
    assert figures["timeline_pp_idle_fraction"] == [pytest.approx(1 - 160 / 400)]  # the bubble of the schedule


def test_a_cuda_trace_takes_compute_from_the_device_and_comm_from_nccl_kernels(tmp_path):
    events = [_x("lp::align", 0, 10), _x("lp::step", 10, 1000), _x("lp::forward", 10, 20),
              _x("lp::forward", 100, 300, tid=7, cat="gpu_user_annotation"),
              _x("nccl:all_reduce", 20, 5),  # the host's launch, not the transfer
              _x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 300, 200, tid=7, cat="kernel"),
              _x("ampere_sgemm_128x64_tn", 100, 100, tid=7, cat="kernel")]
    timeline = read_trace(_write(tmp_path / "rank0.json", events))
    assert timeline.device == "cuda"
    assert [(s.kind, s.start, s.end) for s in timeline.row("compute")] == [("forward", 90e-6, 390e-6)]
    assert [(s.kind, s.start) for s in timeline.row("comm")] == [("all_reduce", 290e-6)]


@pytest.mark.parametrize(
    ("name", "collective"),
    [("gloo:all_reduce", "all_reduce"), ("gloo:allgather", "all_gather"), ("gloo:reduce_scatter", "reduce_scatter"),
     ("nccl:_allgather_base", "all_gather"), ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "reduce_scatter"),
     ("ncclKernel_SendRecv", "recv"), ("gloo:send", "send"), ("gloo:broadcast", "broadcast"),
     ("gloo:all_to_all", "all_to_all"), ("gloo:barrier", "barrier"), ("gloo:something_new", "other")],
)
def test_collective_names_are_normalised(name, collective):
    assert collective_name(name) == collective


def test_ranks_of_one_host_share_its_clock_and_other_hosts_stay_on_the_barrier(tmp_path):
    a = read_trace(_write(tmp_path / "rank0.json", [_x("lp::align", 0, 100), _x("lp::step", 100, 50)], rank=0))
    # rank 1 left the same barrier 30 µs later on the same clock (its own trace starts counting elsewhere)
    b = read_trace(_write(tmp_path / "rank1.json", [_x("lp::align", 1000, 130), _x("lp::step", 1130, 50)], rank=1,
                          base_ns=10**18 - 1000 * 1000))
    same = align_timelines([a, b])
    assert same[0].steps == [(0.0, 50e-6)] and same[1].steps[0][0] == pytest.approx(30e-6)
    b.host = "other"
    apart = align_timelines([a, b])
    assert apart[1].steps == b.steps  # different hosts: barrier alignment kept


def test_a_trace_without_steps_is_refused(tmp_path):
    with pytest.raises(ValueError, match="has no 'lp::step' range: record it with"):
        read_trace(_write(tmp_path / "rank0.json", [_x("aten::mm", 0, 10, cat="cpu_op")]))


def test_the_png_and_the_command_line_redraw(tmp_path, capsys):
    paths = [_write(tmp_path / f"rank{r}.json", [_x("lp::align", 0, 50), *_ddp_step(100 + 20 * r)], rank=r)
             for r in range(2)]
    png = draw_timeline([read_trace(p) for p in paths], tmp_path / "out" / "t.png", "title", ["a", "b"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    redraw([str(tmp_path)])
    assert (tmp_path / "timeline.png").exists()
    assert "timeline_comm_overlap [0.75, 0.75]" in capsys.readouterr().out
    with pytest.raises(ValueError, match="at least one"):
        draw_timeline([], tmp_path / "x.png")


@pytest.mark.parametrize(("kwargs", "match"),
                         [({"start_step": -1}, "start_step=-1"), ({"num_steps": 0}, "num_steps=0")])
def test_callback_options_are_checked(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        TimelineCallback(tmp_path, **kwargs)
