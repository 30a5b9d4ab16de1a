"""Benchmark rows for data parallelism: ``ddp_overlap``'s reducer against torch DDP, what overlap hides, and the cost
under Lightning.

Two tables, both from one launch of ``world_size`` ranks (CPU, gloo, the ``small`` GPT, fp32 AdamW, the same data):

1. **Engines, and what overlap hides** (contenders in turns step by step,
   :func:`~lightning_par.benchmarks.common.run_in_turns`): torch ``DistributedDataParallel``; the
   :class:`~lightning_par.data_parallel.reducer.GradientReducer` that ``ddp_overlap`` runs, overlapped (buckets
   all-reduced as backward produces them), also with ``gradient_as_bucket_view=True`` (the gradients become views of
   the buckets: one copy per parameter per step less); the same reducer reducing only after backward (``no_sync`` during
   backward, then ``reduce_all``); and the same with no communication at all (``no_sync`` and no reduction: the
   compute alone). Then ``after - overlapped`` is the communication time overlap actually hid,
   ``overlapped - none`` the communication time left exposed, and ``after - none`` all of it. The live figures the
   strategy logs are printed beside them: ``comm_exposed_s`` (the wait after backward, measured each step) and
   ``comm_latency_share_before_backward_end`` (how much of the buckets' latency elapsed before backward ended; not
   time saved: on a CPU the collectives and backward share the cores, so a bucket "in flight" during backward may
   just slow backward down).
2. **Under Lightning**: a raw torch DDP loop, Lightning's ``DDPStrategy`` and ``ddp_overlap`` (with its default
   ``gradient_as_bucket_view=True``, and with ``False``, ``DDPStrategy``'s default), each a ``Trainer.fit``
   of a few steps, in rounds (raw, Lightning, ours, raw, ...) so that drift in the machine's load reaches all three;
   the median over every measured step of every round. Step ratios to Lightning's ``DDPStrategy`` and to the raw
   loop.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from lightning_par.benchmarks.common import GPT_SHAPES, Contender, run_in_turns, token_batches

__all__ = ["StepTimer", "run"]

#: This benchmark's section in ``recipes/benchmark.py`` (``--only ddp``) and its place in the full run.
SECTION = "ddp"
ORDER = 10

_SHAPE = GPT_SHAPES["small"]
_MICRO_BATCH = 8
_BUCKET_CAP_MB = 1.0
_QUICK = dict(steps=25, warmup=3, rounds=4, fit_steps=14, fit_warmup=4)
_FULL = dict(steps=60, warmup=5, rounds=8, fit_steps=25, fit_warmup=5)


class StepTimer(L.Callback):
    """Wall time (``times``) and the training thread's CPU time (``cpu_times``) of each training batch, seconds; and
    the same for each stretch between two of Lightning's hooks within the batch (``phases``: one dict per batch,
    ``"hook -> next hook"`` to ``(wall_s, cpu_s)``). With one optimizer and no accumulation the stretches are: forward
    (batch start -> ``on_before_zero_grad``), ``zero_grad`` (-> ``on_before_backward``), backward and the end of the
    dp reduction (-> ``on_after_backward``: ``DDPStrategy`` waits for its last buckets inside backward, ``ddp_overlap``
    right after it, both before that hook), the closure's return (-> ``on_before_optimizer_step``) and the optimizer
    step (-> batch end).
    ``between`` holds ``(wall_s, cpu_s)`` from one batch's end to the next batch's start: outside the step window, the
    loader's next batch and Lightning's loop between batches (which, in a multi-process run, includes a broadcast of
    its SIGTERM flag from rank 0 every batch)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.phases: list[dict[str, tuple[float, float]]] = []
        self.between: list[tuple[float, float]] = []
        self._marks: list[tuple[str, float, float]] = []

    def _mark(self, name: str) -> None:
        self._marks.append((name, time.perf_counter(), time.thread_time()))

    def on_train_batch_start(self, *args: Any) -> None:
        previous_end = self._marks[-1] if self._marks else None
        self._marks = []
        self._mark("start")
        if previous_end is not None:
            (_, t0, c0), (_, t1, c1) = previous_end, self._marks[0]
            self.between.append((t1 - t0, c1 - c0))

    def on_before_zero_grad(self, *args: Any) -> None:
        self._mark("on_before_zero_grad")

    def on_before_backward(self, *args: Any) -> None:
        self._mark("on_before_backward")

    def on_after_backward(self, *args: Any) -> None:
        self._mark("on_after_backward")

    def on_before_optimizer_step(self, *args: Any) -> None:
        self._mark("on_before_optimizer_step")

    def on_train_batch_end(self, *args: Any) -> None:
        self._mark("end")
        (_, t0, c0), (_, t1, c1) = self._marks[0], self._marks[-1]
        self.times.append(t1 - t0)
        self.cpu_times.append(c1 - c0)
        self.phases.append({f"{a} -> {b}": (tb - ta, cb - ca)
                            for (a, ta, ca), (b, tb, cb) in zip(self._marks, self._marks[1:])})


