"""Analysis of pipeline schedules: their orders of operations, computed without any process, and their bubble.

The schedules that train are torch's (:mod:`lightning_par.pipeline_parallel.engine`); this module is their model on
paper, for tests and benchmarks: :func:`build_order` returns, for one pipeline rank, the list of :class:`Action` the
classic schedules (GPipe, 1F1B, interleaved 1F1B) execute; :mod:`lightning_par.pipeline_parallel.simulate` replays the
lists of all ranks on a clock to check that they cannot deadlock and to predict the bubble, which
:func:`bubble_formula` gives in closed form.

Stages and ranks. With ``pp_size = p`` ranks and ``virtual_stages = v`` model chunks per rank there are ``p * v``
virtual stages; chunk ``c`` of pipeline rank ``r`` is virtual stage ``c * p + r`` (Narayanan et al. 2021, §2.2), so
a micro-batch visits ranks ``0, 1, ..., p-1, 0, 1, ...``. Without interleaving (``v = 1``) virtual stage = rank.

The schedules:

* ``"gpipe"``: every micro-batch forward, then every micro-batch backward (GPipe, Huang et al. 2019, §2.2). Each rank
  holds the activations of all ``m`` micro-batches at the end of the forward phase.
* ``"1f1b"``: PipeDream-Flush (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training", ICML 2021, §3.1;
  the non-interleaved schedule of Narayanan et al. 2021, §2.1): stage ``s`` runs ``min(p - s - 1, m)`` warm-up
  forwards, then alternates one forward and one backward, then drains the remaining backwards. Same bubble as GPipe,
  but at most ``p - s`` micro-batches' activations are held on stage ``s``.
* ``"interleaved_1f1b"``: the interleaved schedule of Narayanan et al. 2021 ("Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM", SC21, §2.2), as in Megatron-LM's
  ``forward_backward_pipelining_with_interleaving``: forwards go through the chunks in groups of ``p`` micro-batches,
  backwards through the chunks in reverse; ``2 (p - r - 1) + (v - 1) p`` warm-up forwards on rank ``r``. The bubble
  shrinks by ``v``: ``(p - 1) / (v m + p - 1)`` of the step. Needs ``m`` to be a multiple of ``p``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "SCHEDULES",
    "Action",
    "build_order",
    "bubble_formula",
    "forward_only_order",
    "peak_in_flight",
    "resolve_virtual_stages",
    "stage_ids",
    "validate_schedule",
]

#: Schedule names accepted by :func:`build_order`.
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclass(frozen=True)
class Action:
    """One operation of a schedule on one rank.

    Attributes:
        kind: ``"F"`` (forward of one micro-batch through one chunk) or ``"B"`` (its backward).
        chunk: index of the model chunk on this rank, ``0 <= chunk < virtual_stages``.
        microbatch: index of the micro-batch, ``0 <= microbatch < num_microbatches``.
    """

    kind: str
    chunk: int
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}" if self.chunk == 0 else f"{self.kind}{self.microbatch}.c{self.chunk}"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def resolve_virtual_stages(schedule: str, virtual_stages: int | None) -> int:
    """Model chunks per rank: ``virtual_stages`` as given, or the default (2 for ``interleaved_1f1b``, else 1).

    Raises:
        ValueError: ``virtual_stages`` is not a positive integer, is ``> 1`` for a non-interleaved schedule, or is
            ``< 2`` for ``interleaved_1f1b``.
    """
    if virtual_stages is None:
        return 2 if schedule == "interleaved_1f1b" else 1
    if not _is_int(virtual_stages) or virtual_stages < 1:
        raise ValueError(f"virtual_stages={virtual_stages!r} is not valid: expected a positive integer or None.")
    if schedule == "interleaved_1f1b" and virtual_stages < 2:
        raise ValueError(
            f"virtual_stages={virtual_stages} is not valid for schedule='interleaved_1f1b': expected an integer >= 2 "
            f"(chunks per rank); use schedule='1f1b' for one chunk per rank."
        )
    if schedule != "interleaved_1f1b" and virtual_stages != 1:
        raise ValueError(
            f"virtual_stages={virtual_stages} is not valid for schedule={schedule!r}: expected 1 (or None); "
            f"several chunks per rank need schedule='interleaved_1f1b'."
        )
    return virtual_stages


def validate_schedule(schedule: str, pp_size: int, num_microbatches: int, virtual_stages: int | None = None) -> int:
    """Check a schedule's options against each other; return the number of chunks per rank.

    Args:
        schedule: one of :data:`SCHEDULES`.
        pp_size: pipeline ranks ``p``.
        num_microbatches: micro-batches per step ``m``.
        virtual_stages: chunks per rank ``v`` (None: the schedule's default, see :func:`resolve_virtual_stages`).

    Returns:
        ``v``.

    Raises:
        ValueError: an unknown schedule, ``num_microbatches`` not a positive integer, an invalid ``virtual_stages``,
            or, for ``interleaved_1f1b``, ``num_microbatches`` not a multiple of ``pp_size`` (the schedule sends
            micro-batches through the chunks in groups of ``p``; fewer micro-batches than stages cannot fill it).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not valid: expected one of {list(SCHEDULES)}.")
    if not _is_int(pp_size) or pp_size < 1:
        raise ValueError(f"pp_size={pp_size!r} is not valid: expected a positive integer.")
    if not _is_int(num_microbatches) or num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches!r} is not valid: expected a positive integer.")
    v = resolve_virtual_stages(schedule, virtual_stages)
    if schedule == "interleaved_1f1b" and num_microbatches % pp_size != 0:
        valid = ", ".join(str(pp_size * k) for k in range(1, 4))
        raise ValueError(
            f"num_microbatches={num_microbatches} is not valid for schedule='interleaved_1f1b' with pp_size={pp_size}: "
            f"expected a multiple of pp_size ({valid}, ...), since micro-batches enter the chunks in groups of "
            f"pp_size."
        )
    return v


