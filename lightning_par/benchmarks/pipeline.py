"""Pipeline benchmark: the measured bubble against ``(p - 1) / (m + p - 1)``, and the step time of the schedules.

    python -m lightning_par.benchmarks.pipeline [--quick]

Two tables, each from one run of the project's own runner (:class:`~lightning_par.pipeline_parallel.PipelineRunner`)
and bubble accounting (:func:`~lightning_par.pipeline_parallel.summarize_bubble`), the code the strategy uses:

1. **Bubble.** Every stage has the same, fixed compute: its forward takes ``T_FORWARD_S`` and its backward
   ``T_BACKWARD_S`` (the stage waits that long: several pipeline processes share this machine's two cores, so real
   arithmetic would measure CPU contention, not the schedule). For ``pp`` in {2, 4} and ``m`` in {1, 2, 4, 8}, GPipe
   and 1F1B, the idle share of each step (mean over stages, over the measured steps) is set beside the formula.
   What remains between the two is communication latency and Python overhead on the critical path. Each figure
   is the median over the measured steps of the step's bubble (the machine is shared; a step delayed by another job
   would measure that job).
2. **Step time.** GPipe vs 1F1B vs interleaved 1F1B (2 chunks per rank, each half a stage's time) at ``m = 8``: step
   time relative to GPipe, bubble, and the most micro-batches whose activations one stage held. Then the same three
   schedules on the reference GPT with real arithmetic at ``pp = 2``, each also run by torch's own
   ``torch.distributed.pipelining`` schedule (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``) on
   the same stage modules and batch, taking turns with ours.
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
from lightning_par.pipeline_parallel.bubble import summarize_bubble
from lightning_par.pipeline_parallel.runner import PipelineRunner
from lightning_par.pipeline_parallel.schedules import bubble_formula, stage_ids

__all__ = ["FixedTimeStage", "run"]

#: Seconds of one stage's forward / backward for one micro-batch in the fixed-compute runs.
T_FORWARD_S = 0.040
T_BACKWARD_S = 0.080
_WIDTH = 64


class _WaitInBackward(torch.autograd.Function):
    """Identity whose backward takes ``seconds`` (the backward half of :class:`FixedTimeStage`)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, seconds: float) -> Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class FixedTimeStage(nn.Module):
    """A stage whose forward takes ``t_forward`` and whose backward takes ``t_backward`` seconds, whatever the CPU
    load: ``x -> x * w`` plus a wait. Input and output ``(batch, width)``."""

    def __init__(self, t_forward: float, t_backward: float, width: int = _WIDTH) -> None:
        super().__init__()
        self.t_forward, self.t_backward = t_forward, t_backward
        self.w = nn.Parameter(torch.ones(width))

    def forward(self, x: Tensor) -> Tensor:
        time.sleep(self.t_forward)
        return _WaitInBackward.apply(x * self.w, self.t_backward)


def _mean_loss(out: Tensor, target: Tensor) -> Tensor:
    return out.mean()


def _summarize(runner: PipelineRunner, step_times: list[float]) -> dict[str, Any]:
    """Gather every stage's step records (first step left out) and summarise them on every rank."""
    records = [r.compact() for r in runner.history[1:]]
    per_stage: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_stage, records)
    out = summarize_bubble(per_stage)
    # Median over steps: this machine is shared, and a step that another job delays says nothing about the schedule.
    out["pp_bubble"] = statistics.median(
        summarize_bubble([[stage[i]] for stage in per_stage])["pp_bubble"] for i in range(len(records))
    )
    out["step_s"] = statistics.median(step_times[1:])
    return out


def _fixed_worker(configs: list[tuple[str, int, int]], steps: int) -> list[dict[str, Any]]:
    init_process_group_from_env(timeout_s=120)
    rank, p = dist.get_rank(), dist.get_world_size()
    rows = []
    for schedule, m, v in configs:
        chunks = [FixedTimeStage(T_FORWARD_S / v, T_BACKWARD_S / v) for _ in range(v)]
        runner = PipelineRunner(chunks, rank, p, None, schedule, m, _mean_loss)
        x, y = torch.ones(2 * m, _WIDTH), torch.zeros(2 * m, 1)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            runner.train_step(x, y)
            dist.barrier()
            times.append(time.perf_counter() - start)
        rows.append({"schedule": schedule, "pp": p, "m": m, "v": v, **_summarize(runner, times)})
    return rows