def _gpt() -> torch.nn.Module:
    from lightning_par.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(**_SHAPE, dropout=0.0))


def _loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    from lightning_par.models import GPTLightningModule

    return GPTLightningModule.loss_fn(model(batch[0]), batch[1])


def _engine_contenders(batches: list, group: Any) -> tuple[list[Contender], Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_par.data_parallel.reducer import GradientReducer

    ddp = DDP(_gpt(), process_group=group, bucket_cap_mb=_BUCKET_CAP_MB)
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)

    def torch_ddp(i: int) -> None:
        _loss(ddp, batches[i % len(batches)]).backward()
        ddp_opt.step()
        ddp_opt.zero_grad(set_to_none=True)

    def reducer_step(mode: str, as_view: bool = False) -> tuple[Any, Any]:
        model = _gpt()
        reducer = GradientReducer(list(model.parameters()), group, bucket_cap_mb=_BUCKET_CAP_MB,
                                  gradient_as_bucket_view=as_view)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(i: int) -> None:
            loss = _loss(model, batches[i % len(batches)])
            if mode == "overlapped":
                reducer.start_backward()
                loss.backward()
                reducer.finish()
            else:
                with reducer.no_sync():
                    loss.backward()
                if mode == "after":
                    reducer.reduce_all()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step, reducer

    overlapped, reducer = reducer_step("overlapped")
    as_view, _ = reducer_step("overlapped", as_view=True)
    after, _ = reducer_step("after")
    none, _ = reducer_step("none")
    contenders = [
        Contender("torch DDP", torch_ddp),
        Contender("ddp_overlap reducer, overlapped", overlapped),
        Contender("the same, gradient_as_bucket_view=True", as_view),
        Contender("reducer, reduce after backward", after),
        Contender("reducer, no communication", none),
    ]
    return contenders, reducer


def _fit(mode: str, setup: dict[str, Any], env: dict[str, str]) -> dict[str, list]:
    """One fit of ``setup["fit_steps"]`` batches; per measured batch: ``wall``/``cpu`` seconds of the step,
    ``phases`` (stretches between Lightning's hooks, empty for the raw loop) and ``between`` (wall seconds from the
    previous batch's end to this batch's start: the loader, and Lightning's loop between batches)."""
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from lightning_par.models import GPTConfig, GPTLightningModule
    from lightning_par.strategies import DDPOverlapStrategy

    os.environ.update(env)  # Lightning's environment teardown removes WORLD_SIZE after a fit
    world, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
    steps = setup["fit_steps"]
    xs, ys = zip(*token_batches(steps * world, _MICRO_BATCH, _SHAPE["block_size"], _SHAPE["vocab_size"]))
    data = TensorDataset(torch.cat(xs), torch.cat(ys))
    loader = DataLoader(data, batch_size=_MICRO_BATCH, sampler=DistributedSampler(data, world, rank, shuffle=False))
    if mode == "raw torch DDP":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(_gpt(), bucket_cap_mb=_BUCKET_CAP_MB)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        times, cpu, between = [], [], []
        end = None
        for batch in loader:
            start, cpu_start = time.perf_counter(), time.thread_time()
            if end is not None:
                between.append(start - end)
            _loss(model, batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            end = time.perf_counter()
            times.append(end - start)
            cpu.append(time.thread_time() - cpu_start)
        w = setup["fit_warmup"]
        return {"wall": times[w:], "cpu": cpu[w:], "phases": [], "between": between[max(w - 1, 0) :], "sigterm": []}
    torch.manual_seed(0)
    module = GPTLightningModule(GPTConfig(**_SHAPE, dropout=0.0), learning_rate=1e-3)
    strategy = (
        DDPStrategy(bucket_cap_mb=_BUCKET_CAP_MB)
        if mode == "Lightning DDPStrategy"
        else DDPOverlapStrategy(bucket_cap_mb=_BUCKET_CAP_MB, timeout_s=300,
                                **({"gradient_as_bucket_view": False} if mode.endswith("=False") else {}))
    )
    timer = StepTimer()
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, limit_val_batches=0, callbacks=[timer],
    )
    sigterm = _time_sigterm_broadcast(trainer)
    trainer.fit(module, loader)
    w = setup["fit_warmup"]
    return {"wall": timer.times[w:], "cpu": timer.cpu_times[w:], "phases": timer.phases[w:],
            "between": [wall for wall, _ in timer.between[max(w - 1, 0) :]], "sigterm": sigterm[w:]}


