"""Pipeline benchmark: the bubble of every schedule measured on torch's engine, against the schedule's formula.

    python -m lightning_par.benchmarks.pipeline [--quick]

Two tables, from the engine the strategies use (:class:`~lightning_par.pipeline_parallel.PipelineEngine` on
``torch.distributed.pipelining``) and its per-rank busy/idle accounting:

1. **Bubble.** Every rank's share of the model has the same fixed compute per micro-batch: forward ``T_F``, the
   input-gradient half of the backward ``T_I`` and its weight-gradient half ``T_W`` (each a wait, so that several
   pipeline processes sharing this machine's two cores measure the schedule, not CPU contention; sleep-based stages
   check ordering and idle time, not speed). A chunk of a rank with ``v`` chunks takes ``1/v`` of each. For
   ``pp`` in {2, 4} and ``m`` in {4, 8}, each schedule's measured idle share (mean over ranks, median over the
   measured steps) is set beside its formula: the closed form ``(p - 1) / (v m + p - 1)`` for GPipe, 1F1B and
   interleaved 1F1B (Huang et al. 2019; Narayanan et al. 2021, §2.2), and for every schedule the replay of its own
   action lists with these costs (:func:`~lightning_par.pipeline_parallel.simulate.simulate_actions`; for the
   zero-bubble schedules of Qi et al. 2024 and DualPipeV there is no closed form for torch's exact orders). What
   remains between measured and formula is communication and Python overhead on the critical path.
2. **Step time.** All schedules on the reference GPT with real arithmetic at ``pp = 2``, ``m = 8``, taking turns step
   by step: step time relative to GPipe, measured bubble, and the most micro-batches whose activations a rank held.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_par.launcher import init_process_group_from_env, run_distributed
from lightning_par.pipeline_parallel.engine import PipelineEngine
from lightning_par.pipeline_parallel.options import SCHEDULES, PipelineOptions
from lightning_par.pipeline_parallel.schedules import bubble_formula, build_order
from lightning_par.pipeline_parallel.simulate import Entry, simulate_actions

__all__ = ["FixedTimeStage", "expected_bubble", "run", "torch_orders"]

#: This benchmark's section in ``recipes/benchmark.py`` (``--only pp``) and its place in the full run.
SECTION = "pp"
ORDER = 40

#: Seconds of one rank's share of the model per micro-batch: forward, input-gradient and weight-gradient halves of
#: the backward (equal: the case the zero-bubble schedules are built for, Qi et al. 2024, §3).
T_F, T_I, T_W = 0.030, 0.030, 0.030
_WIDTH = 16


class _WaitInBackward(torch.autograd.Function):
    """Identity whose backward takes ``seconds``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, seconds: float) -> Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class FixedTimeStage(nn.Module):
    """A stage whose forward takes ``t_f`` seconds and whose backward ``t_i`` (input gradient) plus ``t_w`` (weight
    gradient): ``x + w`` with a wait on each branch, so the two halves of a split backward share no computation (the
    input half runs the ``x`` branch, the weight half the ``w`` branch). Input and output ``(batch, width)``.

    On the first stage the input needs no gradient, so both waits sit on the weight branch: its backward still takes
    ``t_i + t_w``, all of it in the weight-gradient half (torch runs stage 0's split backward whole in its ``W``).
    """

    def __init__(self, t_f: float, t_i: float, t_w: float, first: bool, width: int = _WIDTH) -> None:
        super().__init__()
        self.t_f, self.t_i, self.t_w, self.first = t_f, t_i, t_w, first
        self.w = nn.Parameter(torch.ones(width))

    def forward(self, x: Tensor) -> Tensor:
        time.sleep(self.t_f)
        w = _WaitInBackward.apply(self.w, self.t_w)
        if self.first:
            return x + _WaitInBackward.apply(w, self.t_i)
        return _WaitInBackward.apply(x, self.t_i) + w


def _mean(out: Tensor, target: Tensor) -> Tensor:
    return out.mean()


