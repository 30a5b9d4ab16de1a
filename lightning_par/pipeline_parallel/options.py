"""Validated options of the pp axis: which schedule, how many micro-batches and model chunks, where to cut.

The schedules are torch's (``torch.distributed.pipelining``); this module names them, knows the constraints each one
puts on the layout, and refuses before any process starts the combinations measured here to fail.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_par.validation import check_bool, check_choice, check_int, check_number

__all__ = ["SCHEDULES", "SPLIT_METHODS", "PipelineOptions", "ScheduleSpec", "take_schedule"]

#: Automatic ways of placing the stage boundaries (an explicit list of layer counts is the other way).
SPLIT_METHODS: tuple[str, ...] = ("params", "time", "size")


@dataclass(frozen=True)
class ScheduleSpec:
    """What a schedule needs from the layout.

    Attributes:
        torch_class: the class in ``torch.distributed.pipelining``.
        placement: ``"loop"`` (chunk ``c`` of rank ``r`` is virtual stage ``c * p + r``, Narayanan et al. 2021 §2.2)
            or ``"v"`` (rank ``r`` holds stages ``r`` and ``2p - 1 - r``: the V shape of Qi et al. 2024 §6).
        virtual_stages: model chunks per rank: ``(default, minimum, maximum)`` (``None``: no maximum).
        splits_backward: the schedule runs the input-gradient and weight-gradient halves of a backward apart.
        source: where the schedule comes from.
    """

    torch_class: str
    placement: str
    virtual_stages: tuple[int, int, int | None]
    splits_backward: bool
    source: str


#: The schedules, by option value.
SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec("ScheduleGPipe", "loop", (1, 1, 1), False, "GPipe, Huang et al. 2019, §2.2"),
    "1f1b": ScheduleSpec(
        "Schedule1F1B", "loop", (1, 1, 1), False, "PipeDream-Flush, Narayanan et al. 2021 (ICML), §3.1"
    ),
    "interleaved_1f1b": ScheduleSpec(
        "ScheduleInterleaved1F1B", "loop", (2, 2, None), False, "Narayanan et al. 2021 (SC21), §2.2"
    ),
    "interleaved_zero_bubble": ScheduleSpec(
        "ScheduleInterleavedZeroBubble", "loop", (2, 2, None), True, "Qi et al. 2024, Zero Bubble Pipeline Parallelism"
    ),
    "zbv_zero_bubble": ScheduleSpec("ScheduleZBVZeroBubble", "v", (2, 2, 2), True, "ZB-V, Qi et al. 2024, §6"),
    "dualpipev": ScheduleSpec("ScheduleDualPipeV", "v", (2, 2, 2), True, "DualPipe, DeepSeek-V3 report, §3.2.1"),
}


@dataclass(frozen=True)
class PipelineOptions:
    """Pipeline parallelism on the pp axis.

    Attributes:
        schedule: a key of :data:`SCHEDULES`.
        num_microbatches: micro-batches per batch ``m``; a training batch must be a multiple of it.
        virtual_stages: model chunks per rank ``v`` (``None``: the schedule's default, 2 for the interleaved and V
            schedules, else 1).
        split: ``"params"`` (balance parameter counts), ``"time"`` (measured layer times, fairscale's profiler),
            ``"size"`` (measured memory, CUDA only), or a list of layer counts, one per virtual stage.
        split_timeout_s: seconds of profiling for ``split="time"``.
        measure_bubble: start each step with a barrier over the pp group so the bubble is measured within the step.

    Raises:
        ValueError: an invalid field, named in the message (layout-dependent checks: :meth:`check_layout`).
    """

    schedule: str = "1f1b"
    num_microbatches: int = 4
    virtual_stages: int | None = None
    # ``str | Sequence[int]``, typed Any: this class is also the Hydra schema of ``strategy.pipeline``, and OmegaConf
    # has no union of a string and a list (``__post_init__`` checks the value).
    split: Any = field(default="params", hash=False)
    split_timeout_s: float = 1.0
    measure_bubble: bool = True

    def __post_init__(self) -> None:
        check_choice("schedule", self.schedule, SCHEDULES)
        check_int("num_microbatches", self.num_microbatches, 1)
        spec = SCHEDULES[self.schedule]
        default, low, high = spec.virtual_stages
        if self.virtual_stages is None:
            object.__setattr__(self, "virtual_stages", default)
        v = check_int("virtual_stages", self.virtual_stages, 1)
        if v < low or (high is not None and v > high):
            valid = f"{low}" if high == low else f">= {low}" if high is None else f"{low}..{high}"
            raise ValueError(
                f"virtual_stages={v} is not valid for schedule={self.schedule!r}: expected {valid} model chunks per "
                f"rank (or None). Several chunks per rank need an interleaved or V schedule; one chunk per rank needs "
                f"'gpipe' or '1f1b'."
            )
        split = self.split
        if isinstance(split, str):
            check_choice("split", split, SPLIT_METHODS, "Or give a list of layer counts per virtual stage.")
        elif isinstance(split, Sequence) and all(isinstance(n, int) and not isinstance(n, bool) for n in split):
            object.__setattr__(self, "split", list(split))
        else:
            raise ValueError(
                f"split={split!r} is not valid: expected one of {list(SPLIT_METHODS)} or a list of integer layer "
                f"counts per virtual stage."
            )
        object.__setattr__(self, "split_timeout_s", check_number("split_timeout_s", self.split_timeout_s, unit="s"))
        check_bool("measure_bubble", self.measure_bubble)

    @property
    def spec(self) -> ScheduleSpec:
        return SCHEDULES[self.schedule]

    def num_stages(self, pp_size: int) -> int:
        """Virtual stages of the whole pipeline, ``pp_size * virtual_stages``."""
        return pp_size * int(self.virtual_stages)  # type: ignore[arg-type]

    def stage_ids(self, pp_rank: int, pp_size: int) -> list[int]:
        """Virtual stages held by ``pp_rank``, in chunk order (see :attr:`ScheduleSpec.placement`)."""
        if self.spec.placement == "v":
            return [pp_rank, 2 * pp_size - 1 - pp_rank]
        return [c * pp_size + pp_rank for c in range(int(self.virtual_stages))]  # type: ignore[arg-type]

    def last_stage_rank(self, pp_size: int) -> int:
        """The pp rank holding the last virtual stage (the one that computes the loss)."""
        return 0 if self.spec.placement == "v" else pp_size - 1

    def check_layout(self, pp_size: int, dp_mode: str = "ddp", reshard_after_forward: bool = True) -> None:
        """Check the constraints a schedule puts on ``pp_size`` and the dp mode (no process needed).

        Raises:
            ValueError: ``num_microbatches`` below ``pp_size`` for ``1f1b`` (torch's Schedule1F1B), below the number
                of virtual stages for ``dualpipev``, or not a multiple of ``max(1, m // pp_size)`` for the interleaved
                schedules; a zero-bubble schedule with ``dp_mode="zero3"`` and ``reshard_after_forward=True``
                (measured here with torch 2.13 at pp 2 x dp 2: ``interleaved_zero_bubble`` and ``zbv_zero_bubble``
                crash in the weight-gradient step, ``dualpipev`` trains with wrong gradients, all three are exact
                with ``reshard_after_forward=False``).
        """
        m, name = self.num_microbatches, self.schedule
        if pp_size < 2:
            return
        if name == "1f1b" and m < pp_size:
            raise ValueError(
                f"num_microbatches={m} is not valid for schedule='1f1b' with pp_size={pp_size}: expected at least "
                f"pp_size={pp_size} micro-batches (use schedule='gpipe' for fewer)."
            )
        if name == "dualpipev" and m < self.num_stages(pp_size):
            raise ValueError(
                f"num_microbatches={m} is not valid for schedule='dualpipev' with pp_size={pp_size}: expected at least "
                f"2 * pp_size = {self.num_stages(pp_size)} micro-batches (one per virtual stage)."
            )
        if name in ("interleaved_1f1b", "interleaved_zero_bubble"):
            rounds = max(1, m // pp_size)
            if m % rounds:
                valid = sorted({pp_size * k for k in range(1, 4)} | set(range(1, pp_size + 1)))
                raise ValueError(
                    f"num_microbatches={m} is not valid for schedule={name!r} with pp_size={pp_size}: micro-batches "
                    f"run in rounds of {m // rounds}, so m must be a multiple of max(1, m // pp_size)={rounds}; e.g. "
                    f"one of {valid}."
                )
        if self.spec.splits_backward and dp_mode == "zero3" and reshard_after_forward:
            raise ValueError(
                f"schedule={name!r} with dp_mode='zero3' and reshard_after_forward=True is not valid: with torch 2.13 "
                f"the zero-bubble schedules re-gather resharded FSDP2 units incorrectly (measured: a crash in the "
                f"weight-gradient step, or wrong gradients for dualpipev). Use reshard_after_forward=False, another "
                f"dp_mode, or schedule in ['gpipe', '1f1b', 'interleaved_1f1b']."
            )


def take_schedule(schedule: str | None, options: dict[str, Any], default: str) -> str:
    """The schedule a pipeline preset runs: ``schedule`` if given, else the nested ``options["pipeline"]["schedule"]``
    (the Hydra schema's ``strategy.pipeline.schedule``, taken out of ``options``), else ``default``."""
    if schedule is not None:
        return schedule
    nested = dict(options.get("pipeline") or {})
    schedule = nested.pop("schedule", None) or default
    if "pipeline" in options:
        options["pipeline"] = nested
    return schedule