def _time_sigterm_broadcast(trainer: L.Trainer) -> list[float]:
    """Wall seconds of each call of the broadcast of the SIGTERM flag that Lightning's training epoch loop makes
    before every batch of a multi-process run (``_broadcast_sigterm_tensor``, a private method: where this Lightning
    has none, the list stays empty and the table prints ``-``)."""
    from lightning_par.compat.lightning import set_sigterm_broadcast, sigterm_broadcast

    broadcast = sigterm_broadcast(trainer)
    times: list[float] = []
    if broadcast is None:
        return times

    def timed() -> None:
        start = time.perf_counter()
        try:
            broadcast()
        finally:
            times.append(time.perf_counter() - start)

    set_sigterm_broadcast(trainer, timed)
    return times


_FITS = ("raw torch DDP", "Lightning DDPStrategy", "ddp_overlap", "ddp_overlap, gradient_as_bucket_view=False")


def _worker(setup: dict[str, Any]) -> dict[str, Any]:
    from lightning_par.launcher import init_process_group_from_env

    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: os.environ[k] for k in names}
    init_process_group_from_env(timeout_s=600)
    rank = dist.get_rank()
    batches = token_batches(setup["steps"] + setup["warmup"], _MICRO_BATCH, _SHAPE["block_size"],
                            _SHAPE["vocab_size"], seed=rank)
    contenders, reducer = _engine_contenders(batches, dist.group.WORLD)
    run_in_turns(contenders, setup["steps"], setup["warmup"])
    out: dict[str, Any] = {"engines": {c.name: c.times for c in contenders}, "live": reducer.overlap_summary(),
                           "engines_cpu_s": {c.name: c.cpu_times for c in contenders}}
    del contenders, reducer
    keys = ("wall", "cpu", "phases", "between", "sigterm")
    fits: dict[str, dict[str, list]] = {k: {m: [] for m in _FITS} for k in keys}
    for _ in range(setup["rounds"]):
        for mode in _FITS:
            got = _fit(mode, setup, env)
            for k in keys:
                fits[k][mode] += got[k]
    out["fits"], out["fits_cpu"], out["phases"], out["between"], out["sigterm"] = (fits[k] for k in keys)
    return out


def _phase_table(phases: dict[str, list[dict]]) -> list[str]:
    """Median wall / CPU milliseconds of each stretch between Lightning's hooks, per loop that has hooks."""
    loops = {m: steps for m, steps in phases.items() if steps}
    names: list[str] = []
    for steps in loops.values():
        for step in steps:
            names += [n for n in step if n not in names]
    lines = ["| stretch (wall / CPU, ms) | " + " | ".join(loops) + " |", "|---|" + "---:|" * len(loops)]
    for n in names:
        cells = []
        for steps in loops.values():
            got = [s[n] for s in steps if n in s]
            wall, cpu = (statistics.median(x) * 1e3 for x in zip(*got)) if got else (None, None)
            cells.append(f"{wall:.2f} / {cpu:.2f}" if got else "-")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return lines


