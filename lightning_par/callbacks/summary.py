"""One JSON file per run: layout, losses, throughput, MFU and per-rank memory."""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from lightning_par.callbacks.metrics import ParallelMetricsCallback, parallel_sizes

__all__ = ["PER_RANK_KEYS", "RunSummaryCallback", "build_summary"]

#: Fields of :meth:`ParallelMetricsCallback.summary` reported as one list entry per rank.
PER_RANK_KEYS: tuple[str, ...] = (
    "peak_memory_bytes",
    "step_peak_bytes",
    "step_model_state_bytes",
    "step_other_bytes",
    "param_bytes",
    "grad_bytes",
    "optimizer_state_bytes",
    "trainable_param_bytes",
    "frozen_param_bytes",
    "tokens_per_s",
    "step_time_s",
)
_LOSS_KEYS: tuple[str, ...] = ("initial_train_loss", "final_train_loss", "final_val_loss")


def _first_known(per_rank: list[dict[str, Any]], key: str) -> Any:
    """Rank 0's value of ``key``, or the first rank's that is not ``None`` (e.g. the loss lives on the last
    pipeline stage)."""
    return next((r.get(key) for r in per_rank if r.get(key) is not None), None)


def build_summary(per_rank: list[dict[str, Any]], common: dict[str, Any]) -> dict[str, Any]:
    """Merge the per-rank measurements and the run-wide fields into one summary dict.

    Args:
        per_rank: one dict per rank, in rank order, each :meth:`ParallelMetricsCallback.summary` plus optional
            ``initial_train_loss``, ``final_train_loss`` and ``final_val_loss``.
        common: run-wide fields (``strategy``, ``world_size``, ``dp_size``, ``tp_size``, ``pp_size``, ``steps``, ...)
            together with any extras (the strategy's ``summary_extras()``, the user's ``extra``): all copied as is.

    Returns:
        ``common``, then

        * ``tokens_seen``: the maximum over ranks (every rank counts global tokens);
        * ``tokens_per_s`` and ``mfu``: the minimum over ranks, ``step_time_s``: the maximum (the slowest rank sets
          the pace of a synchronous step);
        * ``mfu_note``: the first rank's note;
        * each loss: rank 0's, else the first rank's that is known;
        * per-rank lists ``peak_memory_bytes``, ``step_peak_bytes``, ``step_model_state_bytes``,
          ``step_other_bytes``, ``param_bytes``, ``grad_bytes``, ``optimizer_state_bytes``,
          ``trainable_param_bytes``, ``frozen_param_bytes``, ``tokens_per_s_per_rank`` and ``step_time_s_per_rank``.

        Computed fields win over a key of ``common`` with the same name (a ``UserWarning`` names it).

    Raises:
        ValueError: ``per_rank`` is empty.
    """
    if not per_rank:
        raise ValueError("build_summary needs at least one rank's summary.")

    def known(key: str) -> list[Any]:
        return [r[key] for r in per_rank if r.get(key) is not None]

    tokens_per_s, step_time, mfu = known("tokens_per_s"), known("step_time_s"), known("mfu")
    computed: dict[str, Any] = {
        "tokens_seen": max(known("tokens_seen"), default=0),
        "tokens_per_s": min(tokens_per_s) if tokens_per_s else None,
        "step_time_s": max(step_time) if step_time else None,
        "mfu": min(mfu) if mfu else None,
        "mfu_note": per_rank[0].get("mfu_note"),
        **{key: _first_known(per_rank, key) for key in _LOSS_KEYS if key not in common or common[key] is None},
    }
    for key in PER_RANK_KEYS:
        name = f"{key}_per_rank" if key in ("tokens_per_s", "step_time_s") else key
        computed[name] = [r.get(key) for r in per_rank]
    clashes = sorted(set(common) & set(computed) - set(_LOSS_KEYS))
    if clashes:
        warnings.warn(f"build_summary: extra keys {clashes} clash with computed fields and are overridden.")
    return {**common, **computed}


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, Path):
        return str(value)
    return repr(value)


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to a temporary file beside ``path`` then ``os.replace`` it, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, default=_json_default)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _metric(trainer: L.Trainer, *names: str) -> float | None:
    """The first of ``names`` in ``trainer.callback_metrics``, as a float."""
    metrics = trainer.callback_metrics
    for name in names:
        if name in metrics:
            return float(metrics[name])
    return None


