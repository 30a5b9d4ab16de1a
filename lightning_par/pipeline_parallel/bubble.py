"""Bubble accounting: from timestamps around every forward and backward computation to busy/idle time per stage.

The pipeline engine (:mod:`~lightning_par.pipeline_parallel.engine`) wraps the compute calls torch's schedule makes
on each ``PipelineStage`` (forward of one micro-batch, its full backward, or the input- and weight-gradient halves of a
split backward) and records them here. Within a step a pipeline rank is *busy* while it computes and *idle* otherwise:
waiting for a receive, in the fill and drain phases, or for its sends. The step's window is common to all stages: it
starts when the stages leave a barrier together and ends when the slowest stage has finished, so a stage that
finishes early is idle until the end. Only durations are compared across ranks, never clock readings, so the
accounting needs no synchronised clocks.

For ``p`` uniform stages and ``m`` micro-batches the idle share of the window is ``(p - 1) / (m + p - 1)`` for GPipe
and 1F1B (Huang et al. 2019, §2.2), see :func:`~lightning_par.pipeline_parallel.schedules.bubble_formula`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_par.compat import profiler_enabled

__all__ = ["COMPUTE_KINDS", "OpEvent", "StepRecord", "StepTimer", "summarize_bubble"]

#: Computation kinds: ``"F"`` forward, ``"B"`` full backward, ``"I"`` input-gradient half and ``"W"`` weight-gradient
#: half of a split backward (zero-bubble schedules, Qi et al. 2024, §2), ``"L"`` the loss on the last stage.
COMPUTE_KINDS: tuple[str, ...] = ("F", "B", "I", "W", "L")


@dataclass(frozen=True)
class OpEvent:
    """One timed computation: ``kind`` (see :data:`COMPUTE_KINDS`), virtual stage, micro-batch, and its start and end
    in seconds of ``time.perf_counter`` on this rank."""

    kind: str
    stage: int
    microbatch: int
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class StepRecord:
    """Timings of one step on one rank, in seconds.

    Attributes:
        start: when the schedule started (after the barrier).
        end: when the schedule returned.
        events: every timed computation in order.
        peak_in_flight: most micro-batches whose activations were held at once (forward run, backward not yet).
    """

    start: float
    end: float = 0.0
    events: list[OpEvent] = field(default_factory=list)
    peak_in_flight: int = 0

    @property
    def span_s(self) -> float:
        """This rank's own time in the schedule."""
        return self.end - self.start

    @property
    def busy_s(self) -> float:
        """Time computing (forwards, backwards, the loss)."""
        return sum(e.duration for e in self.events if e.kind in COMPUTE_KINDS)

    def compact(self) -> tuple[float, float, int]:
        """``(span_s, busy_s, peak_in_flight)``: what the other stages need to know about this step."""
        return (self.span_s, self.busy_s, self.peak_in_flight)


class StepTimer:
    """Collects :class:`OpEvent` s of one step; ``with timer.op("F", stage, mb): ...`` times one computation and
    tracks the micro-batches in flight (``F`` adds one, ``B``/``I`` remove one)."""

    def __init__(self) -> None:
        self.record = StepRecord(start=time.perf_counter())
        self._held = 0

    def op(self, kind: str, stage: int, microbatch: int) -> _Timed:
        if kind == "F":
            self._held += 1
            self.record.peak_in_flight = max(self.record.peak_in_flight, self._held)
        elif kind in ("B", "I"):
            self._held -= 1
        return _Timed(self.record.events, kind, stage, microbatch)

    def finish(self) -> StepRecord:
        self.record.end = time.perf_counter()
        return self.record


class _Timed:
    """Times one computation; while ``torch.profiler`` records, also marks it in the trace
    (:func:`lightning_par.profiling.trace.pipeline_annotation`), which the per-rank timeline draws."""

    __slots__ = ("events", "kind", "stage", "microbatch", "start", "range")

    def __init__(self, events: list[OpEvent], kind: str, stage: int, microbatch: int) -> None:
        self.events, self.kind, self.stage, self.microbatch = events, kind, stage, microbatch
        self.range: Any = None

    def __enter__(self) -> None:
        if profiler_enabled():  # a profiler is recording (cheap)
            from lightning_par.profiling.trace import pipeline_annotation

            self.range = torch.profiler.record_function(pipeline_annotation(self.kind, self.stage, self.microbatch))
            self.range.__enter__()
        self.start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.events.append(OpEvent(self.kind, self.stage, self.microbatch, self.start, time.perf_counter()))
        if self.range is not None:
            self.range.__exit__(*exc)
            self.range = None


def summarize_bubble(per_stage_steps: list[list[tuple[float, float, int]]]) -> dict[str, Any]:
    """Busy and idle time per pipeline rank over some steps, on each step's common window.

    Args:
        per_stage_steps: for each pipeline rank, one :meth:`StepRecord.compact` tuple per step, the same steps on every
            rank.

    Returns:
        ``pp_step_window_s``: the steps' windows summed, in seconds (a step's window is the longest span of any rank
        in that step); per-rank lists ``pp_busy_s`` and ``pp_idle_s`` (window minus busy), in seconds summed over the
        steps; ``pp_bubble_per_stage`` (idle / window) and their mean ``pp_bubble``; and
        ``pp_peak_microbatches_in_flight``, the largest ``peak_in_flight`` of each rank.

    Raises:
        ValueError: no rank, or ranks with different numbers of steps.
    """
    if not per_stage_steps:
        raise ValueError("summarize_bubble needs the steps of at least one stage.")
    n_steps = {len(s) for s in per_stage_steps}
    if len(n_steps) != 1:
        raise ValueError(f"every stage must report the same steps; got step counts {sorted(n_steps)}.")
    windows = [max(stage[i][0] for stage in per_stage_steps) for i in range(n_steps.pop())]
    total_window = sum(windows)
    busy = [sum(step[1] for step in stage) for stage in per_stage_steps]
    idle = [total_window - b for b in busy]
    bubble = [i / total_window if total_window > 0 else 0.0 for i in idle]
    return {
        "pp_step_window_s": total_window,
        "pp_busy_s": busy,
        "pp_idle_s": idle,
        "pp_bubble_per_stage": bubble,
        "pp_bubble": sum(bubble) / len(bubble),
        "pp_peak_microbatches_in_flight": [max((step[2] for step in stage), default=0) for stage in per_stage_steps],
    }
