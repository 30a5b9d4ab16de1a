"""Benchmark rows for ZeRO: step time against torch's own engines, and memory against the paper's formulas.

One process-group launch of 2 ranks (CPU, gloo, fp32 AdamW, the reference GPT) measures, for each dp size:

* **step time** (forward, backward, optimizer step) of ``zero1``, ``zero2``, ``zero3`` (this project's engines, the
  code the strategies run) against torch DDP, torch ``ZeroRedundancyOptimizer`` + DDP, and plain FSDP2
  ``fully_shard``, all taking turns step by step (:func:`~lightning_par.benchmarks.common.run_in_turns`) on the same
  data: wall time (the slowest rank's) and the training thread's CPU time (blind to waiting, so steadier on a shared
  machine, but it misses the communication threads' work). ``dp 2`` uses both ranks; ``dp 1`` gives each rank its own one-rank group, so every contender runs with the
  same load on the machine and no communication at all: what is left over torch DDP there is per-step overhead.
* **memory** per rank, for one step of each contender after the timed ones: the model state (parameters, gradients,
  optimizer state; bytes of distinct storages, :func:`lightning_par.data_parallel.zero_memory.zero_state_bytes`) at
  the optimizer step, against the paper's formula (Rajbhandari et al., SC'20, §5: DDP ``16 Psi``, stage 1
  ``8 Psi + 8 Psi/N``, stage 2 ``4 Psi + 12 Psi/N``, stage 3 ``16 Psi/N``; 4-byte parameters and gradients,
  ``K = 8``); and the peak bytes of tensor storage during the step
  (:class:`~lightning_par.memory.StepMemoryTracker`), split into the model state and the rest (activations,
  communication buffers, temporaries). For ``zero2``, the most gradient bytes alive at once during backward
  (shard, bucket buffers and the parameter gradient autograd just produced) against ``4 Psi/N + 2 buckets``.
* **scaling**: the ``zero1``/``zero2`` over DDP ratios of training-thread CPU time at dp 2 for the ``tiny``,
  ``small`` and ``wide`` shapes (:data:`~lightning_par.benchmarks.common.GPT_SHAPES`): a fixed cost per tensor weighs
  less as tensors grow.

Communication volume per step against the paper's §7 is pinned by the test suite
(``tests/data_parallel/test_zero.py::test_communication_volume``), not timed here.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_par.benchmarks.common import GPT_SHAPES, Contender, run_in_turns, token_batches

__all__ = ["run", "scaling_steps"]

#: This benchmark's section in ``recipes/benchmark.py`` (``--only zero``) and its place in the full run.
SECTION = "zero"
ORDER = 30

_BUCKET_CAP_MB = 1.0
# Steps per contender. A scaling row runs at least ``scaling_steps`` and, for short steps, as many more (up to
# ``scaling_max_steps``) as fill ``scaling_budget_s`` seconds per round of contenders: with 8 steps, the tiny shape's
# 3 ms steps moved its ratios by 25-41% between two runs. ZeroRedundancyOptimizer + DDP's wall time per step spreads
# from 43 to 128 ms at dp 2 (its parameter broadcasts compete with the other rank for 2 cores): the median of 15 or 30
# steps moved by 20-29% between runs, of 60 by 5%.
_QUICK = dict(steps=60, warmup=3, micro_batch=8, scaling_steps=10, scaling_budget_s=3.0, scaling_max_steps=300)
_FULL = dict(steps=120, warmup=5, micro_batch=8, scaling_steps=20, scaling_budget_s=6.0, scaling_max_steps=600)
_NAMES = ("torch DDP", "ZeroRedundancyOptimizer + DDP", "FSDP2", "zero1", "zero2", "zero3")
_FORMULA_STAGE = {"torch DDP": 0, "ZeroRedundancyOptimizer + DDP": 1, "FSDP2": 3, "zero1": 1, "zero2": 2, "zero3": 3}


def _gpt(shape: dict[str, int]) -> nn.Module:
    from lightning_par.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(**shape, dropout=0.0))


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    from lightning_par.models import GPTLightningModule

    x, y = batch
    return GPTLightningModule.loss_fn(model(x), y)


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


class _Run:
    """One contender's model, optimizer and step; ``probe`` (if set) runs between backward and the optimizer step."""

    def __init__(self, name: str, shape: dict[str, int], mesh: Any, batches: list) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        from lightning_par.data_parallel.zero import apply_zero
        from lightning_par.data_parallel.zero_options import resolve_zero_options

        self.name, self.batches, self.probe = name, batches, None
        self.engine: Any = None
        group = mesh.get_group()
        model = _gpt(shape)
        self.numel = sum(p.numel() for p in model.parameters())
        self.num_tensors = len(list(model.parameters()))
        if name in ("torch DDP", "ZeroRedundancyOptimizer + DDP"):
            self.model = DDP(model, process_group=group, bucket_cap_mb=_BUCKET_CAP_MB, gradient_as_bucket_view=True)
            self.opt = (
                _adamw(model.parameters())
                if name == "torch DDP"
                else ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3,
                                             process_group=group)
            )
        elif name == "FSDP2":
            for block in model.blocks.values():
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.model, self.opt = model, _adamw(model.parameters())
        else:
            stage = int(name[-1])
            options = resolve_zero_options(stage, bucket_cap_mb=_BUCKET_CAP_MB if stage < 3 else None)
            self.engine = apply_zero(model, mesh, options)
            self.model, self.opt = model, _adamw(model.parameters())
            self.engine.shard_optimizer(self.opt)

    @property
    def inner(self) -> nn.Module:
        return getattr(self.model, "module", self.model)

    def step(self, i: int) -> None:
        loss = _loss(self.model, self.batches[i % len(self.batches)])
        if self.engine is not None:
            self.engine.pre_backward()
        loss.backward()
        if self.engine is not None:
            self.engine.post_backward()
        if self.probe is not None:
            self.probe(self)
        self.opt.step()
        # Set-to-none everywhere but where the gradients are views of DDP's persistent buckets (kept alive anyway).
        self.opt.zero_grad(set_to_none=not isinstance(self.model, nn.parallel.DistributedDataParallel))

    def optimizers(self) -> list[Any]:
        inner = getattr(self.opt, "optim", None)  # ZeroRedundancyOptimizer's local optimizer holds the state
        return [self.opt] + ([inner] if inner is not None else [])