def run(quick: bool = False, world_size: int = 2) -> str:
    """Measure and return the markdown tables (see the module docstring).

    Args:
        quick: 25 measured engine steps and 4 rounds of 14-step fits (60 and 8 rounds of 25 without).
        world_size: processes (all data-parallel).
    """
    from lightning_par.launcher import run_distributed

    setup = _QUICK if quick else _FULL
    res = run_distributed(_worker, world_size, (setup,), timeout_s=1800, threads_per_rank=1)
    r0 = res[0]
    med = {n: statistics.median(t) for n, t in r0["engines"].items()}
    cpu = {n: statistics.median(t) for n, t in r0["engines_cpu_s"].items()}
    base = med["torch DDP"]
    lines = [
        f"### Data parallel engines, world size {world_size} (CPU, gloo), GPT small "
        f"({_SHAPE['n_layer']}x{_SHAPE['n_embd']}), micro-batch {_MICRO_BATCH}x{_SHAPE['block_size']} per rank, "
        f"bucket_cap_mb={_BUCKET_CAP_MB}; median of {setup['steps']} steps, contenders in turns",
        "",
        "| engine | median step, wall (ms) | wall / torch DDP | median step, CPU (ms) | CPU / torch DDP |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, m in med.items():
        lines.append(f"| {name} | {m * 1e3:.1f} | {m / base:.3f} | {cpu[name] * 1e3:.1f} | "
                     f"{cpu[name] / cpu['torch DDP']:.3f} |")
    over, after, none = (med["ddp_overlap reducer, overlapped"], med["reducer, reduce after backward"],
                         med["reducer, no communication"])
    live = r0["live"]
    lines += [
        "",
        "| what overlap does (A/B in this run) | ms per step |",
        "|---|---:|",
        f"| communication, reduced after backward (after - none) | {(after - none) * 1e3:.1f} |",
        f"| hidden by overlapping (after - overlapped) | {(after - over) * 1e3:.1f} |",
        f"| still exposed when overlapped (overlapped - none) | {(over - none) * 1e3:.1f} |",
        f"| live `comm_exposed_s`: wait after backward, median | {live['comm_exposed_s'] * 1e3:.1f} |",
        "",
        f"Live `comm_latency_share_before_backward_end` (formerly `comm_overlap_fraction`): "
        f"{live['comm_latency_share_before_backward_end']:.3f} of the buckets' latency elapsed before backward "
        "ended; the time it saved is the 'hidden' row above.",
    ]
    fits = {m: statistics.median(t) for m, t in r0["fits"].items()}
    fits_cpu = {m: statistics.median(t) for m, t in r0["fits_cpu"].items()}
    lines += [
        "",
        f"### Under Lightning, world size {world_size}: {setup['rounds']} rounds of {setup['fit_steps']}-step fits "
        f"(first {setup['fit_warmup']} of each left out), median step",
        "",
        "| loop | median step, wall (ms) | wall / raw torch DDP | wall / Lightning DDPStrategy | "
        "median step, CPU (ms) | CPU / raw torch DDP | CPU / Lightning DDPStrategy | between steps, wall (ms) | "
        "of which Lightning's SIGTERM broadcast (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    between = {m: statistics.median(t) for m, t in r0["between"].items()}
    sigterm = {m: f"{statistics.median(t) * 1e3:.2f}" if t else "-" for m, t in r0["sigterm"].items()}
    for name, m in fits.items():
        c = fits_cpu[name]
        lines.append(f"| {name} | {m * 1e3:.1f} | {m / fits['raw torch DDP']:.3f} | "
                     f"{m / fits['Lightning DDPStrategy']:.3f} | {c * 1e3:.1f} | "
                     f"{c / fits_cpu['raw torch DDP']:.3f} | {c / fits_cpu['Lightning DDPStrategy']:.3f} | "
                     f"{between[name] * 1e3:.2f} | {sigterm[name]} |")
    lines += [
        "",
        "The step is timed from Lightning's `on_train_batch_start` to its `on_train_batch_end` (the raw loop: from "
        "its batch in hand to the end of `zero_grad`). 'Between steps' is the rest of each iteration: the loader's "
        "next batch, and under Lightning its loop between batches, which in a multi-process run includes a "
        "broadcast of its SIGTERM flag from rank 0 every batch (timed by wrapping the loop's method; figures of "
        "rank 0). Both Lightning loops pay it; no ratio above includes it.",
        "",
        "Phase by phase under Lightning (the same fits; medians of each stretch between two of Lightning's hooks, so "
        "the stretches of one loop need not add up to its median step):",
        "",
        *_phase_table(r0["phases"]),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    print(run(quick=parser.parse_args().quick))
