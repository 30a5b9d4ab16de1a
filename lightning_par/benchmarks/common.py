"""What every benchmark section shares: model presets, data, and step timings taken in turns.

Ratios are only meaningful against a baseline measured in the same run, under the same load. On a shared machine the
load drifts, so the contenders of a table take turns *step by step* (A B C A B C ...) inside one process-group launch,
every step starts at a barrier, and each contender's figure is the median of its steps: a step delayed by another
job on the machine shifts one sample, not a whole contender.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["GPT_SHAPES", "Contender", "median_ratio", "run_in_turns", "token_batches"]

#: Model shapes of the benchmarks (the reference GPT's fields). ``tiny`` and ``small`` are the presets of
#: :data:`lightning_par.models.gpt.GPT_PRESETS` (block size cut to 64 here); ``wide`` doubles ``small``'s width,
#: which quadruples the elements per matrix while keeping the number of tensors: the scaling row reads the fixed
#: per-tensor cost off the three.
GPT_SHAPES: dict[str, dict[str, int]] = {
    "tiny": dict(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=256),
    "small": dict(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=256),
    "wide": dict(n_layer=4, n_head=4, n_embd=256, block_size=64, vocab_size=256),
}


def token_batches(steps: int, micro_batch: int, seq: int, vocab: int, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    """``steps`` batches ``(x, y)`` of ``(micro_batch, seq)`` random token ids, ``y`` shifted by one; the same on
    every rank for a given ``seed`` (pass ``seed + rank`` for different data per rank)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        data = torch.randint(0, vocab, (micro_batch, seq + 1), generator=g)
        out.append((data[:, :-1].contiguous(), data[:, 1:].contiguous()))
    return out


@dataclass
class Contender:
    """One side of a comparison: ``step(i)`` runs training step ``i`` (forward, backward, optimizer step).

    Attributes:
        name: the row label.
        step: the step function.
        times: wall seconds of each measured step (the slowest rank's), filled by :func:`run_in_turns`.
        cpu_times: CPU seconds the calling thread spent in each measured step (the largest over ranks): blind to
            time spent waiting (for peers, for collectives, for a core another process holds), so it moves much
            less than wall time on a shared machine; it misses work on other threads (the backends' communication
            threads).
        extra: anything the contender wants to report.
    """

    name: str
    step: Callable[[int], Any]
    times: list[float] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def median_s(self) -> float:
        return statistics.median(self.times)

    @property
    def median_cpu_s(self) -> float:
        return statistics.median(self.cpu_times)


def run_in_turns(contenders: Sequence[Contender], steps: int, warmup: int, group: Any = None) -> None:
    """Run ``warmup + steps`` steps of every contender, taking turns step by step; time the last ``steps``.

    Every step starts at a barrier over ``group`` (default: the world) and its time is this rank's wall time to the
    end of the step; the slowest rank's time is kept (a synchronous step is as slow as its slowest rank).
    """
    for i in range(warmup + steps):
        for c in contenders:
            dist.barrier(group=group)
            start, cpu_start = time.perf_counter(), time.thread_time()
            c.step(i)
            elapsed = torch.tensor([time.perf_counter() - start, time.thread_time() - cpu_start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
            if i >= warmup:
                c.times.append(float(elapsed[0]))
                c.cpu_times.append(float(elapsed[1]))


def median_ratio(a: Contender, b: Contender) -> float:
    """``median(a) / median(b)`` of step times."""
    return a.median_s / b.median_s
