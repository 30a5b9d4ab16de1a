"""The report of a Hydra multirun sweep: one row per job, from each job's ``summary.json``.

:class:`SweepReportCallback` is a Hydra callback (configured in ``conf/config.yaml``) that writes, when a sweep ends,
``report.md`` (a markdown table) and ``report.png`` (bar charts of tokens/s, peak memory per rank, pipeline bubble and
final loss per job) into the sweep directory. :func:`write_sweep_report` does the same for any directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from lightning_par.planner.run_config import predicted_columns

__all__ = ["SweepReportCallback", "collect_summaries", "write_sweep_report"]

_MiB = 1024 * 1024


def collect_summaries(sweep_dir: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """``(job directory name, summary)`` for every ``<sweep_dir>/*/summary.json``, in job order."""
    rows = []
    for path in sorted(Path(sweep_dir).glob("*/summary.json"), key=lambda p: _job_key(p.parent.name)):
        rows.append((path.parent.name, json.loads(path.read_text())))
    return rows


def _job_key(name: str) -> tuple[int, str]:
    head = name.split("_", 1)[0]
    return (int(head), name) if head.isdigit() else (1 << 30, name)


def _fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _row(name: str, s: dict[str, Any]) -> dict[str, Any]:
    peak = max(s.get("peak_memory_bytes") or [0]) / _MiB or None
    state = [
        sum(x) for x in zip(s.get("param_bytes") or [], s.get("grad_bytes") or [], s.get("optimizer_state_bytes") or [])
    ]
    return {
        "job": name,
        "strategy": s.get("strategy"),
        "layout": f"dp{s.get('dp_size')}·tp{s.get('tp_size')}·pp{s.get('pp_size')}",
        "world_size": s.get("world_size"),
        "tokens_per_s": s.get("tokens_per_s"),
        "peak_mib": peak,
        "state_mib": max(state) / _MiB if state else None,
        "bubble": s.get("pp_bubble"),
        "final_train_loss": s.get("final_train_loss"),
        "final_val_loss": s.get("final_val_loss"),
        **predicted_columns(s),  # the layout planner's prediction for this job's config (n/a if it has none)
    }


def write_sweep_report(sweep_dir: str | Path) -> tuple[Path, Path | None]:
    """Write ``report.md`` and ``report.png`` into ``sweep_dir``; return their paths (png ``None`` without jobs).

    Columns: tokens/s (global), peak memory (MiB, the largest rank; on CPU whole-process RSS), model state (MiB,
    parameters + gradients + optimizer state of the largest rank), pipeline bubble (fraction of a step idle; n/a
    without pipelining), final train and validation loss (nats).
    """
    sweep_dir = Path(sweep_dir)
    rows = [_row(name, s) for name, s in collect_summaries(sweep_dir)]
    lines = [
        f"# Sweep report: {sweep_dir}",
        "",
        "| job | strategy | layout | world | tokens/s | predicted tokens/s | peak MiB/rank | state MiB/rank | predicted "
        "state MiB | bubble | train loss | val loss |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['job']} | {r['strategy']} | {r['layout']} | {r['world_size']} | {_fmt(r['tokens_per_s'], '.0f')} | "
            f"{_fmt(r['pred_tokens_per_s'], '.0f')} | {_fmt(r['peak_mib'], '.0f')} | {_fmt(r['state_mib'], '.2f')} | "
            f"{_fmt(r['pred_state_mib'], '.2f')} | {_fmt(r['bubble'], '.3f')} | "
            f"{_fmt(r['final_train_loss'], '.4f')} | {_fmt(r['final_val_loss'], '.4f')} |"
        )
    if not rows:
        lines.append("\nNo job wrote a summary.json.")
    md = sweep_dir / "report.md"
    md.write_text("\n".join(lines) + "\n")
    if not rows:
        return md, None
    return md, _plot(rows, sweep_dir / "report.png")


def _plot(rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['job'].split('_', 1)[0]}\n{r['layout']}" for r in rows]
    panels = [
        ("tokens_per_s", "tokens/s (global)"),
        ("peak_mib", "peak memory per rank (MiB)"),
        ("bubble", "pipeline bubble (fraction of step)"),
        ("final_val_loss", "final validation loss (nats)"),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    for ax, (key, title) in zip(axes.flat, panels):
        values = [r[key] if r[key] is not None else 0.0 for r in rows]
        ax.bar(range(len(rows)), values, color="#4c72b0")
        ax.set_xticks(range(len(rows)), labels, fontsize=8)
        ax.set_title(title, fontsize=10)
        for i, r in enumerate(rows):
            if r[key] is None:
                ax.text(i, 0, "n/a", ha="center", va="bottom", fontsize=8)
    fig.suptitle("lightning_par sweep")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


class SweepReportCallback(Callback):
    """Hydra callback: after a multirun, write the sweep report into the sweep directory."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        md, png = write_sweep_report(config.hydra.sweep.dir)
        print(f"Sweep report: {md}" + (f" and {png}" if png else ""))
