"""Benchmark rows for context parallelism: activation bytes per rank, step time and bytes sent, cp 1 vs 2 vs 4.

For the reference GPT at a sequence long enough that activations dominate the step's memory, one process on the
whole sequence (``cp1``, the plain model) against the sequence split over 2 and 4 gloo ranks on CPU
(:func:`lightning_par.parallelize.parallelize` with ``cp_size`` = the world, ``dp_size=1``), with ring and all-to-all
(Ulysses) attention. Each cp size is one launch in which the contenders take turns step by step: ``cp1`` on rank 0
alone (the other ranks wait at a barrier), then each method on every rank. Every figure is per rank: bytes the
largest over the ranks, times the slowest rank's:

* **activation peak**: the most bytes of tensor storage alive at once during forward and backward (and, under cp,
  the gradient average over the cp ranks), less the model state alive at its start (parameters, gradients kept
  allocated between steps, the reducer's buckets): :class:`lightning_par.memory.StepMemoryTracker` on a step after
  the first. Deterministic. Memory inside a fused kernel (its tiles) is not a tensor and is not counted, in any row;
* **step time**: per step the slowest rank's wall seconds of forward + backward (under cp also the gradient
  all-reduce over the cp ranks), their median, against ``cp1`` timed in the same launch; and the training thread's
  CPU time likewise (it leaves out gloo's threads). cp 4 runs 4 processes: on a 2-core machine read its times as an
  upper bound, and every wall time under cp waits at each exchange for the other ranks, which a shared machine
  stretches;
* **sent per step**: bytes the cp attention's exchanges send to other ranks, forward + backward, counted in
  :data:`lightning_par.context_parallel.attention.COMM_BYTES_SENT` (every all-to-all of the attention, the rows a
  rank addresses to itself left out), against the formula below. Not counted: the all-gather of the token positions
  (``(cp - 1) S / cp`` int64 per layer) and the gradient all-reduce over the cp ranks (the dp axis's reducer).

Bytes each rank sends per step (``b`` batch, ``h`` heads, ``d`` head dim, ``s`` sequence, ``L`` layers, fp32):

* ring (Liu et al. 2023, "Ring Attention with Blockwise Transformers", §3): per layer, forward passes the rank's K/V
  block ``cp - 1`` times around the ring, ``(cp - 1) * 2bh(s/cp)d * 4`` bytes; backward, as in the paper, keeps no
  visiting block: the K/V blocks go around again and each block's dK/dV travels with it and back home,
  ``2 (cp - 1) * 2bh(s/cp)d * 4``. Keeping the visiting blocks instead (what autograd did before this section
  existed) sends only the dK/dV backward, ``(cp - 1) * 2bh(s/cp)d * 4``, at the price of ``2 s h d * 4`` bytes per
  layer per rank whatever ``cp``: here ~8% of one process's activations, which alone puts cp 4 above 0.30 of cp 1.
* all_to_all (Jacobs et al. 2023, "DeepSpeed Ulysses", §3): per layer, forward sends q, k, v (one all-to-all) and
  the output back (another): 4 tensors of ``bh(s/cp)d``, each all-to-all sending ``(cp - 1) / cp`` of its input,
  ``4 * bh(s/cp)d * 4 * (cp - 1) / cp`` bytes; backward the same again (the reverse exchanges of the gradients).

times ``L`` per step. The issue's target: activation peak at cp 2 and cp 4 at most 0.55 and 0.30 of cp 1. The ideal
is ``1 / cp`` (every activation here is per token); Ulysses keeps a little more, the attention output twice per
layer (head-split for the kernel's backward, sequence-split as the next layer's input).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

__all__ = ["GPU_CHECK_LAYOUTS", "LAYOUTS", "formula_bytes", "render", "run"]

#: This benchmark's section in ``recipes/benchmark.py`` (``--only cp``) and its place in the full run.
SECTION = "cp"
ORDER = 60

_FULL = dict(model=dict(n_layer=2, n_head=4, n_embd=64, block_size=2048, vocab_size=256), batch=1, steps=20)
_QUICK = dict(model=dict(_FULL["model"], block_size=1024), batch=1, steps=20)
#: cp size -> the methods measured in that launch (each launch also times the one-process baseline on its rank 0)
LAYOUTS: dict[int, tuple[str, ...]] = {2: ("ring", "all_to_all"), 4: ("ring", "all_to_all")}
BASELINE = "cp1"
#: The cp layouts of the GPU check's two-rank part (:data:`lightning_par.benchmarks.gpu_check.LAYOUTS`): one a method,
#: layout name -> (ranks, model, strategy registry name, options).
GPU_CHECK_LAYOUTS: dict[str, tuple[int, str, str, dict[str, Any]]] = {
    f"cp2-{method}": (2, "gpt", "parallel_3d", {"cp_size": 2, "method": method}) for method in LAYOUTS[2]
}
TARGETS = {2: 0.55, 4: 0.30}


def formula_bytes(method: str, cp: int, *, batch: int, n_head: int, seq: int, head_dim: int, n_layer: int,
                  elem_bytes: int = 4) -> tuple[int, int]:
    """``(forward, backward)`` bytes each cp rank sends per step for the attention of ``n_layer`` layers (the
    module docstring's formulas).

    Raises:
        ValueError: an unknown method, or sizes that do not split (``seq`` by ``cp``; ``n_head`` by ``cp`` for
            ``all_to_all``).
    """
    from lightning_par.context_parallel import comm_cost

    if cp < 1 or seq % cp:
        raise ValueError(f"seq={seq} does not split over cp={cp}")
    hidden = n_head * head_dim
    if method == "ring":
        forward = n_layer * comm_cost.ring_attention_forward_bytes(batch, seq, hidden, cp, 1, elem_bytes)
        return int(forward), int(2 * forward)
    if method == "all_to_all":
        if n_head % cp:
            raise ValueError(f"n_head={n_head} does not split over cp={cp}")
        forward = n_layer * comm_cost.ulysses_layer_bytes(batch, seq, hidden, cp, 1, elem_bytes) / 2
        return int(forward), int(forward)
    raise ValueError(f"method={method!r}: expected 'ring' or 'all_to_all'")


def _worker(model_cfg: dict, batch: int, steps: int, methods: tuple[str, ...]) -> dict[str, Any]:
    import os

    import torch
    import torch.distributed as dist

    from lightning_par.context_parallel.attention import COMM_BYTES_SENT
    from lightning_par.launcher import init_process_group_from_env
    from lightning_par.memory import StepMemoryTracker, model_state_tensors
    from lightning_par.models import GPTConfig, GPTLightningModule
    from lightning_par.parallel_dims import ParallelDims
    from lightning_par.parallelize import ParallelOptions, parallelize

    init_process_group_from_env(timeout_s=300)
    torch.set_num_threads(1)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, model_cfg["vocab_size"], (batch, model_cfg["block_size"]), generator=g)
    y = torch.randint(0, model_cfg["vocab_size"], (batch, model_cfg["block_size"]), generator=g)
    built: dict[str, Any] = {}
    if rank == 0:
        torch.manual_seed(0)
        built[BASELINE] = (GPTLightningModule(GPTConfig(**model_cfg)), None)
    for method in methods:
        torch.manual_seed(0)
        module = GPTLightningModule(GPTConfig(**model_cfg))
        dims = ParallelDims(world_size=world, dp_size=1, cp_size=world)
        parallel = parallelize(module, dims, ParallelOptions.build("ddp", method=method), device=torch.device("cpu"))
        built[method] = (module, parallel)
    contenders = [BASELINE, *methods]

    def step(name: str) -> None:
        """Forward and backward of the batch (under cp: this rank's piece, then the gradient average)."""
        module, parallel = built[name]
        module.zero_grad(set_to_none=False)  # gradients stay allocated: model state, not the step's
        if parallel is None:
            module.loss_fn(module(x), y).backward()
            return
        xs, ys, positions = parallel.prepare_batch((x, y))
        with parallel.loss_context():
            loss = module.loss_fn(module(xs, positions), ys)
            parallel.engine.pre_backward()
            loss.backward()
            parallel.engine.post_backward()

    out: dict[str, Any] = {name: {"wall": [], "cpu": []} for name in contenders}
    for name in contenders:
        dist.barrier()
        if name not in built:
            continue  # the one-process baseline runs on rank 0 alone
        step(name)  # the first step's one-off allocations (gradients, buckets) are not measured
        for phase in COMM_BYTES_SENT:
            COMM_BYTES_SENT[phase] = 0
        with StepMemoryTracker(model_state_tensors(built[name][0])) as measure:
            step(name)
        out[name].update(peak=measure.peak_bytes - measure.start_bytes, sent=dict(COMM_BYTES_SENT))
    for _ in range(steps):
        for name in contenders:  # in turns
            dist.barrier()
            if name not in built:
                continue
            t0, c0 = time.perf_counter(), time.thread_time()
            step(name)
            out[name]["wall"].append(time.perf_counter() - t0)
            out[name]["cpu"].append(time.thread_time() - c0)
    for name in methods:
        built[name][1].engine.remove()
    return out


def _collect(cp: int, methods: tuple[str, ...], per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of one launch: the baseline's (rank 0) and each method's; bytes the largest over the ranks, times the
    median over steps of the slowest rank's."""
    base = per_rank[0][BASELINE]
    rows = [{"layout": BASELINE, "method": "-", "cp": 1, "launch": cp, "peak": base["peak"], "sent": None,
             "wall_s": statistics.median(base["wall"]), "cpu_s": statistics.median(base["cpu"])}]
    for method in methods:
        ranks = [r[method] for r in per_rank]
        wall = [max(r["wall"][i] for r in ranks) for i in range(len(ranks[0]["wall"]))]
        cpu = [max(r["cpu"][i] for r in ranks) for i in range(len(ranks[0]["cpu"]))]
        rows.append({
            "layout": f"cp{cp}", "method": method, "cp": cp, "launch": cp,
            "peak": max(r["peak"] for r in ranks),
            "sent": {phase: max(r["sent"][phase] for r in ranks) for phase in ("forward", "backward")},
            "wall_s": statistics.median(wall), "cpu_s": statistics.median(cpu),
        })
    return rows


def render(rows: list[dict[str, Any]], cfg: dict[str, int], batch: int) -> str:
    """The markdown table of :func:`run` from its rows (see :func:`_collect`; each launch's ``cp1`` row is the
    baseline of that launch's other rows, and the first one is printed)."""
    head_dim = cfg["n_embd"] // cfg["n_head"]
    lines = [
        f"Context parallelism, GPT n_layer={cfg['n_layer']} n_head={cfg['n_head']} n_embd={cfg['n_embd']} "
        f"seq={cfg['block_size']} vocab={cfg['vocab_size']} batch={batch}, fp32, CPU/gloo; per rank (the largest "
        "over ranks); times against cp1 timed in the same launch (rank 0 alone, in turns).",
        "",
        "| layout | method | activation peak (bytes) | peak / cp1 | target | step wall (ms) | wall / cp1 | CPU / cp1 "
        "| sent per step, fwd + bwd (bytes) | formula, fwd + bwd (bytes) | measured / formula |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base: dict[int, dict[str, Any]] = {}
    for r in rows:
        if r["layout"] == BASELINE:
            if not base:
                lines.append(f"| {BASELINE} | - | {r['peak']} | 1.000 | - | {r['wall_s'] * 1e3:.1f} | 1.00 | 1.00 "
                             "| 0 | 0 | - |")
            base[r["launch"]] = r
            continue
        b = base[r["launch"]]
        fwd, bwd = formula_bytes(r["method"], r["cp"], batch=batch, n_head=cfg["n_head"], seq=cfg["block_size"],
                                 head_dim=head_dim, n_layer=cfg["n_layer"])
        sent = r["sent"]
        target = TARGETS.get(r["cp"])
        lines.append(
            f"| {r['layout']} | {r['method']} | {r['peak']} | {r['peak'] / b['peak']:.3f} | "
            f"{'-' if target is None else f'<= {target:.2f}'} | {r['wall_s'] * 1e3:.1f} | "
            f"{r['wall_s'] / b['wall_s']:.2f} | {r['cpu_s'] / b['cpu_s']:.2f} | "
            f"{sent['forward']} + {sent['backward']} | {fwd} + {bwd} | "
            f"{(sent['forward'] + sent['backward']) / (fwd + bwd):.3f} |"
        )
    return "\n".join(lines)


def run(quick: bool = False) -> str:
    """Measure cp 1, 2 and 4 with both methods and return the markdown table.

    Args:
        quick: a shorter sequence (1024 instead of 2048).

    Returns:
        A markdown table, one row per (layout, method).
    """
    from lightning_par.launcher import run_distributed

    spec = _QUICK if quick else _FULL
    cfg, batch, steps = spec["model"], spec["batch"], spec["steps"]
    rows: list[dict[str, Any]] = []
    for cp, methods in LAYOUTS.items():
        per_rank = run_distributed(_worker, cp, (cfg, batch, steps, methods), timeout_s=900)
        rows.extend(_collect(cp, methods, per_rank))
    return render(rows, cfg, batch)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a shorter sequence")
    print(run(quick=parser.parse_args().quick))