def _torch_schedule(chunks: list[nn.Module], ids: list[int], p: int, v: int, schedule: str, m: int) -> Any:
    """torch.distributed.pipelining's own schedule over the same stage modules."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    from lightning_par.models import GPTLightningModule

    stages = [PipelineStage(chunk, sid, p * v, torch.device("cpu")) for chunk, sid in zip(chunks, ids)]
    loss = GPTLightningModule.loss_fn
    if schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=loss)
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    return cls(stages[0], n_microbatches=m, loss_fn=loss)


def _gpt_worker(schedules: list[tuple[str, int]], m: int, steps: int) -> dict[str, list[dict[str, Any]]]:
    """The GPT at pp ``p`` with real arithmetic: this project's runner and torch's own schedules, taking turns."""
    from lightning_par.models import GPT, GPTConfig, GPTLightningModule
    from lightning_par.pipeline_parallel.split import cut_network, plan_split

    init_process_group_from_env(timeout_s=300)
    rank, p = dist.get_rank(), dist.get_world_size()
    config = GPTConfig(n_layer=8, n_head=4, n_embd=128, block_size=64, vocab_size=256)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (4 * m, config.block_size), generator=g)
    y = torch.randint(0, 256, (4 * m, config.block_size), generator=g)
    runners, torch_steps = [], []
    for schedule, v in schedules:
        for own in (True, False):
            torch.manual_seed(0)
            gpt = GPT(config)
            ids = stage_ids(rank, p, v)
            _, chunks = cut_network(gpt, plan_split(gpt, p * v), ids)
            if own:
                runners.append(PipelineRunner(chunks, rank, p, None, schedule, m, GPTLightningModule.loss_fn))
                continue
            sched = _torch_schedule(chunks, ids, p, v, schedule, m)
            params = [q for c in chunks for q in c.parameters()]
            first, last = 0 in ids, p * v - 1 in ids

            def step(sched: Any = sched, params: list = params, first: bool = first, last: bool = last) -> None:
                args = (x,) if first else ()
                sched.step(*args, **({"target": y} if last else {}))
                for q in params:
                    q.grad = None

            torch_steps.append(step)
    times: list[list[float]] = [[] for _ in runners]
    torch_times: list[list[float]] = [[] for _ in torch_steps]
    for _ in range(steps):  # round-robin, so that a change in the machine's load hits every schedule alike
        for runner, t, tstep, tt in zip(runners, times, torch_steps, torch_times):
            start = time.perf_counter()
            runner.train_step(x, y)
            dist.barrier()
            t.append(time.perf_counter() - start)
            start = time.perf_counter()
            tstep()
            dist.barrier()
            tt.append(time.perf_counter() - start)
    ours = [
        {"schedule": schedule, "pp": p, "m": m, "v": v, **_summarize(runner, t)}
        for (schedule, v), runner, t in zip(schedules, runners, times)
    ]
    theirs = [
        {"schedule": schedule, "pp": p, "m": m, "v": v, "step_s": statistics.median(t[1:])}
        for (schedule, v), t in zip(schedules, torch_times)
    ]
    return {"ours": ours, "torch": theirs}


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def run(quick: bool = False) -> str:
    """Measure and return the two markdown tables (about a minute with ``quick``, 3 minutes without)."""
    steps = 4 if quick else 10
    ms = (1, 2, 4, 8)
    bubble_rows: list[dict[str, Any]] = []
    time_rows: list[dict[str, Any]] = []
    for p in (2, 4):
        configs = [(s, m, 1) for m in ms for s in ("gpipe", "1f1b")] + [("interleaved_1f1b", 8, 2)]
        rows = run_distributed(_fixed_worker, p, (configs, steps), timeout_s=600)[0]
        bubble_rows += rows[:-1]
        time_rows += [r for r in rows if r["m"] == 8]
    gpt = run_distributed(
        _gpt_worker, 2, ([("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)], 8, steps + 1), timeout_s=900
    )[0]
    gpt_rows = gpt["ours"]

    lines = [
        f"### Pipeline bubble: measured vs (p-1)/(m+p-1) (fixed-compute stages: forward {T_FORWARD_S * 1e3:.0f} ms, "
        f"backward {T_BACKWARD_S * 1e3:.0f} ms; median of {steps - 1} measured steps)",
        "",
        _row(["schedule", "pp", "m", "measured bubble", "formula", "measured - formula", "peak micro-batches held"]),
        _row(["---"] * 7),
    ]
    worst = 0.0
    for r in bubble_rows:
        f = bubble_formula(r["pp"], r["m"], r["v"])
        worst = max(worst, abs(r["pp_bubble"] - f))
        peaks = "/".join(str(k) for k in r["pp_peak_microbatches_in_flight"])
        lines.append(_row([r["schedule"], r["pp"], r["m"], f"{r['pp_bubble']:.3f}", f"{f:.3f}",
                           f"{r['pp_bubble'] - f:+.3f}", peaks]))
    lines += ["", f"Largest |measured - formula|: {worst:.3f}.", ""]
    lines += [
        "### Pipeline step time: gpipe vs 1f1b vs interleaved_1f1b (m = 8)",
        "",
        _row(["stages", "schedule", "pp", "chunks/rank", "step time / gpipe", "measured bubble", "formula",
              "peak micro-batches held"]),
        _row(["---"] * 8),
    ]
    for label, rows in (("fixed compute", time_rows), ("GPT, real compute", gpt_rows)):
        base = {r["pp"]: r["step_s"] for r in rows if r["schedule"] == "gpipe"}
        for r in rows:
            f = bubble_formula(r["pp"], r["m"], r["v"])
            peaks = "/".join(str(k) for k in r["pp_peak_microbatches_in_flight"])
            lines.append(_row([label, r["schedule"], r["pp"], r["v"], f"{r['step_s'] / base[r['pp']]:.2f}",
                               f"{r['pp_bubble']:.3f}", f"{f:.3f}", peaks]))
    lines += [
        "",
        "GPT: 8 blocks, n_embd 128, seq 64, 32 sequences per step, pp = 2 (one process per stage on this CPU), the "
        "three schedules taking turns step by step. Its bubble includes unequal stages (embedding first, head last) "
        "and contention for the CPU, and its ratios move with the machine's load.",
        "",
        "### Pipeline step time against torch.distributed.pipelining's own schedules (same GPT, stages and batch, "
        "pp = 2, m = 8, taking turns step by step)",
        "",
        _row(["schedule", "chunks/rank", "this project's runner (ms)", "torch's schedule (ms)", "ours / torch"]),
        _row(["---"] * 5),
    ]
    for ours, theirs in zip(gpt["ours"], gpt["torch"]):
        lines.append(_row([ours["schedule"], ours["v"], f"{ours['step_s'] * 1e3:.1f}", f"{theirs['step_s'] * 1e3:.1f}",
                           f"{ours['step_s'] / theirs['step_s']:.3f}"]))
    return "\n".join(lines)


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv[1:]))
