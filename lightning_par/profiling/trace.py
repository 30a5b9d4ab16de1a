"""A rank's profiled steps as lanes of segments, read from the Chrome trace ``torch.profiler`` wrote.

The :class:`~lightning_par.callbacks.timeline.TimelineCallback` marks each profiled optimizer step with
``torch.profiler.record_function`` ranges named ``lp::...`` (:data:`ANNOTATIONS`), and the pipeline engine marks every
compute call of the schedule (``lp::pp:F s0 mb1``: kind, virtual stage, micro-batch; see
:mod:`lightning_par.pipeline_parallel.bubble`). :func:`read_trace` turns one rank's trace into a
:class:`RankTimeline`:

* **compute** segments: ``forward``, ``backward``, ``optimizer`` from the ``lp::`` ranges, or, inside a pipelined step,
  the schedule's own ``F``/``B``/``I``/``W``/``L`` calls (the ``lp::schedule`` range around them is only a container);
* **communication** segments, one per collective as the backend ran it: gloo's ``gloo:<collective>`` ranges (recorded
  on gloo's worker threads, from when the collective starts executing until it completes), or on a GPU the NCCL
  kernels on the device timeline (``ncclDevKernel_AllReduce...``); the name is normalised to ``all_reduce``,
  ``all_gather``, ``reduce_scatter``, ``broadcast``, ``send``, ``recv``, ``barrier``, ``all_to_all``;
* **steps**: the ``lp::step`` windows; *idle* time is a window minus the union of its compute segments (waiting for a
  peer, a receive, the pipeline's fill and drain: the bubble, or communication not hidden behind compute).

Times are seconds from the end of the ``lp::align`` barrier the callback runs on every rank just before the first
profiled step. :func:`align_timelines` then puts the ranks of one host on that host's clock (the traces' absolute
timestamps), which is exact; ranks on different hosts stay aligned on the barrier, to within its exit skew.
On a GPU, compute comes from the ``gpu_user_annotation`` copies of the same ranges (the device's timeline, not the
host's launch times); this path is written for CUDA traces but has not been run on a GPU here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "ANNOTATIONS",
    "COLLECTIVES",
    "COMPUTE_KINDS",
    "RankTimeline",
    "Segment",
    "align_timelines",
    "collective_name",
    "pipeline_annotation",
    "read_trace",
    "timeline_figures",
    "union_length",
]

#: ``record_function`` names the timeline callback emits: one optimizer step; its forward, backward and optimizer
#: parts; a pipelined step's schedule run (a container of the schedule's own calls); the barrier lanes align on.
ANNOTATIONS: dict[str, str] = {
    "step": "lp::step",
    "forward": "lp::forward",
    "backward": "lp::backward",
    "optimizer": "lp::optimizer",
    "schedule": "lp::schedule",
    "align": "lp::align",
}
_PIPELINE_PREFIX = "lp::pp:"
#: Pipeline compute kinds (:data:`lightning_par.pipeline_parallel.bubble.COMPUTE_KINDS`) -> segment kind.
_PIPELINE_KINDS = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight", "L": "loss"}
#: Compute segment kinds, in drawing order.
COMPUTE_KINDS: tuple[str, ...] = ("forward", "loss", "backward", "backward_input", "backward_weight", "optimizer")
#: Normalised collective names, in legend order.
COLLECTIVES: tuple[str, ...] = (
    "all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send", "recv", "barrier", "other",
)
_COLLECTIVE_PATTERNS: tuple[tuple[str, str], ...] = (
    ("reduce_scatter", r"reduce_?scatter"),
    ("all_reduce", r"all_?reduce"),
    ("all_gather", r"all_?gather"),
    ("all_to_all", r"all_?to_?all"),
    ("broadcast", r"broadcast"),
    ("barrier", r"barrier"),
    ("recv", r"recv"),
    ("send", r"send"),
)


def pipeline_annotation(kind: str, stage: int, microbatch: int) -> str:
    """The ``record_function`` name of one pipeline compute call (``"lp::pp:F s0 mb1"``)."""
    return f"{_PIPELINE_PREFIX}{kind} s{stage} mb{microbatch}"


def collective_name(event_name: str) -> str:
    """The normalised collective of a backend event name (``"gloo:all_reduce"`` -> ``"all_reduce"``,
    ``"ncclDevKernel_ReduceScatter_Sum_f32_RING_LL"`` -> ``"reduce_scatter"``); ``"other"`` when unknown."""
    name = event_name.split(":", 1)[1] if ":" in event_name else event_name
    lowered = re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()  # ReduceScatter -> reduce_scatter
    for collective, pattern in _COLLECTIVE_PATTERNS:
        if re.search(pattern, lowered):
            return collective
    return "other"


@dataclass(frozen=True)
class Segment:
    """A span of one lane, in seconds from the alignment point.

    Attributes:
        row: ``"compute"`` or ``"comm"``.
        kind: a :data:`COMPUTE_KINDS` entry, or a :data:`COLLECTIVES` entry.
        start: start, in seconds.
        end: end, in seconds.
        label: a short text for the picture (``"F1"``: forward of micro-batch 1), may be empty.
    """

    row: str
    kind: str
    start: float
    end: float
    label: str = ""

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class RankTimeline:
    """One rank's profiled steps (see the module docstring).

    Attributes:
        rank: the global rank.
        steps: ``(start, end)`` of each profiled optimizer step, in seconds.
        schedules: ``(start, end)`` of each pipelined step's schedule run (empty without pipelining).
        segments: compute and communication segments, sorted by start.
        source: the trace file it was read from.
        device: ``"cpu"`` or ``"cuda"`` (which timeline the compute segments come from).
        host: the host name the trace records.
        clock_base_ns: the trace's ``baseTimeNanoseconds`` (its timestamps count from it), when it has one.
        origin_us: the alignment point in the trace's own timestamps (microseconds after ``clock_base_ns``).
    """

    rank: int
    steps: list[tuple[float, float]] = field(default_factory=list)
    schedules: list[tuple[float, float]] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    source: str = ""
    device: str = "cpu"
    host: str = ""
    clock_base_ns: int | None = None
    origin_us: float = 0.0

    def shifted(self, seconds: float) -> RankTimeline:
        """The same timeline with every time moved by ``seconds``."""
        return RankTimeline(
            self.rank,
            [(s + seconds, e + seconds) for s, e in self.steps],
            [(s + seconds, e + seconds) for s, e in self.schedules],
            [Segment(g.row, g.kind, g.start + seconds, g.end + seconds, g.label) for g in self.segments],
            self.source, self.device, self.host, self.clock_base_ns, self.origin_us - seconds * 1e6,
        )

    def row(self, row: str) -> list[Segment]:
        """The segments of one row (``"compute"`` or ``"comm"``)."""
        return [s for s in self.segments if s.row == row]

    def figures(self) -> dict[str, float]:
        """Seconds summed over the profiled steps: ``window_s`` (the steps), ``compute_s`` (union of compute),
        ``idle_s`` (window minus compute), ``comm_s`` (union of communication), ``comm_hidden_s`` (communication
        inside the compute segments) and ``comm_overlap`` (``comm_hidden_s / comm_s``, 0 without communication).

        The compute segments are the ranges the callback and the pipeline engine mark, so a collective the rank blocks
        on *inside* them (FSDP2's parameter gathers in forward, tensor parallelism's all-reduces) counts as inside:
        ``comm_overlap`` measures what it says for asynchronous communication (the dp reducer's buckets during
        backward, pipeline sends), and is an upper bound otherwise."""
        compute = [(s.start, s.end) for s in self.row("compute")]
        comm = [(s.start, s.end) for s in self.row("comm")]
        window = sum(e - s for s, e in self.steps)
        compute_s = _clipped_union(compute, self.steps)
        comm_s = _clipped_union(comm, self.steps)
        hidden = _clipped_union(_intersect(_merge(comm), _merge(compute)), self.steps)
        return {
            "window_s": window,
            "compute_s": compute_s,
            "idle_s": max(0.0, window - compute_s),
            "comm_s": comm_s,
            "comm_hidden_s": hidden,
            "comm_overlap": hidden / comm_s if comm_s > 0 else 0.0,
        }

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "steps": self.steps, "schedules": self.schedules, "source": self.source,
                "device": self.device, "host": self.host, "clock_base_ns": self.clock_base_ns,
                "origin_us": self.origin_us,
                "segments": [s.__dict__ for s in self.segments]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankTimeline:
        return cls(data["rank"], [tuple(s) for s in data["steps"]], [tuple(s) for s in data["schedules"]],
                   [Segment(**s) for s in data["segments"]], data.get("source", ""), data.get("device", "cpu"),
                   data.get("host", ""), data.get("clock_base_ns"), data.get("origin_us", 0.0))


def _merge(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for s, e in sorted(spans):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def union_length(spans: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` spans (overlaps counted once)."""
    return sum(e - s for s, e in _merge(spans))


