"""Bubble accounting: from timestamps around every forward, backward and communication op to busy/idle per stage.

Within a step, a pipeline rank is *busy* while it runs a forward or a backward and *idle* otherwise (waiting for a
receive, in the fill and drain phases of the pipeline, or for its sends to land). The step's window is common to all
stages: it starts when the stages leave a barrier together and ends when the slowest stage has finished, so a stage
that finishes early is idle until the end. Only durations are compared across ranks, never clock readings, so the
accounting does not need synchronised clocks.

For ``p`` uniform stages and ``m`` micro-batches, the idle share of the window is ``(p - 1) / (m + p - 1)`` (GPipe,
Huang et al. 2019, §2.2), see :func:`~lightning_par.pipeline_parallel.schedules.bubble_formula`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["COMM_KINDS", "COMPUTE_KINDS", "OpEvent", "StepRecord", "StepTimer", "summarize_bubble"]

#: Event kinds: compute (``"F"``, ``"B"``) and communication (``"recv"``: waiting for a tensor; ``"send"``: posting a
#: non-blocking send; ``"send_wait"``: waiting at the end of the step for the sends to complete).
COMPUTE_KINDS = ("F", "B")
COMM_KINDS = ("recv", "send", "send_wait")


@dataclass(frozen=True)
class OpEvent:
    """One timed operation: ``kind`` (see :data:`COMPUTE_KINDS`, :data:`COMM_KINDS`), model chunk, micro-batch, and
    its start and end in seconds of ``time.perf_counter`` on this rank."""

    kind: str
    chunk: int
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
        end: when the last op, including the wait for outstanding sends, finished.
        events: every timed op in order.
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
        """Time in forward and backward."""
        return sum(e.duration for e in self.events if e.kind in COMPUTE_KINDS)

    @property
    def comm_s(self) -> float:
        """Time in communication calls (receive waits, send posts, the final send wait)."""
        return sum(e.duration for e in self.events if e.kind in COMM_KINDS)

    def compact(self) -> tuple[float, float, float, int]:
        """``(span_s, busy_s, comm_s, peak_in_flight)``: what the other stages need to know about this step."""
        return (self.span_s, self.busy_s, self.comm_s, self.peak_in_flight)


class StepTimer:
    """Collects :class:`OpEvent` s of one step; use ``with timer.op("F", chunk, mb): ...``."""

    def __init__(self) -> None:
        self.record = StepRecord(start=time.perf_counter())

    def op(self, kind: str, chunk: int, microbatch: int) -> _Timed:
        return _Timed(self.record.events, kind, chunk, microbatch)

    def finish(self, peak_in_flight: int) -> StepRecord:
        self.record.end = time.perf_counter()
        self.record.peak_in_flight = peak_in_flight
        return self.record


class _Timed:
    __slots__ = ("events", "kind", "chunk", "microbatch", "start")

    def __init__(self, events: list[OpEvent], kind: str, chunk: int, microbatch: int) -> None:
        self.events, self.kind, self.chunk, self.microbatch = events, kind, chunk, microbatch

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.events.append(OpEvent(self.kind, self.chunk, self.microbatch, self.start, time.perf_counter()))


def summarize_bubble(per_stage_steps: list[list[tuple[float, float, float, int]]]) -> dict[str, Any]:
    """Busy and idle time per stage over some steps, on each step's common window.

    Args:
        per_stage_steps: for each pipeline stage (rank on the pp axis), one :meth:`StepRecord.compact` tuple per
            step, the same steps on every stage.

    Returns:
        ``pp_step_window_s``: the steps' windows summed, in seconds (a step's window is the longest span of any stage
        in that step); per-stage lists ``pp_busy_s``, ``pp_idle_s`` (window minus busy) and ``pp_comm_s``, in seconds
        summed over the steps; ``pp_bubble_per_stage`` (idle / window) and their mean ``pp_bubble``; and
        ``pp_peak_microbatches_in_flight``, the largest ``peak_in_flight`` of each stage.

    Raises:
        ValueError: no stage, or stages with different numbers of steps.
    """
    if not per_stage_steps:
        raise ValueError("summarize_bubble needs the steps of at least one stage.")
    n_steps = {len(s) for s in per_stage_steps}
    if len(n_steps) != 1:
        raise ValueError(f"every stage must report the same steps; got step counts {sorted(n_steps)}.")
    windows = [max(stage[i][0] for stage in per_stage_steps) for i in range(n_steps.pop())]
    total_window = sum(windows)
    busy = [sum(step[1] for step in stage) for stage in per_stage_steps]
    comm = [sum(step[2] for step in stage) for stage in per_stage_steps]
    idle = [total_window - b for b in busy]
    bubble = [i / total_window if total_window > 0 else 0.0 for i in idle]
    return {
        "pp_step_window_s": total_window,
        "pp_busy_s": busy,
        "pp_idle_s": idle,
        "pp_comm_s": comm,
        "pp_bubble_per_stage": bubble,
        "pp_bubble": sum(bubble) / len(bubble),
        "pp_peak_microbatches_in_flight": [max((step[3] for step in stage), default=0) for stage in per_stage_steps],
    }
