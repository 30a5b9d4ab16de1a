"""The report of a Hydra multirun sweep: one row per job, from each job's ``summary.json``.

:class:`SweepReportCallback` is a Hydra callback (configured in ``conf/config.yaml``) that writes into the sweep
directory, after each job and when the sweep ends:

* ``report.md``: a markdown table, one row per job;
* ``report.csv``: the same columns, machine-readable;
* ``report.png``: panels of tokens/s, model-state bytes per rank (parameters + gradients + optimizer state, stacked,
  with the allocator's peak where one was measured), the pipeline bubble (only when a job pipelines) and the final
  validation loss (on an axis fitted to the values, not from 0).

Each job is labelled by its strategy and layout plus every other option the sweep varies (read from the job's
``.hydra/overrides.yaml``). The columns are :class:`Column` objects: pass more to :func:`write_sweep_report`, or
:func:`register_column` one so that the callback writes it too.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

__all__ = [
    "DEFAULT_COLUMNS",
    "Column",
    "JobResult",
    "SweepReportCallback",
    "collect_jobs",
    "collect_summaries",
    "loss_axis_limits",
    "plot_panels",
    "register_column",
    "write_sweep_report",
]

_MiB = 1024 * 1024
#: Overrides already shown by a job's strategy and layout.
_SHOWN_KEYS = frozenset({"parallel", "strategy", "strategy.name"})
#: Peak-memory kinds that measure tensors (the allocator), as opposed to whole-process RSS.
_ALLOCATOR_KINDS = frozenset({"allocated", "cuda"})


@dataclass
class JobResult:
    """One job of a sweep.

    Attributes:
        name: the job directory's name (``<num>_<overrides>``).
        path: the job directory.
        summary: its ``summary.json`` (``None`` when the job wrote none: it failed or is still running).
        overrides: its command-line overrides, ``key=value`` (from ``.hydra/overrides.yaml``).
        swept: the overrides the sweep varies, ``key -> value`` (filled by :func:`collect_jobs`).
    """

    name: str
    path: Path
    summary: dict[str, Any] | None
    overrides: list[str] = field(default_factory=list)
    swept: dict[str, str] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        """A summary field, or ``default`` (also for a job without summary)."""
        return default if self.summary is None else self.summary.get(key, default)

    @property
    def number(self) -> str:
        return self.name.split("_", 1)[0]

    @property
    def layout(self) -> str | None:
        if self.summary is None:
            return None
        return f"dp{self.get('dp_size')}·tp{self.get('tp_size')}·pp{self.get('pp_size')}"

    @property
    def label(self) -> str:
        """``<num> <strategy>`` / ``<layout>`` / every other swept ``key=value``, one per line."""
        strategy = self.get("strategy") or self.swept.get("strategy") or "?"
        lines = [f"{self.number} {strategy}", self.layout or "failed"]
        lines += [f"{k}={v}" for k, v in self.swept.items() if k not in _SHOWN_KEYS]
        return "\n".join(lines)


@dataclass(frozen=True)
class Column:
    """One column of the report.

    Attributes:
        key: the CSV header (snake_case).
        header: the markdown header.
        value: the value for a job (``None``: unknown / not applicable).
        fmt: format spec of the markdown cell (``".2f"``); the CSV holds the raw value.
    """

    key: str
    header: str
    value: Callable[[JobResult], Any]
    fmt: str = ""


def _per_rank(job: JobResult, key: str) -> list[int]:
    return [v for v in (job.get(key) or []) if v is not None]


def _state_parts(job: JobResult) -> tuple[float, float, float] | None:
    """(parameter, gradient, optimizer-state) MiB of the rank holding the most model state."""
    ranks = list(zip(_per_rank(job, "param_bytes"), _per_rank(job, "grad_bytes"), _per_rank(job, "optimizer_state_bytes")))
    if not ranks:
        return None
    top = max(ranks, key=sum)
    return (top[0] / _MiB, top[1] / _MiB, top[2] / _MiB)


def _peak_kind(job: JobResult) -> str:
    """``"allocated"`` when ``peak_memory_bytes`` counts tensors (CUDA allocator), ``"rss"`` for whole-process RSS
    (CPU), from the summary's ``peak_memory_kind`` or else the device the job ran on."""
    kind = job.get("peak_memory_kind")
    if kind:
        return str(kind)
    config = job.get("config") or {}
    device = job.get("accelerator") or (config.get("trainer") or {}).get("accelerator")
    return "allocated" if device in ("gpu", "cuda") else "rss"