def stage_ids(pp_rank: int, pp_size: int, virtual_stages: int = 1) -> list[int]:
    """Virtual stage index of each chunk of ``pp_rank``: ``[c * pp_size + pp_rank for c in range(virtual_stages)]``."""
    return [c * pp_size + pp_rank for c in range(virtual_stages)]


def _gpipe(m: int) -> list[Action]:
    return [Action("F", 0, i) for i in range(m)] + [Action("B", 0, i) for i in range(m)]


def _one_f_one_b(pp_rank: int, p: int, m: int) -> list[Action]:
    warmup = min(p - pp_rank - 1, m)
    order = [Action("F", 0, i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: one forward, then the oldest backward
        order += [Action("F", 0, warmup + i), Action("B", 0, i)]
    order += [Action("B", 0, i) for i in range(m - warmup, m)]
    return order


def _interleaved(pp_rank: int, p: int, m: int, v: int) -> list[Action]:
    total = m * v

    def forward(k: int) -> Action:  # k-th forward on this rank: groups of p micro-batches, chunk by chunk
        return Action("F", (k // p) % v, (k // (p * v)) * p + k % p)

    def backward(k: int) -> Action:  # backwards visit the chunks in reverse
        return Action("B", v - 1 - (k // p) % v, (k // (p * v)) * p + k % p)

    warmup = min(2 * (p - pp_rank - 1) + (v - 1) * p, total)
    order = [forward(k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [forward(warmup + i), backward(i)]
    order += [backward(k) for k in range(total - warmup, total)]
    return order


def build_order(
    schedule: str, pp_rank: int, pp_size: int, num_microbatches: int, virtual_stages: int | None = None
) -> list[Action]:
    """The operations pipeline rank ``pp_rank`` runs in one training step, in order.

    Args:
        schedule: one of :data:`SCHEDULES`.
        pp_rank: this rank's index on the pp axis, ``0 <= pp_rank < pp_size``.
        pp_size: pipeline ranks ``p``.
        num_microbatches: ``m``.
        virtual_stages: chunks per rank (interleaved only; default 2).

    Returns:
        ``2 * m * v`` actions: every (chunk, micro-batch) once forward and once backward, each forward before its
        backward. E.g. ``1f1b``, ``p = 4``, ``m = 6``, rank 0: ``[F0, F1, F2, F3, B0, F4, B1, F5, B2, B3, B4, B5]``.

    Raises:
        ValueError: invalid options (see :func:`validate_schedule`) or ``pp_rank`` outside ``[0, pp_size)``.
    """
    v = validate_schedule(schedule, pp_size, num_microbatches, virtual_stages)
    if not _is_int(pp_rank) or not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank={pp_rank!r} is not valid: expected 0 <= pp_rank < pp_size={pp_size}.")
    if schedule == "gpipe":
        return _gpipe(num_microbatches)
    if schedule == "1f1b":
        return _one_f_one_b(pp_rank, pp_size, num_microbatches)
    return _interleaved(pp_rank, pp_size, num_microbatches, v)


def forward_only_order(num_microbatches: int, virtual_stages: int = 1) -> list[Action]:
    """Forwards only (validation, test): chunk by chunk, every micro-batch. Cannot deadlock: every rank finishes all
    its chunk-``c`` forwards before any chunk-``c + 1`` forward, and sends never block."""
    return [Action("F", c, i) for c in range(virtual_stages) for i in range(num_microbatches)]


def peak_in_flight(order: list[Action]) -> int:
    """Largest number of micro-batches (summed over chunks) whose forward has run but whose backward has not: the
    activations a rank holds at its worst moment. ``m`` for GPipe; ``min(p - s, m)`` on stage ``s`` for 1F1B."""
    held = peak = 0
    for action in order:
        held += 1 if action.kind == "F" else -1
        peak = max(peak, held)
    return peak


def bubble_formula(pp_size: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """Idle share of a step for uniform stages: ``(p - 1) / (v m + p - 1)``.

    With ``v = 1`` this is GPipe's ``(p - 1) / (m + p - 1)`` (Huang et al. 2019, §2.2; the same for 1F1B). The
    interleaved schedule divides the bubble time by ``v`` (Narayanan et al. 2021, §2.2: bubble / ideal time
    ``= (p - 1) / (v m)``), i.e. ``(p - 1) / (v m + p - 1)`` of the whole step.
    """
    return (pp_size - 1) / (virtual_stages * num_microbatches + pp_size - 1)
