"""A per-rank timeline of a few training steps: a Chrome trace per rank and one PNG with a lane per rank.

For any strategy (and Lightning's own), :class:`TimelineCallback` records a few optimizer steps with
``torch.profiler`` on every rank, marks their parts with ``record_function`` ranges (``lp::step``, ``lp::forward``,
``lp::backward``, ``lp::optimizer``; under pipelining ``lp::schedule``, inside which the pipeline engine marks every
forward, backward and loss call of the schedule), writes each rank's trace (open it in Perfetto or
``chrome://tracing``), reads the traces back (:mod:`lightning_par.profiling.trace`), and draws one PNG
(:mod:`lightning_par.profiling.draw`): compute, communication per collective, and idle time, per rank, on one time
axis. So a user sees the pipeline bubble, and whether the gradient all-reduce overlaps backward, with their own eyes.

Profiling slows the recorded steps down (one trace event per operator): record a few steps, not a run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn

from lightning_par.profiling.draw import draw_timeline
from lightning_par.profiling.trace import ANNOTATIONS, RankTimeline, align_timelines, read_trace, timeline_figures
from lightning_par.validation import check_int

__all__ = ["TimelineCallback"]


class TimelineCallback(L.Callback):
    """Profile ``num_steps`` optimizer steps from ``start_step`` on every rank; write ``rank<r>.json`` (Chrome trace)
    per rank, and on rank 0 ``timeline.png`` and ``timeline.json`` (every rank's segments and the figures) into
    ``dirpath``.

    Just before the first recorded step every rank leaves a barrier (``lp::align``): the lanes of one host share its
    clock; ranks on hosts with different clocks are aligned on the barrier's end. The figures
    (:func:`lightning_par.profiling.trace.timeline_figures`:
    compute, idle and communication seconds per rank, the share of communication hidden behind compute, and under
    pipelining each rank's idle share of the schedule) are in :meth:`summary_extras`, which
    :class:`~lightning_par.callbacks.RunSummaryCallback` writes into ``summary.json``.

    Args:
        dirpath: output directory (created).
        start_step: the optimizer step (0-based) the recording starts at; later steps skip one-off costs (the
            pipeline builds its schedule in step 0). Moved earlier when the run has fewer steps
            (``trainer.max_steps``).
        num_steps: optimizer steps to record (each with all its gradient-accumulation micro-batches).
        record_shapes: record operator input shapes in the traces (bigger files).
        with_stack: record Python stacks in the traces (much bigger files, slower).
        draw: write the PNG (rank 0).

    Raises:
        ValueError: ``start_step < 0`` or ``num_steps < 1``.
    """

    def __init__(
        self,
        dirpath: str | Path,
        start_step: int = 2,
        num_steps: int = 2,
        record_shapes: bool = False,
        with_stack: bool = False,
        draw: bool = True,
    ) -> None:
        check_int("start_step", start_step, 0)
        check_int("num_steps", num_steps, 1)
        self.dirpath = Path(dirpath)
        self.start_step = start_step
        self.num_steps = num_steps
        self.record_shapes = bool(record_shapes)
        self.with_stack = bool(with_stack)
        self.draw = bool(draw)
        self.png_path: Path | None = None
        self.trace_path: Path | None = None
        self.timelines: list[RankTimeline] = []
        self.figures: dict[str, Any] = {}
        self._profiler: Any = None
        self._ranges: list[tuple[str, Any]] = []
        self._start = start_step
        self._recorded = 0
        self._done = False
        self._pipelined = False
        self._step_open_at = -1

    # ------------------------------------------------------------------ ranges
    def _open(self, key: str) -> None:
        rf = torch.profiler.record_function(ANNOTATIONS[key])
        rf.__enter__()
        self._ranges.append((key, rf))

    def _close(self, key: str) -> None:
        """Close ``key`` (and any range opened inside it) if it is open."""
        if not any(k == key for k, _ in self._ranges):
            return
        while self._ranges:
            k, rf = self._ranges.pop()
            rf.__exit__(None, None, None)
            if k == key:
                return

    def _close_inner(self) -> None:
        """Close every range but the step."""
        while self._ranges and self._ranges[-1][0] != "step":
            self._ranges.pop()[1].__exit__(None, None, None)

    @property
    def active(self) -> bool:
        """Whether the profiler is recording now."""
        return self._profiler is not None

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        dims = getattr(trainer.strategy, "parallel_dims", None)
        self._pipelined = bool(dims is not None and dims.pp_enabled)
        max_steps = trainer.max_steps
        self._start = self.start_step
        if max_steps is not None and max_steps > 0:
            self._start = min(self.start_step, max(0, max_steps - self.num_steps))
        self._start = max(self._start, trainer.global_step)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._done:
            return
        first_of_step = batch_idx % trainer.accumulate_grad_batches == 0
        if not self.active and first_of_step and trainer.global_step >= self._start:
            self._begin(trainer)
        if not self.active:
            return
        if self._step_open_at != trainer.global_step:
            self._open("step")
            self._step_open_at = trainer.global_step
        self._open("schedule" if self._pipelined else "forward")

    def on_before_zero_grad(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self.active:
            self._close("forward")

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self.active:
            self._close_inner()
            if not self._pipelined:  # under pipelining the schedule ran backward; what follows is the dp reduction
                self._open("backward")

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.active:
            self._close("backward")

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self.active:
            self._close_inner()
            self._open("optimizer")

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.active:
            return
        self._close_inner()
        if trainer.global_step != self._step_open_at:  # the optimizer stepped: the step is over
            self._close("step")
            self._step_open_at = -1
            self._recorded += 1
            if self._recorded >= self.num_steps:
                self._finish(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.active:
            self._close("step")
            self._finish(trainer)
        elif not self._done:
            rank_zero_warn(
                f"TimelineCallback recorded nothing: the run ended before optimizer step {self._start}. Lower "
                f"start_step or train longer."
            )

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if self.active:
            while self._ranges:
                self._ranges.pop()[1].__exit__(None, None, None)
            self._profiler.stop()
            self._profiler = None

    # ------------------------------------------------------------------ recording
    def _begin(self, trainer: L.Trainer) -> None:
        from torch.profiler import ProfilerActivity, profile

        cuda = trainer.strategy.root_device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self._profiler = profile(activities=activities, record_shapes=self.record_shapes, with_stack=self.with_stack)
        self._profiler.start()
        if cuda:
            torch.cuda.synchronize()
        with torch.profiler.record_function(ANNOTATIONS["align"]):
            if dist.is_available() and dist.is_initialized():
                dist.barrier()

    def _finish(self, trainer: L.Trainer) -> None:
        while self._ranges:
            self._ranges.pop()[1].__exit__(None, None, None)
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        self._done = True
        rank = trainer.global_rank
        self.dirpath.mkdir(parents=True, exist_ok=True)
        self.trace_path = self.dirpath / f"rank{rank}.json"
        profiler.export_chrome_trace(str(self.trace_path))
        mine = read_trace(self.trace_path, rank).to_dict()
        if dist.is_available() and dist.is_initialized():
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        self.timelines = align_timelines([RankTimeline.from_dict(d) for d in gathered])
        self.figures = timeline_figures(self.timelines)
        if rank != 0:
            return
        labels = _lane_labels(trainer, len(self.timelines))
        (self.dirpath / "timeline.json").write_text(
            json.dumps({"figures": self.figures, "lanes": labels, "timelines": [t.to_dict() for t in self.timelines]},
                       indent=1) + "\n"
        )
        if self.draw:
            self.png_path = draw_timeline(self.timelines, self.dirpath / "timeline.png", _title(trainer, self), labels)

    def summary_extras(self) -> dict[str, Any]:
        """``timeline_dir``, ``timeline_png`` (rank 0, when drawn) and the figures (see the class docstring); empty
        before the recording ends."""
        if not self._done:
            return {}
        return {"timeline_dir": str(self.dirpath), "timeline_png": str(self.png_path) if self.png_path else None,
                **self.figures}


def _lane_labels(trainer: L.Trainer, world: int) -> list[str]:
    dims = getattr(trainer.strategy, "parallel_dims", None)
    if dims is None:
        return [f"rank {r}" for r in range(world)]
    labels = []
    for r in range(world):
        c = dims.coordinates(r)
        labels.append(f"rank {r}\npp{c['pp']} dp{c['dp']} tp{c['tp']}")
    return labels


def _title(trainer: L.Trainer, callback: TimelineCallback) -> str:
    strategy = trainer.strategy
    name = getattr(strategy, "strategy_name", None) or type(strategy).__name__
    dims = getattr(strategy, "parallel_dims", None)
    layout = f" dp{dims.dp_size}·tp{dims.tp_size}·pp{dims.pp_size}" if dims is not None else ""
    options = getattr(strategy, "options", None)
    if dims is not None and dims.pp_enabled and options is not None:
        pipe = options.pipeline
        layout += f", {pipe.schedule}, {pipe.num_microbatches} micro-batches"
    first = callback._start
    return f"{name}{layout}: optimizer steps {first}-{first + callback._recorded - 1}, {trainer.precision}"