def torch_orders(engine: PipelineEngine) -> list[list[Entry]] | None:
    """Every pp rank's compute operations, in order, as torch's schedule runs them (the ``pipeline_order`` its runtime
    executes); ``None`` for the single-stage schedules, GPipe and 1F1B, which run :func:`build_order`'s orders (their
    ``pipeline_order`` is only a picture: torch 2.13's Schedule1F1B lists ``F1`` first on rank 1 of 2 and an ``F4`` of
    4 micro-batches)."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    schedule = next(s for k, s in engine._schedules.items() if k[0] == "train")
    if isinstance(schedule, PipelineScheduleSingle):
        return None
    order = schedule.pipeline_order
    out: list[list[Entry]] = []
    for rank in sorted(order):
        entries: list[Entry] = []
        for action in order[rank]:
            subs = action.sub_actions if action is not None and action.sub_actions else [action]
            ops = tuple((a.computation_type.value, a.stage_index, a.microbatch_index) for a in subs
                        if a is not None and a.computation_type.value in ("F", "B", "I", "W"))
            if len(ops) == 1:
                entries.append(ops[0])
            elif ops:  # an overlapped pair (DualPipeV): torch receives both inputs before it, sends both outputs after
                entries.append(ops)
        out.append(entries)
    return out


def expected_bubble(options: PipelineOptions, pp: int, orders: list[list[Entry]] | None) -> float:
    """The schedule's idle share for these stage costs: its action lists replayed on a clock (mean over ranks)."""
    v = int(options.virtual_stages)  # type: ignore[arg-type]
    if orders is None:
        orders = [[(a.kind, r, a.microbatch) for a in build_order(options.schedule, r, pp, options.num_microbatches)]
                  for r in range(pp)]

    def cost(kind: str, stage: int) -> float:
        first = stage == 0
        t = {"F": T_F, "B": T_I + T_W, "I": 0.0 if first else T_I, "W": T_I + T_W if first else T_W}[kind]
        return t / v

    return simulate_actions(orders, options.num_stages(pp), cost).mean_bubble


def _one_step(engine: PipelineEngine, x: Tensor, y: Tensor, group: dist.ProcessGroup) -> tuple[float, float, list[int]]:
    """One step: its measured bubble (mean over the pp ranks of idle / window), its time in seconds, and the most
    micro-batches each rank held."""
    start = time.perf_counter()
    engine.train_step((x,), y)
    elapsed = time.perf_counter() - start
    mine = torch.tensor(engine.history[-1].compact(), dtype=torch.float64)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    window = max(float(p[0]) for p in parts)
    return sum(1.0 - float(p[1]) / window for p in parts) / len(parts), elapsed, [int(p[2]) for p in parts]


def _summary(steps: list[tuple[float, float, list[int]]]) -> dict[str, Any]:
    """Medians over the steps after the first (which infers the stages' shapes)."""
    return {"bubble": statistics.median(s[0] for s in steps[1:]), "step_s": statistics.median(s[1] for s in steps[1:]),
            "peaks": steps[-1][2]}


def _fixed_worker(configs: list[tuple[str, int]], steps: int) -> list[dict[str, Any]]:
    init_process_group_from_env(timeout_s=300)
    p, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for schedule, m in configs:
        options = PipelineOptions(schedule=schedule, num_microbatches=m)
        v = int(options.virtual_stages)  # type: ignore[arg-type]
        ids = options.stage_ids(rank, p)
        modules = [FixedTimeStage(T_F / v, T_I / v, T_W / v, first=s == 0) for s in ids]
        engine = PipelineEngine(modules, ids, options, dist.group.WORLD, p, torch.device("cpu"), _mean)
        x = torch.ones(2 * m, _WIDTH)
        out = _summary([_one_step(engine, x, x, dist.group.WORLD) for _ in range(steps)])
        orders = torch_orders(engine)
        rows.append({"schedule": schedule, "pp": p, "m": m, "v": v, **out,
                     "simulated": expected_bubble(options, p, orders),
                     "closed": bubble_formula(p, m, v) if not SCHEDULES[schedule].splits_backward else None})
    return rows