def _clipped_union(spans: Iterable[tuple[float, float]], windows: Sequence[tuple[float, float]]) -> float:
    return union_length(_intersect(_merge(spans), _merge(windows)))


def _events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e and "dur" in e]


def read_trace(path: str | Path, rank: int | None = None) -> RankTimeline:
    """Read one rank's Chrome trace (``torch.profiler.profile.export_chrome_trace``) into a :class:`RankTimeline`.

    Args:
        path: the trace file (JSON, as torch writes it).
        rank: the global rank; default: the trace's ``distributedInfo.rank``, else 0.

    Returns:
        The rank's timeline, in seconds from the end of its ``lp::align`` range (from its first ``lp::step`` when
        there is none).

    Raises:
        ValueError: the trace holds no ``lp::step`` range (it was not recorded by the timeline callback).
    """
    trace = json.loads(Path(path).read_text())
    if rank is None:
        rank = int((trace.get("distributedInfo") or {}).get("rank", 0))
    events = _events(trace)
    device_annotations = [e for e in events if e.get("cat") == "gpu_user_annotation" and e["name"].startswith("lp::")]
    host = [e for e in events if e.get("cat") != "gpu_user_annotation" and e.get("cat") != "kernel"]
    steps = sorted((e for e in host if e["name"] == ANNOTATIONS["step"]), key=lambda e: e["ts"])
    if not steps:
        raise ValueError(
            f"trace {str(path)!r} has no {ANNOTATIONS['step']!r} range: record it with "
            f"lightning_par.callbacks.TimelineCallback (or mark each step with record_function('lp::step'))."
        )
    aligns = [e for e in host if e["name"] == ANNOTATIONS["align"]]
    origin_us = min(e["ts"] + e["dur"] for e in aligns) if aligns else steps[0]["ts"]
    align_spans = [(e["ts"], e["ts"] + e["dur"]) for e in aligns]

    def seconds(e: dict[str, Any]) -> tuple[float, float]:
        return (e["ts"] - origin_us) / 1e6, (e["ts"] + e["dur"] - origin_us) / 1e6

    base_ns = trace.get("baseTimeNanoseconds")
    timeline = RankTimeline(
        rank=rank, source=str(path), device="cuda" if device_annotations else "cpu",
        host=str(trace.get("host_name", "")),
        clock_base_ns=None if base_ns is None else int(base_ns), origin_us=float(origin_us),
    )
    timeline.steps = [seconds(e) for e in steps]
    compute_source = device_annotations or host
    timeline.schedules = [seconds(e) for e in host if e["name"] == ANNOTATIONS["schedule"]]
    pipeline = [e for e in compute_source if e["name"].startswith(_PIPELINE_PREFIX)]
    segments: list[Segment] = []
    for e in pipeline:
        kind, stage, mb = e["name"][len(_PIPELINE_PREFIX):].split()
        label = f"{kind}{mb[2:]}"
        segments.append(Segment("compute", _PIPELINE_KINDS.get(kind, "forward"), *seconds(e), label=label))
    for name in ("forward", "backward", "optimizer"):
        for e in compute_source:
            if e["name"] == ANNOTATIONS[name]:
                segments.append(Segment("compute", name, *seconds(e)))
    kernels = [e for e in events if e.get("cat") == "kernel" and "nccl" in e["name"].lower()]
    comm_events = kernels or [
        e for e in host if e["name"].startswith(("gloo:", "nccl:"))
        and not any(s <= e["ts"] and e["ts"] + e["dur"] <= t for s, t in align_spans)
    ]
    for e in comm_events:
        segments.append(Segment("comm", collective_name(e["name"]), *seconds(e)))
    timeline.segments = sorted(segments, key=lambda s: (s.start, s.row))
    return timeline