def _peak_mib(job: JobResult, allocator: bool) -> float | None:
    peaks = _per_rank(job, "peak_memory_bytes")
    if not peaks or ((_peak_kind(job) in _ALLOCATOR_KINDS) != allocator):
        return None
    return max(peaks) / _MiB


def _state_part(index: int) -> Callable[[JobResult], float | None]:
    return lambda job: None if (parts := _state_parts(job)) is None else parts[index]


#: The report's columns, in order.
def _predicted(key: str) -> Callable[[JobResult], Any]:
    """A figure the layout planner predicts for the job's config (``None`` when it cannot: see
    :func:`lightning_par.planner.run_config.predicted_columns`)."""

    def value(job: JobResult) -> Any:
        if job.summary is None:
            return None
        if "_predicted" not in job.__dict__:
            from lightning_par.planner.run_config import predicted_columns

            job.__dict__["_predicted"] = predicted_columns(job.summary)
        return job.__dict__["_predicted"][key]

    return value


DEFAULT_COLUMNS: tuple[Column, ...] = (
    Column("job", "job", lambda j: j.name),
    Column("strategy", "strategy", lambda j: j.get("strategy")),
    Column("layout", "layout", lambda j: j.layout),
    Column("swept", "swept options", lambda j: " ".join(f"{k}={v}" for k, v in j.swept.items() if k not in _SHOWN_KEYS)),
    Column("world_size", "world", lambda j: j.get("world_size")),
    Column("tokens_per_s", "tokens/s", lambda j: j.get("tokens_per_s"), ".0f"),
    Column("state_mib", "state MiB/rank", lambda j: None if (p := _state_parts(j)) is None else sum(p), ".3f"),
    Column("param_mib", "params MiB", _state_part(0), ".3f"),
    Column("grad_mib", "grads MiB", _state_part(1), ".3f"),
    Column("optimizer_state_mib", "optim MiB", _state_part(2), ".3f"),
    Column("peak_mib", "peak MiB/rank", lambda j: _peak_mib(j, allocator=True), ".1f"),
    Column("peak_rss_mib", "RSS MiB/rank", lambda j: _peak_mib(j, allocator=False), ".0f"),
    Column("bubble", "bubble", lambda j: j.get("pp_bubble"), ".3f"),
    Column("final_train_loss", "train loss", lambda j: j.get("final_train_loss"), ".4f"),
    Column("final_val_loss", "val loss", lambda j: j.get("final_val_loss"), ".4f"),
    Column("pred_tokens_per_s", "predicted tokens/s", _predicted("pred_tokens_per_s"), ".0f"),
    Column("pred_state_mib", "predicted state MiB", _predicted("pred_state_mib"), ".3f"),
    Column("status", "status", lambda j: "ok" if j.summary is not None else "no summary.json (failed?)"),
)

#: Columns added by :func:`register_column`, written after :data:`DEFAULT_COLUMNS`.
_EXTRA_COLUMNS: list[Column] = []


def register_column(column: Column) -> None:
    """Add ``column`` to every report written afterwards with the default columns (the sweep callback's too);
    a column with the same ``key`` is replaced."""
    _EXTRA_COLUMNS[:] = [c for c in _EXTRA_COLUMNS if c.key != column.key] + [column]


def _job_key(name: str) -> tuple[int, str]:
    head = name.split("_", 1)[0]
    return (int(head), name) if head.isdigit() else (1 << 30, name)


def _read_overrides(job_dir: Path) -> list[str]:
    path = job_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return []
    from omegaconf import OmegaConf

    return [str(o) for o in OmegaConf.load(path)]