def _gpt_worker(schedules: list[str], m: int, steps: int) -> list[dict[str, Any]]:
    from lightning_par.models import GPT, GPTConfig, GPTLightningModule
    from lightning_par.pipeline_parallel.split import cut_network, plan_split

    init_process_group_from_env(timeout_s=300)
    p, rank = dist.get_world_size(), dist.get_rank()
    config = GPTConfig(n_layer=8, n_head=4, n_embd=128, block_size=64, vocab_size=256)
    engines, measured = [], []
    for schedule in schedules:
        options = PipelineOptions(schedule=schedule, num_microbatches=m)
        torch.manual_seed(0)
        network = GPT(config)
        ids = options.stage_ids(rank, p)
        _, modules = cut_network(network, plan_split(network, options.num_stages(p)), ids)
        engines.append(PipelineEngine(modules, ids, options, dist.group.WORLD, p, torch.device("cpu"),
                                      GPTLightningModule.loss_fn))
        measured.append([])
    x = torch.randint(0, 256, (4 * m, config.block_size), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):  # round-robin, so that a change in the machine's load hits every schedule alike
        for engine, out in zip(engines, measured):
            out.append(_one_step(engine, x, x, dist.group.WORLD))
    return [{"schedule": s, "pp": p, "m": m, **_summary(out)} for s, out in zip(schedules, measured)]


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def run(quick: bool = False) -> str:
    """Measure and return the two markdown tables (about 2 minutes with ``quick``, 5 without)."""
    steps = 4 if quick else 8
    rows: list[dict[str, Any]] = []
    for p in (2, 4):
        configs = [(s, m) for m in (4, 8) for s in SCHEDULES
                   if not (s == "dualpipev" and m < 2 * p) and not (s == "1f1b" and m < p)]
        rows += run_distributed(_fixed_worker, p, (configs, steps), timeout_s=900)[0]
    gpt_rows = run_distributed(_gpt_worker, 2, (list(SCHEDULES), 8, steps + 1), timeout_s=900)[0]

    lines = [
        f"### Pipeline bubble on torch's engine: measured vs the schedule's formula (fixed-compute stages: per rank "
        f"and micro-batch F {T_F * 1e3:.0f} ms, I {T_I * 1e3:.0f} ms, W {T_W * 1e3:.0f} ms; median of {steps - 1} "
        f"steps)",
        "",
        _row(["schedule", "pp", "m", "chunks/rank", "measured bubble", "formula (replay)", "closed form",
              "measured - formula", "peak micro-batches held"]),
        _row(["---"] * 9),
    ]
    worst = 0.0
    for r in rows:
        diff = r["bubble"] - r["simulated"]
        worst = max(worst, abs(diff))
        closed = f"{r['closed']:.3f}" if r["closed"] is not None else "-"
        lines.append(_row([r["schedule"], r["pp"], r["m"], r["v"], f"{r['bubble']:.3f}", f"{r['simulated']:.3f}",
                           closed, f"{diff:+.3f}", "/".join(str(k) for k in r["peaks"])]))
    by = {(r["schedule"], r["pp"], r["m"]): r["bubble"] for r in rows}
    zb_below = [f"{s} pp{p} m{m}: {by[(s, p, m)]:.3f} < 1f1b {by[('1f1b', p, m)]:.3f}"
                for (s, p, m) in by if SCHEDULES[s].splits_backward and ("1f1b", p, m) in by]
    lines += ["", f"Largest |measured - formula|: {worst:.3f}. Zero-bubble schedules vs 1F1B at the same pp and m: "
              + "; ".join(zb_below) + ".", ""]
    lines += [
        "### Pipeline step time on the reference GPT (real arithmetic, pp = 2, m = 8)",
        "",
        _row(["schedule", "step time / gpipe", "measured bubble", "peak micro-batches held"]),
        _row(["---"] * 4),
    ]
    base = next(r["step_s"] for r in gpt_rows if r["schedule"] == "gpipe")
    for r in gpt_rows:
        lines.append(_row([r["schedule"], f"{r['step_s'] / base:.2f}", f"{r['bubble']:.3f}",
                           "/".join(str(k) for k in r["peaks"])]))
    lines += [
        "",
        "GPT: 8 blocks, n_embd 128, seq 64, 32 sequences per step, one process per stage on this CPU, the schedules "
        "taking turns step by step. Its bubble includes unequal stages (embedding first, head last) and contention "
        "for the CPU, and its ratios move with the machine's load.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv[1:]))