def align_timelines(timelines: Sequence[RankTimeline]) -> list[RankTimeline]:
    """Put the ranks of one host on that host's clock: when every trace names the same host and has absolute
    timestamps, shift each rank so that times count from the earliest rank's alignment point (exact: one clock);
    otherwise return the timelines as they are (aligned on the barrier)."""
    hosts = {t.host for t in timelines}
    if len(hosts) != 1 or "" in hosts or any(t.clock_base_ns is None for t in timelines):
        return list(timelines)
    ref = timelines[0]
    # each rank's alignment point on rank 0's clock, in µs: integer bases subtracted first (no float rounding)
    offsets = [
        (t.clock_base_ns - ref.clock_base_ns) / 1e3 + t.origin_us - ref.origin_us  # type: ignore[operator]
        for t in timelines
    ]
    first = min(offsets)
    return [t.shifted((o - first) / 1e6) for t, o in zip(timelines, offsets)]


def timeline_figures(timelines: Sequence[RankTimeline]) -> dict[str, Any]:
    """Figures of a profiled run, per rank (lists in rank order): ``timeline_compute_s``, ``timeline_idle_s``,
    ``timeline_comm_s``, ``timeline_comm_overlap`` (share of communication time inside the compute segments, see
    :meth:`RankTimeline.figures`); and with
    pipelining ``timeline_pp_idle_fraction``: per rank, the share of each step's common schedule window (first rank in
    to last rank out) in which that rank did not compute, the bubble as the picture shows it (compare ``pp_bubble``,
    measured by the engine from its own timers)."""
    per_rank = [t.figures() for t in timelines]
    out: dict[str, Any] = {
        f"timeline_{key}": [f[key] for f in per_rank] for key in ("compute_s", "idle_s", "comm_s", "comm_overlap")
    }
    if timelines and all(t.schedules for t in timelines) and len({len(t.schedules) for t in timelines}) == 1:
        windows = [
            (min(t.schedules[i][0] for t in timelines), max(t.schedules[i][1] for t in timelines))
            for i in range(len(timelines[0].schedules))
        ]
        total = sum(e - s for s, e in windows)
        out["timeline_pp_idle_fraction"] = [
            1.0 - _clipped_union([(s.start, s.end) for s in t.row("compute") if s.kind != "optimizer"], windows) / total
            if total > 0 else 0.0
            for t in timelines
        ]
    return out