def _memory(run: _Run, step: int) -> dict[str, Any]:
    """Model-state bytes at the optimizer step and peak bytes of one step under the allocation tracker."""
    from lightning_par.data_parallel.zero_memory import zero_state_bytes
    from lightning_par.memory import StepMemoryTracker, model_state_tensors

    seen: dict[str, int] = {}

    def probe(r: _Run) -> None:
        seen.update(zero_state_bytes(r.inner, r.optimizers()))

    run.probe = probe
    reducer = getattr(run.engine, "reducer", None)
    if reducer is not None and hasattr(reducer, "grad_memory"):
        from lightning_par.memory import LiveStorageBytes

        reducer.grad_memory = LiveStorageBytes()
        if reducer.grad_shard is not None:
            reducer.grad_memory.add(reducer.grad_shard)
    from lightning_par.callbacks.metrics import persistent_comm_buffers

    # Buffers alive across steps that no model-state walk finds (the reducer's buckets, the all-gather send buffers).
    tracker = StepMemoryTracker(model_state_tensors(run.inner, run.optimizers()) + persistent_comm_buffers(run))
    with tracker:
        run.step(step)
    run.probe = None
    out: dict[str, Any] = {"state": seen, "peak": tracker.peak_bytes}
    if reducer is not None and getattr(reducer, "grad_memory", None) is not None:
        out["peak_grad"] = reducer.grad_memory.peak
        out["buckets"] = run.engine.summary()["bucket_bytes"]
        reducer.grad_memory = None
    return out


def _meshes(world: int) -> dict[int, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    return {
        world: init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)),
        1: init_device_mesh("cpu", (world, 1), mesh_dim_names=("rep", "dp"))["dp"],
    }


