"""Replay the schedules of all pipeline ranks on a clock, without processes: the ideal timeline and its bubble.

Each rank executes its list of operations in order. An operation is ``(kind, virtual stage, micro-batch)`` with kind
``"F"`` (forward), ``"B"`` (full backward), or the two halves of a split backward (zero-bubble schedules, Qi et al.
2024, §2): ``"I"`` (gradient of the stage's input) and ``"W"`` (gradient of its weights). Dependencies: a forward of
stage ``s > 0`` waits for the forward of ``s - 1`` on the same micro-batch (a blocking receive); ``B``/``I`` of stage
``s`` waits for its own forward and for ``B``/``I`` of ``s + 1``; ``W`` waits for the same stage's ``I``. Sends never
block. An entry may also be a tuple of operations run back to back as one (torch's ``OVERLAP_F_B`` in DualPipeV): it
starts once every one of them can, and its results reach other ranks when the last one ends, because torch's runtime
receives every input of the pair before it and sends every output after it (``_add_send_recv`` in
``torch/distributed/pipelining/schedules.py``, torch 2.13). This checks that a schedule cannot deadlock and gives the bubble of its ideal timeline:
:func:`~lightning_par.pipeline_parallel.schedules.bubble_formula` in closed form for GPipe, 1F1B and interleaved 1F1B,
and for any other schedule (torch's zero-bubble ones) the replay of its own action lists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_par.pipeline_parallel.schedules import Action, build_order

__all__ = ["SimulatedStep", "simulate", "simulate_actions"]

#: One operation of a rank: ``(kind, virtual stage, micro-batch)``.
Op = tuple[str, int, int]
#: One entry of a rank's order: an operation, or a tuple of operations run as one (an overlapped pair).
Entry = Op | tuple[Op, ...]


def _ops(entry: Entry) -> tuple[Op, ...]:
    return entry if isinstance(entry[0], tuple) else (entry,)  # type: ignore[return-value]


@dataclass
class SimulatedStep:
    """Timeline of one simulated step.

    Attributes:
        timeline: per rank, ``[(operation, start_time, end_time), ...]`` in execution order (time units of the costs).
        makespan: end of the last operation on any rank.
        busy: per rank, total time spent computing.
    """

    timeline: list[list[tuple[Op, float, float]]]
    makespan: float
    busy: list[float]

    @property
    def bubble(self) -> list[float]:
        """Per rank, idle share of the step: ``1 - busy / makespan``."""
        return [1.0 - b / self.makespan for b in self.busy]

    @property
    def mean_bubble(self) -> float:
        """Idle share of the step, mean over ranks (what the engine measures as ``pp_bubble``)."""
        return sum(self.bubble) / len(self.bubble)


def simulate_actions(orders: Sequence[Sequence[Entry]], num_stages: int, cost: Callable[[str, int], float],
                     latency: float = 0.0) -> SimulatedStep:
    """Run every rank's operations on a shared clock.

    Args:
        orders: per pipeline rank, its operations in execution order; a tuple of operations is one entry run back to
            back, whose results other ranks see when its last operation ends.
        num_stages: virtual stages of the pipeline.
        cost: ``cost(kind, stage)``: time of one operation on one micro-batch.
        latency: added between an operation and a dependent one on another rank (a send).

    Returns:
        The timeline.

    Raises:
        RuntimeError: the schedules deadlock (every rank waits on another), or an operation repeats; the message
            shows where each rank is stuck.
    """
    ranks = len(orders)
    owner = {op[1]: r for r, order in enumerate(orders) for entry in order for op in _ops(entry)}
    done: dict[Op, float] = {}
    clock, position, busy = [0.0] * ranks, [0] * ranks, [0.0] * ranks
    timeline: list[list[tuple[Op, float, float]]] = [[] for _ in range(ranks)]
    total, finished = sum(len(o) for o in orders), 0

    def finished_at(kinds: str, stage: int, mb: int) -> float | None:
        ends = [done[(k, stage, mb)] for k in kinds if (k, stage, mb) in done]
        return min(ends) if ends else None

    def ready_at(op: Op, rank: int, inside: tuple[Op, ...]) -> float | None:
        """When ``op``'s inputs are here (``None``: not yet); inputs made inside its own entry are here already."""
        kind, stage, mb = op
        deps: list[tuple[str, int]] = []  # (kinds that satisfy it, stage)
        if kind == "F" and stage > 0:
            deps.append(("F", stage - 1))
        elif kind in ("B", "I"):
            deps.append(("F", stage))
            if stage < num_stages - 1:
                deps.append(("BI", stage + 1))
        elif kind == "W":
            deps.append(("I", stage))
        ready = 0.0
        for kinds, s in deps:
            if any((k, s, mb) in inside for k in kinds):
                continue
            end = finished_at(kinds, s, mb)
            if end is None:
                return None
            ready = max(ready, end + (latency if owner.get(s, rank) != rank else 0.0))
        return ready

    while finished < total:
        progressed = False
        for r in range(ranks):
            while position[r] < len(orders[r]):
                ops = _ops(orders[r][position[r]])
                for op in ops:
                    if op in done:
                        raise RuntimeError(f"rank {r} runs {op} twice")
                readies = [ready_at(op, r, ops) for op in ops]
                if any(t is None for t in readies):
                    break  # blocked on a receive
                start = max([clock[r], *readies])  # type: ignore[list-item]
                for op in ops:
                    timeline[r].append((op, start, start + cost(op[0], op[1])))
                    busy[r] += cost(op[0], op[1])
                    start += cost(op[0], op[1])
                clock[r] = start
                for op in ops:
                    done[op] = clock[r]
                position[r] += 1
                finished += 1
                progressed = True
        if not progressed:
            stuck = {r: orders[r][position[r]] for r in range(ranks) if position[r] < len(orders[r])}
            raise RuntimeError(f"the schedules deadlock: ranks wait at {stuck}")
    return SimulatedStep(timeline=timeline, makespan=max(clock), busy=busy)