class RunSummaryCallback(L.Callback):
    """Write a JSON summary of the run to ``path`` at the end of ``fit``.

    Records the first and last logged ``train_loss`` (``train_loss_step`` when it is logged on step and epoch), the
    last ``val_loss`` outside the sanity check and ``trainer.global_step``. In ``on_fit_end`` (every rank) it gathers
    every rank's ``metrics.summary()`` and losses with ``torch.distributed.all_gather_object`` when the default
    process group is initialised, calls ``trainer.strategy.summary_extras()`` if the strategy defines it (on every
    rank, so it may run collectives; rank 0's dict is used), and rank 0 writes :func:`build_summary`'s result
    atomically. Keys: ``strategy`` (``strategy_name`` if the strategy has one, else its class name), ``world_size``,
    ``dp_size``, ``tp_size``, ``pp_size``, ``steps``, ``tokens_seen``, ``initial_train_loss``, ``final_train_loss``,
    ``final_val_loss``, ``tokens_per_s``, ``step_time_s``, ``mfu``, ``mfu_note``, per-rank lists, then the strategy's
    extras and ``extra``.

    Args:
        path: where to write the JSON file; parent directories are created.
        metrics: the :class:`ParallelMetricsCallback` of the same Trainer.
        extra: more fields to record (e.g. the config); values that JSON cannot hold are written as ``repr``.
        sources: more objects with a ``summary_extras() -> dict`` method (other callbacks: the timeline, the
            learning-rate scaling), called in ``on_fit_end`` on every rank; rank 0's fields are written.
    """

    def __init__(self, path: str | Path, metrics: ParallelMetricsCallback, extra: dict[str, Any] | None = None,
                 sources: Sequence[Any] = ()) -> None:
        self.path = Path(path)
        self.metrics = metrics
        self.extra = dict(extra or {})
        self.sources = list(sources)
        self.initial_train_loss: float | None = None
        self.final_train_loss: float | None = None
        self.final_val_loss: float | None = None
        self.last_summary: dict[str, Any] | None = None

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = _metric(trainer, "train_loss", "train_loss_step")
        if loss is None:
            return
        if self.initial_train_loss is None:
            self.initial_train_loss = loss
        self.final_train_loss = loss

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            loss = _metric(trainer, "val_loss", "val_loss_epoch")
            if loss is not None:
                self.final_val_loss = loss

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        local = {
            **self.metrics.summary(),
            "initial_train_loss": self.initial_train_loss,
            "final_train_loss": self.final_train_loss,
            "final_val_loss": self.final_val_loss,
        }
        summary_extras = getattr(trainer.strategy, "summary_extras", None)
        strategy_extras = dict(summary_extras()) if callable(summary_extras) else {}
        for source in self.sources:
            strategy_extras.update(source.summary_extras())
        if dist.is_available() and dist.is_initialized():
            per_rank: list[dict[str, Any]] = [{} for _ in range(dist.get_world_size())]
            dist.all_gather_object(per_rank, local)
        else:
            per_rank = [local]
        if trainer.global_rank != 0:
            return
        strategy = trainer.strategy
        common = {
            "strategy": getattr(strategy, "strategy_name", None) or type(strategy).__name__,
            **parallel_sizes(trainer),
            "steps": trainer.global_step,
            **strategy_extras,
            **self.extra,
        }
        self.last_summary = build_summary(per_rank, common)
        _write_json_atomic(self.path, self.last_summary)