def _worker(setup: dict[str, Any]) -> dict[str, Any]:
    from lightning_par.launcher import init_process_group_from_env

    init_process_group_from_env(timeout_s=600)
    world, rank = dist.get_world_size(), dist.get_rank()
    meshes = _meshes(world)
    out: dict[str, Any] = {"timing": {}, "timing_cpu": {}, "memory": {}, "scaling": {}, "scaling_cpu": {}}
    shape = GPT_SHAPES["small"]
    total = setup["warmup"] + setup["steps"] + 1
    for dp in (world, 1):
        batches = token_batches(total, setup["micro_batch"], shape["block_size"], shape["vocab_size"],
                                seed=rank if dp > 1 else 0)
        runs = [_Run(name, shape, meshes[dp], batches) for name in _NAMES]
        contenders = [Contender(r.name, r.step) for r in runs]
        run_in_turns(contenders, setup["steps"], setup["warmup"])
        out["timing"][dp] = {c.name: c.times for c in contenders}
        out["timing_cpu"][dp] = {c.name: c.cpu_times for c in contenders}
        out["memory"][dp] = {r.name: _memory(r, total) for r in runs}
        out["numel"], out["num_tensors"] = runs[0].numel, runs[0].num_tensors
        del runs, contenders
    for name, shape in GPT_SHAPES.items():
        batches = token_batches(16, setup["micro_batch"], shape["block_size"], shape["vocab_size"], seed=rank)
        runs = [_Run(n, shape, meshes[world], batches) for n in ("torch DDP", "ZeroRedundancyOptimizer + DDP",
                                                                   "zero1", "zero2")]
        contenders = [Contender(r.name, r.step) for r in runs]
        run_in_turns(contenders, 2, 1)  # times are the max over ranks: every rank computes the same step count
        steps = scaling_steps(sum(c.times[-1] for c in contenders), setup)
        for c in contenders:
            c.times.clear()
            c.cpu_times.clear()
        run_in_turns(contenders, steps, 0)
        out["scaling"][name] = {c.name: c.times for c in contenders} | {"numel": runs[0].numel, "steps": steps}
        out["scaling_cpu"][name] = {c.name: c.cpu_times for c in contenders}
        del runs, contenders
    return out


def scaling_steps(round_s: float, setup: dict[str, Any]) -> int:
    """Measured steps for a scaling row whose round of contenders takes ``round_s`` seconds: enough to fill
    ``setup["scaling_budget_s"]`` seconds, at least ``setup["scaling_steps"]``, at most ``setup["scaling_max_steps"]``.
    """
    fill = int(setup["scaling_budget_s"] / round_s) if round_s > 0 else setup["scaling_max_steps"]
    return min(setup["scaling_max_steps"], max(setup["scaling_steps"], fill))