def _split(override: str) -> tuple[str, str]:
    key, _, value = override.partition("=")
    return key.lstrip("+~"), value


def collect_jobs(sweep_dir: str | Path) -> list[JobResult]:
    """Every job directory of ``sweep_dir`` (one holding ``summary.json`` or ``.hydra/``), in job order, with the
    overrides the sweep varies."""
    sweep_dir = Path(sweep_dir)
    dirs = [p for p in sweep_dir.iterdir() if p.is_dir() and ((p / "summary.json").exists() or (p / ".hydra").is_dir())]
    jobs = []
    for path in sorted(dirs, key=lambda p: _job_key(p.name)):
        summary_path = path / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
        jobs.append(JobResult(path.name, path, summary, _read_overrides(path)))
    values: dict[str, set[str]] = {}
    for job in jobs:
        for key, value in map(_split, job.overrides):
            values.setdefault(key, set()).add(value)
    varied = {k for k, v in values.items() if len(v) > 1 or any(k not in dict(map(_split, j.overrides)) for j in jobs)}
    for job in jobs:
        job.swept = {k: v for k, v in map(_split, job.overrides) if k in varied}
    return jobs


def collect_summaries(sweep_dir: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """``(job directory name, summary)`` for every job of ``sweep_dir`` that wrote a ``summary.json``, in job order."""
    return [(j.name, j.summary) for j in collect_jobs(sweep_dir) if j.summary is not None]


def _cell(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, fmt) if fmt else str(value)


def write_sweep_report(
    sweep_dir: str | Path, columns: Sequence[Column] | None = None
) -> tuple[Path, Path | None]:
    """Write ``report.md``, ``report.csv`` and ``report.png`` into ``sweep_dir``; return the markdown and picture
    paths (picture ``None`` when no job wrote a summary).

    Units: tokens/s global (the slowest rank's view); state, params, grads, optim in MiB (2**20 bytes) of the rank
    holding the most model state; peak MiB/rank: the allocator's peak (GPUs); RSS MiB/rank: whole-process peak
    resident memory (CPU, flat: it hides tensor memory); bubble: fraction of a step a stage idles (n/a without
    pipelining); losses in nats.

    Args:
        sweep_dir: the sweep directory (``hydra.sweep.dir``).
        columns: the columns; default :data:`DEFAULT_COLUMNS` plus the registered ones.
    """
    sweep_dir = Path(sweep_dir)
    columns = tuple(columns) if columns is not None else (*DEFAULT_COLUMNS, *_EXTRA_COLUMNS)
    jobs = collect_jobs(sweep_dir)
    rows = [{c.key: c.value(j) for c in columns} for j in jobs]
    lines = [
        f"# Sweep report: {sweep_dir}",
        "",
        "| " + " | ".join(c.header for c in columns) + " |",
        "|" + "|".join("---:" if c.fmt else "---" for c in columns) + "|",
    ]
    lines += ["| " + " | ".join(_cell(r[c.key], c.fmt) for c in columns) + " |" for r in rows]
    done = [j for j in jobs if j.summary is not None]
    if not done:
        lines.append("\nNo job wrote a summary.json.")
    md = sweep_dir / "report.md"
    md.write_text("\n".join(lines) + "\n")
    with (sweep_dir / "report.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[c.key for c in columns])
        writer.writeheader()
        writer.writerows(rows)
    if not done:
        return md, None
    return md, _plot(jobs, sweep_dir / "report.png", sweep_dir.name)


def _bar_labels(ax: Any, xs: Sequence[int], values: Sequence[float | None], fmt: str) -> None:
    for x, v in zip(xs, values):
        if v is not None:
            ax.annotate(format(v, fmt), (x, v), textcoords="offset points", xytext=(0, 2), ha="center", fontsize=7)


def plot_panels(jobs: Sequence[JobResult]) -> list[str]:
    """The panels of ``report.png``: ``tokens``, ``state``, ``bubble`` (only when a job pipelines) and ``loss``."""
    pipelined = any((j.get("pp_size") or 1) > 1 or j.get("pp_bubble") is not None for j in jobs)
    return ["tokens", "state"] + (["bubble"] if pipelined else []) + ["loss"]


def loss_axis_limits(values: Sequence[float]) -> tuple[float, float]:
    """Y limits that show the differences between losses: the values' range plus a margin (never from 0)."""
    lo, hi = min(values), max(values)
    pad = max((hi - lo) * 0.25, abs(hi) * 1e-4, 1e-6)
    return lo - pad, hi + 2 * pad


def _plot(jobs: list[JobResult], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = list(range(len(jobs)))
    labels = [j.label for j in jobs]
    panels = plot_panels(jobs)
    ncols = 2
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(max(10, 1.6 * len(jobs) * ncols), 3.6 * nrows), constrained_layout=True, squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, panel in zip(axes.flat, panels):
        if panel == "tokens":
            values = [j.get("tokens_per_s") for j in jobs]
            ax.bar(xs, [v or 0 for v in values], color="#4c72b0")
            _bar_labels(ax, xs, values, ".0f")
            ax.set_title("throughput: tokens/s (global)", fontsize=10)
        elif panel == "state":
            parts = [_state_parts(j) or (0.0, 0.0, 0.0) for j in jobs]
            bottom = [0.0] * len(jobs)
            for i, (name, color) in enumerate((("parameters", "#4c72b0"), ("gradients", "#dd8452"), ("optimizer state", "#55a868"))):
                heights = [p[i] for p in parts]
                ax.bar(xs, heights, bottom=bottom, color=color, label=name)
                bottom = [b + h for b, h in zip(bottom, heights)]
            _bar_labels(ax, xs, [sum(p) if any(p) else None for p in parts], ".3f")
            peaks = [_peak_mib(j, allocator=True) for j in jobs]
            if any(p is not None for p in peaks):
                ax.scatter([x for x, p in zip(xs, peaks) if p is not None], [p for p in peaks if p is not None],
                           marker="_", s=400, color="black", label="peak allocated")
            ax.set_title("model state per rank (MiB, the largest rank)", fontsize=10)
            ax.legend(fontsize=7, loc="upper right")
        elif panel == "bubble":
            values = [j.get("pp_bubble") for j in jobs]
            ax.bar(xs, [v or 0 for v in values], color="#8172b2")
            _bar_labels(ax, xs, values, ".3f")
            for x, j in zip(xs, jobs):
                if values[x] is None and j.summary is not None:
                    ax.annotate("no pp", (x, 0), ha="center", va="bottom", fontsize=7)
            ax.set_title("pipeline bubble (fraction of a step)", fontsize=10)
        else:
            values = [j.get("final_val_loss") for j in jobs]
            known = [v for v in values if v is not None]
            ax.scatter([x for x, v in zip(xs, values) if v is not None], known, color="#c44e52", zorder=3)
            spread = (max(known) - min(known)) if known else 0.0
            digits = min(7, max(4, 1 - math.floor(math.log10(spread)))) if spread > 0 else 4
            _bar_labels(ax, [x for x, v in zip(xs, values) if v is not None], known, f".{digits}f")
            if known:
                ax.set_ylim(*loss_axis_limits(known))
            ax.grid(axis="y", alpha=0.3)
            ax.set_title("final validation loss (nats; axis fitted to the values)", fontsize=10)
            ax.ticklabel_format(axis="y", useOffset=False)
        ax.set_xticks(xs, labels, fontsize=7)
        ax.set_xlim(-0.6, len(jobs) - 0.4)
    fig.suptitle(f"lightning_par sweep {title}", fontsize=11)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


class SweepReportCallback(Callback):
    """Hydra callback: write the sweep report into the sweep directory after each job (so a sweep that fails part
    way still has one) and when the sweep ends."""

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        from hydra.types import RunMode

        if config.hydra.get("mode") == RunMode.MULTIRUN:
            write_sweep_report(config.hydra.sweep.dir)

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        md, png = write_sweep_report(config.hydra.sweep.dir)
        print(f"Sweep report: {md}, {md.with_suffix('.csv')}" + (f" and {png}" if png else ""))
