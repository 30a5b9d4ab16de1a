"""Replay the schedules of all pipeline ranks on a clock, without processes.

The model is the runner's: each rank executes its :class:`~lightning_par.pipeline_parallel.schedules.Action` list in
order; a forward of virtual stage ``s > 0`` waits for the forward of stage ``s - 1`` on the same micro-batch (a
blocking receive), a backward of stage ``s < S - 1`` waits for the backward of stage ``s + 1``; sends never block.
This checks that a schedule cannot deadlock and gives the ideal timeline, whose idle share is the bubble that
:func:`~lightning_par.pipeline_parallel.schedules.bubble_formula` predicts.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_par.pipeline_parallel.schedules import Action, build_order

__all__ = ["SimulatedStep", "simulate"]


@dataclass
class SimulatedStep:
    """Timeline of one simulated step.

    Attributes:
        timeline: per rank, ``[(action, start_time, end_time), ...]`` in execution order (time units of the inputs).
        makespan: end of the last operation on any rank.
        busy: per rank, total time spent in forward and backward.
    """

    timeline: list[list[tuple[Action, float, float]]]
    makespan: float
    busy: list[float]

    @property
    def bubble(self) -> list[float]:
        """Per rank, idle share of the step: ``1 - busy / makespan``."""
        return [1.0 - b / self.makespan for b in self.busy]


def simulate(
    schedule: str,
    pp_size: int,
    num_microbatches: int,
    virtual_stages: int | None = None,
    t_forward: float = 1.0,
    t_backward: float = 2.0,
    latency: float = 0.0,
) -> SimulatedStep:
    """Run every rank's schedule on a shared clock with fixed operation times.

    Args:
        schedule, pp_size, num_microbatches, virtual_stages: as for
            :func:`~lightning_par.pipeline_parallel.schedules.build_order`.
        t_forward: time of one forward of one whole rank's share of the model; a chunk takes ``t_forward / v``.
        t_backward: the same for a backward.
        latency: added between an operation and the dependent one on another rank (a send).

    Returns:
        The timeline.

    Raises:
        ValueError: invalid schedule options.
        RuntimeError: the schedules deadlock (every rank waits on another), or an action repeats or runs a backward
            before its forward; the message shows where each rank is stuck.
    """
    orders = [build_order(schedule, r, pp_size, num_microbatches, virtual_stages) for r in range(pp_size)]
    v = max(a.chunk for a in orders[0]) + 1
    n_stages = pp_size * v
    done: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, micro-batch) -> end time
    clock = [0.0] * pp_size
    position = [0] * pp_size
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(pp_size)]
    busy = [0.0] * pp_size
    total = sum(len(o) for o in orders)
    finished = 0
    while finished < total:
        progressed = False
        for r in range(pp_size):
            while position[r] < len(orders[r]):
                a = orders[r][position[r]]
                stage = a.chunk * pp_size + r
                key = (a.kind, stage, a.microbatch)
                if key in done:
                    raise RuntimeError(f"rank {r} runs {a!r} twice")
                if a.kind == "F":
                    dep = ("F", stage - 1, a.microbatch) if stage > 0 else None
                    cost = t_forward / v
                else:
                    if ("F", stage, a.microbatch) not in done:
                        raise RuntimeError(f"rank {r} runs {a!r} before its forward")
                    dep = ("B", stage + 1, a.microbatch) if stage < n_stages - 1 else None
                    cost = t_backward / v
                if dep is not None and dep not in done:
                    break  # blocked on a receive
                ready = 0.0 if dep is None else done[dep] + (latency if dep[1] % pp_size != r else 0.0)
                start = max(clock[r], ready)
                clock[r] = start + cost
                done[key] = clock[r]
                busy[r] += cost
                timeline[r].append((a, start, clock[r]))
                position[r] += 1
                finished += 1
                progressed = True
        if not progressed:
            stuck = {r: orders[r][position[r]] for r in range(pp_size) if position[r] < len(orders[r])}
            raise RuntimeError(f"schedule {schedule!r} deadlocks: ranks wait at {stuck}")
    return SimulatedStep(timeline=timeline, makespan=max(clock), busy=busy)