def _median(times: list[float]) -> float:
    s = sorted(times)
    return s[len(s) // 2] if len(s) % 2 else 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2])


def run(quick: bool = False, world_size: int = 2) -> str:
    """Measure and return the markdown tables (see the module docstring).

    Args:
        quick: 60 measured steps per contender (120 without); a scaling row at least 10 (20 without), more for short
            steps, up to 3 s per round of its contenders (6 s without).
        world_size: ranks; the dp sizes measured are ``world_size`` and 1.
    """
    from lightning_par.data_parallel.zero_memory import paper_state_bytes
    from lightning_par.launcher import run_distributed

    setup = _QUICK if quick else _FULL
    res = run_distributed(_worker, world_size, (setup,), timeout_s=1800, threads_per_rank=1)
    r0 = res[0]
    numel, tensors = r0["numel"], r0["num_tensors"]
    shape = GPT_SHAPES["small"]
    lines = [
        f"### ZeRO step time (CPU, gloo, fp32 AdamW): GPT small ({shape['n_layer']}x{shape['n_embd']}, Psi = {numel}, "
        f"{tensors} tensors), micro-batch {setup['micro_batch']}x{shape['block_size']} per rank, "
        f"bucket_cap_mb={_BUCKET_CAP_MB}; median of {setup['steps']} steps, contenders in turns",
        "",
        "| dp | engine | median step, wall (ms) | / torch DDP | / ZeroRedundancyOptimizer + DDP | / FSDP2 | "
        "median step, CPU (ms) | CPU / torch DDP | CPU / ZeroRedundancyOptimizer + DDP |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for dp in (world_size, 1):
        med = {n: _median(t) for n, t in r0["timing"][dp].items()}
        cpu = {n: _median(t) for n, t in r0["timing_cpu"][dp].items()}
        for n in _NAMES:
            lines.append(f"| {dp} | {n} | {med[n] * 1e3:.1f} | {med[n] / med['torch DDP']:.3f} | "
                         f"{med[n] / med['ZeroRedundancyOptimizer + DDP']:.3f} | {med[n] / med['FSDP2']:.3f} | "
                         f"{cpu[n] * 1e3:.1f} | {cpu[n] / cpu['torch DDP']:.3f} | "
                         f"{cpu[n] / cpu['ZeroRedundancyOptimizer + DDP']:.3f} |")
    lines += [
        "",
        "### ZeRO memory per rank vs the paper (§5), same run, one step after the timed ones (max over ranks)",
        "",
        "| dp | engine | formula stage | model state (bytes) | formula | measured / formula | peak of the step "
        "(bytes) | peak / formula | peak - model state |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    grad_rows = []
    for dp in (world_size, 1):
        for n in _NAMES:
            mems = [r["memory"][dp][n] for r in res]
            state = max(sum(m["state"].values()) for m in mems)
            peak = max(m["peak"] for m in mems)
            stage = _FORMULA_STAGE[n]
            formula = paper_state_bytes(stage, numel, dp)
            lines.append(f"| {dp} | {n} | {stage} | {state} | {formula:.0f} | {state / formula:.4f} | {peak} | "
                         f"{peak / formula:.3f} | {peak - state} |")
            if n == "zero2" and "peak_grad" in mems[0]:
                grad = max(m["peak_grad"] for m in mems)
                buckets = sorted(mems[0]["buckets"], reverse=True)
                bound = 4 * numel / dp + sum(buckets[:2])
                grad_rows.append((dp, grad, 4 * numel / dp, buckets[:2], bound))
    lines += [
        "",
        f"Model state is above the formula only by AdamW's 4-byte `step` tensor per parameter tensor ({tensors} x 4 = "
        f"{4 * tensors} bytes per optimizer) and by ZeroRedundancyOptimizer's uneven split (whole tensors per rank) "
        "and DDP-managed bucket views. The peak adds activations and temporaries, which the paper's model-state "
        "formula leaves out.",
        "",
        "ZeRO-2's gradient memory during backward, measured storage by storage (the shard, the bucket buffers and "
        "the gradient autograd has just produced, each until it is freed), against the shard plus two buckets: the "
        "two largest bucket buffers, or twice `bucket_cap_mb`. The excess over the first is that one parameter "
        "gradient, alive while it is copied into a freshly allocated bucket while the previous bucket is in flight.",
        "",
        "| dp | measured peak (bytes) | 4 Psi / N | two largest buckets | 4 Psi/N + 2 buckets | measured / that | "
        "4 Psi/N + 2 x bucket_cap | measured / that |",
        "|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    cap2 = 2 * _BUCKET_CAP_MB * 2**20
    for dp, grad, shard, two, bound in grad_rows:
        lines.append(f"| {dp} | {grad} | {shard:.0f} | {' + '.join(str(b) for b in two)} | {bound:.0f} | "
                     f"{grad / bound:.3f} | {shard + cap2:.0f} | {grad / (shard + cap2):.3f} |")
    lines += [
        "",
        "### Scaling: the fixed per-tensor cost (dp 2, same run; training-thread CPU time per step over torch DDP's)",
        "",
        "A fixed cost per tensor is CPU work, so these rows compare CPU time. Wall time is left out here: on 2 shared "
        "cores `ZeroRedundancyOptimizer` + DDP's wall time per step spreads over a factor of 3, and the median of the "
        "10-80 steps a quick scaling row affords moved its wall ratios by up to 34% between two runs (the table above "
        "gives the small shape's wall time over 60 or more steps).",
        "",
        "| shape | Psi | measured steps | CPU: ZeroRedundancyOptimizer + DDP / DDP | CPU: zero1 / DDP | "
        "CPU: zero2 / DDP |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in r0["scaling"].items():
        cpu = r0["scaling_cpu"][name]
        cbase = _median(cpu["torch DDP"])
        cells = [_median(cpu[n]) / cbase for n in ("ZeroRedundancyOptimizer + DDP", "zero1", "zero2")]
        lines.append(f"| {name} | {row['numel']} | {row['steps']} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    print(run(quick=parser.parse_args().quick))
