"""Validate the planner on this machine: run every layout of a world size, compare predicted with measured.

For each world size, :func:`cpu_validation_layouts` lists every ``(dp, tp, pp, dp_mode)`` layout of the model
(1F1B with ``num_microbatches`` micro-batches when pipelined, one micro-batch otherwise; no checkpointing, no sequence
parallelism), :func:`run_layouts` trains each for a few steps with ``recipes/train.py``'s job
(:func:`lightning_par.train.launch_job`, one multi-process world per layout, the overrides of
:func:`~lightning_par.planner.overrides.layout_overrides`) and :func:`compare` sets the planner's prediction for the
job's own config (:func:`~lightning_par.planner.run_config.predict_run`) next to its ``summary.json``:

* **step time**: the median seconds per optimizer step of the slowest rank, vs the predicted step time;
* **model-state bytes**: parameters + gradients + optimizer state of the largest rank, vs the prediction.

:func:`spearman_rho` ranks predicted against measured step times. This module starts processes (through the
training job); the rest of the planner does not.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_par.planner.layouts import AXIS_OPTIONS, DP_MODES, Layout, enumerate_layouts, size_fields
from lightning_par.planner.model import ModelSpec
from lightning_par.planner.overrides import layout_overrides

__all__ = ["compare", "cpu_validation_layouts", "rank", "run_layouts", "spearman_rho"]


def rank(values: Sequence[float]) -> list[float]:
    """Ranks 1..n of ``values`` (ties share their average rank)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman_rho(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation of ``x`` and ``y``: Pearson's correlation of their ranks (ties averaged).

    Raises:
        ValueError: fewer than two pairs, lengths that differ, or a constant sequence.
    """
    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"spearman_rho needs two sequences of the same length >= 2, got {len(x)} and {len(y)}.")
    rx, ry = rank(x), rank(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    vy = math.sqrt(sum((b - my) ** 2 for b in ry))
    if vx == 0 or vy == 0:
        raise ValueError("spearman_rho is undefined for a constant sequence.")
    return cov / (vx * vy)


def cpu_validation_layouts(
    model: ModelSpec, world_size: int, global_batch_size: int, num_microbatches: int = 4,
    dp_modes: Sequence[str] = DP_MODES, **axis_sizes: Sequence[int],
) -> list[Layout]:
    """Every ``(dp, tp, pp, dp_mode)`` layout of ``world_size`` for ``model`` (and with ``cp_sizes``,
    ``dp_replicate_sizes``, ``ep_sizes``, the ``<size>s`` keywords of :func:`~lightning_par.planner.layouts.
    size_fields`, its cp, HSDP and ep layouts, each axis option at its first value: cp's ring): 1F1B over
    ``num_microbatches`` micro-batches when ``pp_size > 1``, one micro-batch per step otherwise; no checkpointing or
    sequence parallelism.

    Raises:
        TypeError: a keyword that is not the ``<size>s`` of a size field.
    """
    plurals = {f"{size}s": size for size in size_fields()}
    unknown = sorted(set(axis_sizes) - set(plurals))
    if unknown:
        raise TypeError(f"cpu_validation_layouts() got unexpected keyword arguments {unknown}: expected axis sizes "
                        f"among {list(plurals)}.")
    layouts = enumerate_layouts(
        model, world_size, global_batch_size, schedules=("1f1b",), checkpointing=("none",),
        num_microbatches=(1, num_microbatches), sequence_parallel=(False,), dp_modes=dp_modes,
        sizes={plurals[k]: v for k, v in axis_sizes.items()},
        **{f"{option.name}s": option.values[:1] for option in AXIS_OPTIONS},
    )
    return [lay for lay in layouts if lay.num_microbatches == (1 if lay.pp_size == 1 else num_microbatches)]


def _conf_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "conf"


def run_layouts(
    layouts: Sequence[Layout],
    out_dir: str | Path,
    base_overrides: Sequence[str] = (),
    num_layers: int | None = None,
    conf_dir: str | Path | None = None,
) -> list[dict[str, Any]]:
    """Train each layout with the main job and return the summaries (``summary.json`` of each run, in order).

    Args:
        layouts: the layouts, run one after another, each in its own world of processes.
        out_dir: each run writes into ``out_dir/<index>_<mesh>_<dp_mode>/``.
        base_overrides: overrides shared by every run (model, data, trainer, ...).
        num_layers: the model's layers (for the explicit pipeline split).
        conf_dir: the Hydra config directory (default: the repository's ``conf/``).

    Returns:
        One summary dict per layout, with ``"run_dir"``, ``"overrides"`` and ``"wall_s"`` added; a run that failed
        has ``"error"`` instead of measurements.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import lightning_par  # noqa: F401  (registers the strategies)
    from lightning_par.config.schema import register_configs
    from lightning_par.train import launch_job

    conf = Path(conf_dir or _conf_dir()).resolve()
    options = {p.stem for p in (conf / "parallel").glob("*.yaml")}
    register_configs()
    out = Path(out_dir)
    results = []
    for i, layout in enumerate(layouts):
        overrides = layout_overrides(layout, options, num_layers) + list(base_overrides)
        run_dir = out / f"{i:02d}_{layout.mesh.replace('·', '_')}_{layout.dp_mode}"
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(conf), version_base=None):
            cfg = compose(config_name="config", overrides=overrides)
        start = time.perf_counter()
        try:
            summary = dict(launch_job(cfg, run_dir) or {})
        except Exception as err:  # a failed layout is reported, not fatal to the sweep
            summary = {"error": f"{type(err).__name__}: {str(err)[:500]}"}
        summary.update(run_dir=str(run_dir), overrides=overrides, wall_s=time.perf_counter() - start)
        print(f"[{i + 1}/{len(layouts)}] {layout.describe()}: step {summary.get('step_time_s')} s, "
              f"wall {summary['wall_s']:.1f} s, load {os.getloadavg()[0]:.1f}", flush=True)
        results.append(summary)
    GlobalHydra.instance().clear()
    return results


def measured_state_bytes(summary: dict[str, Any]) -> int | None:
    """Parameters + gradients + optimizer state of the largest rank, from a run summary."""
    per_rank = zip(summary.get("param_bytes") or [], summary.get("grad_bytes") or [],
                   summary.get("optimizer_state_bytes") or [])
    totals = [sum(v or 0 for v in r) for r in per_rank]
    return max(totals) if totals else None


def compare(summaries: Sequence[dict[str, Any]], device: Any) -> list[dict[str, Any]]:
    """Predicted next to measured for each run summary.

    Args:
        summaries: run summaries holding their composed ``"config"`` (as ``summary.json`` does).
        device: the device spec to predict with (e.g. the calibrated CPU).

    Returns:
        One row per summary: ``layout``, ``measured_step_s``, ``predicted_step_s``, ``step_ratio`` (predicted /
        measured), ``measured_state_bytes``, ``predicted_state_bytes``, ``state_ratio``, and the prediction's
        breakdown (``compute_s``, ``comm_s``, ``bubble_s``, ...).
    """
    from lightning_par.planner.run_config import predict_run

    rows = []
    for s in summaries:
        if "error" in s or "config" not in s:
            rows.append({"layout": s.get("overrides"), "error": s.get("error", "no config in summary")})
            continue
        pred = predict_run(s["config"], device=device)
        measured_state = measured_state_bytes(s)
        row = {
            "layout": pred["layout"],
            "measured_step_s": s.get("step_time_s"),
            "predicted_step_s": pred["step_time_s"],
            "measured_state_bytes": measured_state,
            "predicted_state_bytes": pred["model_state_bytes"],
            **{k: v for k, v in pred.items() if k.endswith("_s") and k != "step_time_s"},
        }
        row["step_ratio"] = row["predicted_step_s"] / row["measured_step_s"] if row["measured_step_s"] else None
        row["state_ratio"] = (row["predicted_state_bytes"] / measured_state) if measured_state else None
        rows.append(row)
    return rows


def save_json(path: str | Path, data: Any) -> None:
    """Write ``data`` as indented JSON (parents created)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2, default=str) + "\n")
