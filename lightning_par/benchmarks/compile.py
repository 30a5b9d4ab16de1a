"""Benchmark rows for ``strategy.compile``: step time of the GPT presets compiled per block against eager, and the
first step's compile time, under dp2 (``ddp``), zero3 dp2, tp2 (+ sequence parallelism) and pp2 (1F1B).

For each layout (its own gloo world of 2 CPU processes) and each preset of :data:`~lightning_par.benchmarks.common.
GPT_SHAPES`, one launch builds the same seeded model twice through :func:`lightning_par.parallelize.parallelize`,
``compile`` off and on (``backend="inductor"``), and runs the two in turns, step by step
(:func:`~lightning_par.benchmarks.common.run_in_turns`: forward, backward, the dp reduction, an SGD step), so that a
change of load on a shared machine falls on both alike. Per row:

* **eager / compiled step**: median seconds of a step after the warm-up (the slowest rank's);
* **wall ratio**: compiled over eager wall time;
* **eager CPU**, **compiled CPU**, **compiled / eager (CPU time)**: the same in CPU seconds of the training thread (the
  largest over ranks), blind to time spent waiting for a core other jobs hold, so that it moves much less than wall time
  on a shared machine: the figure ``--runs 2`` compares. Both runs use one thread per process
  (``torch.set_num_threads(1)``), so the kernels run on the thread measured;
* **first compiled step**: wall seconds of the compiled model's first step, which compiles every graph (inductor
  generates and builds C++ on CPU); **compile** is that minus a compiled step. Inductor's on-disk caches are off, so
  every run compiles from scratch;
* **graphs / breaks**: dynamo's counters for the compiled model (:class:`lightning_par.compile.CompileStats`).

On a shared 2-core CPU machine absolute times are noisy: read the ratios. The speed a GPU gains (fused kernels, fewer
launches) is a GPU question; here inductor fuses the elementwise chains (GELU, layer norm, residual adds) into C++
loops.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["LAYOUTS", "run"]

#: This benchmark's section in ``recipes/benchmark.py`` (``--only compile``) and its place in the full run.
SECTION = "compile"
ORDER = 75

#: label -> strategy options (world 2 each)
LAYOUTS: dict[str, dict[str, Any]] = {
    "dp2": {"dp_mode": "ddp"},
    "zero3 dp2": {"dp_mode": "zero3"},
    "tp2 + SP": {"tp_size": 2, "sequence_parallel": True},
    "pp2 1F1B m=2": {"pp_size": 2, "schedule": "1f1b", "num_microbatches": 2},
}
_FULL = dict(presets=("tiny", "small"), batch=8, steps=20, warmup=3)
_QUICK = dict(presets=("small",), batch=8, steps=16, warmup=2)


def _worker(shape: dict[str, int], batch: int, steps: int, warmup: int, options: dict[str, Any]) -> dict[str, Any]:
    import os

    import torch

    from lightning_par.benchmarks.common import Contender, run_in_turns, token_batches
    from lightning_par.compat import compile_caches_off
    from lightning_par.launcher import init_process_group_from_env
    from lightning_par.models import GPTConfig, GPTLightningModule
    from lightning_par.parallel_dims import ParallelDims
    from lightning_par.parallelize import ParallelOptions, parallelize

    init_process_group_from_env(timeout_s=900)
    torch.set_num_threads(1)
    compile_caches_off()  # every run compiles from scratch: compile times comparable
    world = int(os.environ["WORLD_SIZE"])
    sizes = {k: options[k] for k in ("tp_size", "pp_size") if k in options}
    rest = {k: v for k, v in options.items() if k not in sizes}
    dims = ParallelDims(world_size=world, **sizes)
    dp_rank = dims.coordinates(torch.distributed.get_rank())["dp"] if dims.dp_enabled else 0
    micro = batch // dims.dp_size
    batches = token_batches(4, micro, shape["block_size"], shape["vocab_size"], seed=dp_rank)

    def contender(compiled: bool) -> Contender:
        torch.manual_seed(0)
        module = GPTLightningModule(GPTConfig(**shape, dropout=0.0))
        parallel = parallelize(
            module, dims, ParallelOptions.build(compile={"enabled": compiled, "backend": "inductor"}, **rest),
            device=torch.device("cpu"),
        )
        opt = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=1e-3, momentum=0.9)

        def step(i: int) -> None:
            x, y = batches[i % len(batches)]
            if parallel.pipeline is not None:
                parallel.pipeline.train_step((x,), y)
            else:
                with parallel.loss_context():
                    loss = module.loss_fn(parallel.network(x), y)
                    parallel.engine.pre_backward()
                    loss.backward()
                parallel.engine.post_backward()
            parallel.finish_gradients()
            opt.step()
            opt.zero_grad(set_to_none=True)

        c = Contender("compiled" if compiled else "eager", step)
        c.extra["parallel"] = parallel
        return c

    eager, compiled = contender(False), contender(True)
    firsts = {}
    for c in (eager, compiled):  # the first step alone: the compiled one compiles every graph
        torch.distributed.barrier()
        start = time.perf_counter()
        c.step(0)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
        firsts[c.name] = float(elapsed)
    run_in_turns([eager, compiled], steps, warmup)
    summary = compiled.extra["parallel"].summary()
    return {
        "eager_s": eager.median_s, "compiled_s": compiled.median_s, "eager_cpu_s": eager.median_cpu_s,
        "compiled_cpu_s": compiled.median_cpu_s, "first_compiled_s": firsts["compiled"],
        "first_eager_s": firsts["eager"], "graphs": summary.get("compile_graphs"),
        "breaks": summary.get("compile_graph_breaks"), "blocks": summary.get("compiled_blocks"),
    }


def run(quick: bool = False) -> str:
    """Measure every layout x preset, eager and compiled side by side, and return the markdown table.

    Args:
        quick: one preset (``small``), fewer steps.

    Returns:
        A markdown table, one row per (layout, preset).
    """
    from lightning_par.benchmarks.common import GPT_SHAPES
    from lightning_par.launcher import run_distributed

    spec = _QUICK if quick else _FULL
    lines = [
        f"torch.compile per block (inductor) vs eager, GPT presets (seq {GPT_SHAPES['tiny']['block_size']}), global "
        f"batch {spec['batch']}, fp32, SGD, 2 CPU processes (gloo); medians of {spec['steps']} steps in turns after "
        f"{spec['warmup']} warm-up.",
        "",
        "| layout | preset | eager step (ms) | compiled step (ms) | wall ratio | eager CPU (ms) | compiled CPU (ms) | "
        "compiled / eager (CPU time) | first compiled step (s) | compile (s) | blocks/rank | graphs | breaks |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, options in LAYOUTS.items():
        for preset in spec["presets"]:
            r = run_distributed(_worker, 2, (GPT_SHAPES[preset], spec["batch"], spec["steps"], spec["warmup"],
                                             options), timeout_s=1800)[0]
            lines.append(
                f"| {label} | {preset} | {r['eager_s'] * 1e3:.1f} | {r['compiled_s'] * 1e3:.1f} | "
                f"{r['compiled_s'] / r['eager_s']:.2f} | {r['eager_cpu_s'] * 1e3:.1f} | "
                f"{r['compiled_cpu_s'] * 1e3:.1f} | {r['compiled_cpu_s'] / r['eager_cpu_s']:.2f} | "
                f"{r['first_compiled_s']:.1f} | "
                f"{r['first_compiled_s'] - r['compiled_s']:.1f} | {r['blocks']} | {r['graphs']} | {r['breaks']} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one preset, fewer steps")
    print(run(quick=parser.parse_args().quick))
