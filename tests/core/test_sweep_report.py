"""The sweep report from hand-written job directories: labels, columns, CSV, panels, loss axis."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from lightning_par.sweep import Column, collect_jobs, loss_axis_limits, plot_panels, register_column, write_sweep_report

MiB = 1024 * 1024


def _job(sweep: Path, name: str, overrides: list[str], summary: dict | None) -> None:
    job = sweep / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if summary is not None:
        (job / "summary.json").write_text(json.dumps(summary))


def _summary(strategy: str, param: int, grad: int, optim: int, **extra) -> dict:
    return {"strategy": strategy, "dp_size": 2, "tp_size": 1, "pp_size": 1, "world_size": 2, "tokens_per_s": 1000.0,
            "param_bytes": [param, param], "grad_bytes": [grad, grad], "optimizer_state_bytes": [optim, optim],
            "peak_memory_bytes": [300 * MiB, 310 * MiB], "final_train_loss": 5.4, "final_val_loss": 5.35,
            "config": {"trainer": {"accelerator": "auto"}}, "accelerator": "cpu", **extra}


@pytest.fixture
def strategy_sweep(tmp_path):
    _job(tmp_path, "0_strategy=ddp_overlap,model=tiny", ["strategy=ddp_overlap", "model=tiny", "strategy.bucket_cap_mb=1"],
         _summary("ddp_overlap", 4 * MiB, 4 * MiB, 8 * MiB))
    _job(tmp_path, "1_strategy=zero3,model=tiny", ["strategy=zero3", "model=tiny", "strategy.bucket_cap_mb=2"],
         _summary("zero3", 2 * MiB, 2 * MiB, 4 * MiB, final_val_loss=5.3501))
    _job(tmp_path, "2_strategy=zero2,model=tiny", ["strategy=zero2", "model=tiny", "strategy.bucket_cap_mb=2"], None)
    return tmp_path


def test_jobs_are_labelled_by_strategy_layout_and_swept_options(strategy_sweep):
    jobs = collect_jobs(strategy_sweep)
    assert [j.number for j in jobs] == ["0", "1", "2"]
    assert jobs[0].swept == {"strategy": "ddp_overlap", "strategy.bucket_cap_mb": "1"}  # model=tiny is not swept
    assert jobs[1].label == "1 zero3\ndp2·tp1·pp1\nstrategy.bucket_cap_mb=2"
    assert jobs[2].label == "2 zero2\nfailed\nstrategy.bucket_cap_mb=2"


def test_report_md_and_csv_hold_the_same_rows(strategy_sweep):
    md, png = write_sweep_report(strategy_sweep)
    rows = list(csv.DictReader((strategy_sweep / "report.csv").open()))
    assert [r["strategy"] for r in rows] == ["ddp_overlap", "zero3", ""]
    assert float(rows[0]["state_mib"]) == pytest.approx(16.0) and float(rows[1]["state_mib"]) == pytest.approx(8.0)
    assert float(rows[1]["param_mib"]) == pytest.approx(2.0) and rows[1]["peak_mib"] == ""  # CPU: RSS only
    assert float(rows[1]["peak_rss_mib"]) == pytest.approx(310.0)
    assert rows[2]["status"].startswith("no summary.json")
    text = md.read_text()
    assert "| 1_strategy=zero3,model=tiny | zero3 | dp2·tp1·pp1 | strategy.bucket_cap_mb=2 | 2 | 1000 | 8.000 |" in text
    assert png is not None and png.stat().st_size > 10_000


def test_bubble_panel_only_when_a_job_pipelines(strategy_sweep, tmp_path_factory):
    assert plot_panels(collect_jobs(strategy_sweep)) == ["tokens", "state", "loss"]
    _job(strategy_sweep, "3_parallel=pp2", ["parallel=pp2"], _summary("gpipe", 1, 1, 1, pp_size=2, pp_bubble=0.2))
    assert plot_panels(collect_jobs(strategy_sweep)) == ["tokens", "state", "bubble", "loss"]


def test_loss_axis_fits_the_values_not_zero():
    lo, hi = loss_axis_limits([5.35, 5.3501])
    assert 5.34 < lo < 5.35 and 5.3501 < hi < 5.36
    lo, hi = loss_axis_limits([2.0, 2.0])
    assert 1.99 < lo < 2.0 < hi < 2.01


def test_peak_is_plotted_only_where_the_allocator_measured_it(tmp_path):
    _job(tmp_path, "0_x=1", ["x=1"], _summary("zero1", MiB, MiB, MiB, accelerator="gpu"))
    rows = list(csv.DictReader(open(write_sweep_report(tmp_path)[0].with_suffix(".csv"))))
    assert float(rows[0]["peak_mib"]) == pytest.approx(310.0) and rows[0]["peak_rss_mib"] == ""


def test_registered_column_is_written(strategy_sweep, monkeypatch):
    from lightning_par import sweep

    monkeypatch.setattr(sweep, "_EXTRA_COLUMNS", [])
    register_column(Column("tokens_per_rank", "tokens/s/rank", lambda j: None if j.summary is None else j.get("tokens_per_s") / j.get("world_size"), ".1f"))
    write_sweep_report(strategy_sweep)
    rows = list(csv.DictReader((strategy_sweep / "report.csv").open()))
    assert rows[0]["tokens_per_rank"] == "500.0"
    assert "tokens/s/rank" in (strategy_sweep / "report.md").read_text()
