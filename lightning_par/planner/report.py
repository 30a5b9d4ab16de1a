"""Tables of predictions: rows of plain values, a fixed-width text table, markdown and CSV.

The columns of context parallelism, HSDP and expert parallelism (:data:`OPTIONAL_COLUMNS`) are in every row and CSV;
the text and markdown tables show them only when some layout of the predictions given uses the axis.

Pure Python: no torch import.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_par.planner.layouts import AXIS_OPTIONS, comm_axes, comm_axis, size_fields
from lightning_par.planner.plan import Prediction

__all__ = ["COLUMNS", "OPTIONAL_COLUMNS", "format_table", "to_csv", "to_markdown", "to_rows"]

_GiB = 1 << 30

#: Headers of the size fields whose header is not their axis's name.
_SIZE_HEADERS: dict[str, str] = {"dp_replicate_size": "rep"}


def _axis_columns() -> dict[str, str]:
    """The columns of the axes added on the registry (:func:`~lightning_par.planner.layouts.size_fields`), in
    :class:`~lightning_par.planner.layouts.Layout` order: each size, then its options
    (:data:`~lightning_par.planner.layouts.AXIS_OPTIONS`): ``cp``, ``cp method``, ``rep``, ``ep``."""
    out = {}
    for size in size_fields():
        out[size] = _SIZE_HEADERS.get(size, size.removesuffix("_size"))
        out.update({option.name: option.header for option in AXIS_OPTIONS if option.size == size})
    return out


#: ``<axis>_comm_s`` of the axes added on the registry that communicate on their own (``cp``, ``ep``; HSDP's is the
#: dp axis's), after ``dp_comm_s`` and ``tp_comm_s``.
_COMM_COLUMNS: dict[str, str] = {f"{axis}_comm_s": f"{axis} comm s" for axis in comm_axes()}

#: Column key -> header, in table order.
COLUMNS: dict[str, str] = {
    "rank": "#",
    "dp_size": "dp",
    "tp_size": "tp",
    "pp_size": "pp",
    **_axis_columns(),
    "dp_mode": "dp mode",
    "schedule": "schedule",
    "num_microbatches": "m",
    "micro_batch_size": "b",
    "activation_checkpointing": "ckpt",
    "sequence_parallel": "sp",
    "memory_gib": "GiB/dev",
    "state_gib": "state GiB",
    "activation_gib": "act GiB",
    "fits": "fits",
    "step_time_s": "step s",
    "tokens_per_s": "tokens/s",
    "mfu": "MFU",
    "bubble": "bubble",
    "dp_comm_s": "dp comm s",
    "tp_comm_s": "tp comm s",
    **_COMM_COLUMNS,
    "reason": "why not / notes",
}
#: Columns shown only when some layout uses their axis: the layout field that says so -> its columns (its size, its
#: options, its communication), e.g. ``"cp_size": ("cp_size", "cp_method", "cp_comm_s")``.
OPTIONAL_COLUMNS: dict[str, tuple[str, ...]] = {
    size: (size, *(o.name for o in AXIS_OPTIONS if o.size == size),
           *([f"{comm_axis(size)}_comm_s"] if comm_axis(size) in comm_axes() else []))
    for size in size_fields()
}


def to_rows(predictions: Sequence[Prediction]) -> list[dict[str, Any]]:
    """One dict of plain values per prediction, keyed by :data:`COLUMNS` (bytes in GiB, times in seconds)."""
    rows = []
    for i, p in enumerate(predictions, 1):
        lay = p.layout
        schedule = lay.schedule if lay.virtual_stages == 1 else f"{lay.schedule}(v={lay.virtual_stages})"
        options = {o.name: getattr(lay, o.name) if getattr(lay, o.size) > 1 else "" for o in AXIS_OPTIONS}
        rows.append({
            "rank": i,
            "dp_size": lay.dp_size,
            "tp_size": lay.tp_size,
            "pp_size": lay.pp_size,
            **{key: options[key] if key in options else getattr(lay, key) for key in _axis_columns()},
            "dp_mode": lay.dp_mode,
            "schedule": schedule,
            "num_microbatches": lay.num_microbatches,
            "micro_batch_size": lay.micro_batch_size,
            "activation_checkpointing": lay.activation_checkpointing,
            "sequence_parallel": lay.sequence_parallel,
            "memory_gib": p.bytes_per_device / _GiB,
            "state_gib": p.memory.model_state_bytes / _GiB,
            "activation_gib": p.memory.activation_bytes / _GiB,
            "fits": p.fits,
            "step_time_s": p.step_time_s,
            "tokens_per_s": p.tokens_per_s,
            "mfu": p.mfu,
            "bubble": p.bubble,
            "dp_comm_s": p.time.dp_comm_s,
            "tp_comm_s": p.time.tp_comm_s,
            **{key: getattr(p.time, key) for key in _COMM_COLUMNS},
            "reason": p.reason or "; ".join(p.notes),
        })
    return rows


def _fmt(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if key in ("mfu", "bubble"):
            return f"{100 * value:.1f}%"
        if key == "tokens_per_s":
            return f"{value:,.0f}"
        if key.endswith("_s"):
            return f"{value:.4g}"
        return f"{value:.2f}"
    return str(value)


def _cells(predictions: Sequence[Prediction], top: int | None) -> tuple[list[str], list[list[str]]]:
    shown = predictions[:top] if top else predictions
    rows = to_rows(shown)
    hidden = {c for size, cols in OPTIONAL_COLUMNS.items()  # unless some layout planned, shown or not, uses the axis
              if not any(getattr(p.layout, size) > 1 for p in predictions) for c in cols}
    keys = [k for k in COLUMNS if k not in hidden]
    headers = [COLUMNS[k] for k in keys]
    return headers, [[_fmt(k, r[k]) for k in keys] for r in rows]


def format_table(predictions: Sequence[Prediction], top: int | None = None) -> str:
    """A fixed-width text table of the first ``top`` predictions (all if None)."""
    headers, body = _cells(predictions, top)
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in body])


def to_markdown(predictions: Sequence[Prediction], top: int | None = None) -> str:
    """A markdown table of the first ``top`` predictions (all if None)."""
    headers, body = _cells(predictions, top)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in body]
    return "\n".join(lines) + "\n"


def to_csv(predictions: Sequence[Prediction], path: str | Path) -> Path:
    """Write every prediction as a CSV row (raw values, columns keyed as :data:`COLUMNS`); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(COLUMNS))
        writer.writeheader()
        writer.writerows(to_rows(predictions))
    return path