def simulate(
    schedule: str,
    pp_size: int,
    num_microbatches: int,
    virtual_stages: int | None = None,
    t_forward: float = 1.0,
    t_backward: float = 2.0,
    latency: float = 0.0,
) -> SimulatedStep:
    """Replay one of the classic schedules (:func:`~lightning_par.pipeline_parallel.schedules.build_order`) with
    fixed operation times.

    Args:
        schedule, pp_size, num_microbatches, virtual_stages: as for
            :func:`~lightning_par.pipeline_parallel.schedules.build_order`.
        t_forward: time of one forward of one whole rank's share of the model; a chunk takes ``t_forward / v``.
        t_backward: the same for a backward.
        latency: added between an operation and the dependent one on another rank (a send).

    Raises:
        ValueError: invalid schedule options.
        RuntimeError: see :func:`simulate_actions`; also an action run before its forward.
    """
    orders: list[list[Action]] = [build_order(schedule, r, pp_size, num_microbatches, virtual_stages)
                                  for r in range(pp_size)]
    v = max(a.chunk for a in orders[0]) + 1
    ops = [[(a.kind, a.chunk * pp_size + r, a.microbatch) for a in order] for r, order in enumerate(orders)]
    for r, order in enumerate(ops):
        seen: set[tuple[int, int]] = set()
        for kind, stage, mb in order:
            if kind == "F":
                seen.add((stage, mb))
            elif (stage, mb) not in seen:
                raise RuntimeError(f"rank {r} runs B{mb} of stage {stage} before its forward")
    step = simulate_actions(ops, pp_size * v, lambda kind, s: (t_forward if kind == "F" else t_backward) / v, latency)
    step.timeline = [[(Action(op[0], op[1] // pp_size, op[2]), a, b) for op, a, b in line] for line in step.timeline]
    return step
