"""Benchmark rows for expert parallelism: step time, all-to-all bytes and expert bytes per rank, ep 1 vs 2 vs 4.

For the MoE GPT (every other block a mixture of experts, top-2, dropless) on a data-parallel world of 2 and of 4 gloo
ranks on CPU (:func:`lightning_par.parallelize.parallelize`, ``dp_mode="ddp"``), each launch builds the model at
``ep_size = 1`` (every rank holds every expert; the expert gradients join the dp all-reduce) and at every larger
``ep_size`` dividing the world, and the contenders take turns step by step. Per rank (the largest over the ranks):

* **step time**: the slowest rank's wall seconds of forward + backward + the dp reduction, the median over steps,
  against ``ep1`` timed in the same launch; on 2 cores a world of 4 shares them, so read those times as an upper bound;
* **all-to-all bytes per step**: token bytes the ep dispatch and combine send to other ranks, forward and backward
  (:class:`~lightning_par.expert_parallel.dispatch.ExpertDispatch` counts the forward; the backward repeats each
  exchange reversed), against the formula for uniform routing: per MoE layer, ``t k (ep - 1) / ep`` routed copies of
  ``d`` fp32 values leave a rank at dispatch and come back at combine, forward and backward:
  ``4 L_moe t k d 4 (ep - 1) / ep`` bytes (``t`` tokens per rank, ``k`` top-k). Measured / formula differs from 1 by
  the router's imbalance;
* **expert bytes per rank**: the experts' parameter bytes a rank holds, against ``1 / ep`` of them.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

__all__ = ["formula_bytes", "render", "run"]

#: This benchmark's section in ``recipes/benchmark.py`` (``--only ep``) and its place in the full run.
SECTION = "ep"
ORDER = 70

_FULL = dict(model=dict(n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=256, num_experts=8, moe_every=2),
             batch=8, steps=20)
_QUICK = dict(model=dict(_FULL["model"]), batch=4, steps=20)
#: world size -> ep sizes measured in that launch (ep 1 is the baseline)
LAYOUTS: dict[int, tuple[int, ...]] = {2: (1, 2), 4: (1, 2, 4)}


def formula_bytes(ep: int, *, moe_layers: int, tokens: int, top_k: int, dim: int, elem_bytes: int = 4) -> int:
    """Bytes one rank sends per step in the ep all-to-alls under uniform routing (the module docstring's formula)."""
    return 4 * moe_layers * tokens * top_k * dim * elem_bytes * (ep - 1) // ep


def _worker(model_cfg: dict, batch: int, steps: int, eps: tuple[int, ...]) -> dict[str, Any]:
    import os

    import torch
    import torch.distributed as dist

    from lightning_par.compat import local_tensor
    from lightning_par.launcher import init_process_group_from_env
    from lightning_par.models import GPTConfig, GPTLightningModule
    from lightning_par.parallel_dims import ParallelDims
    from lightning_par.parallelize import ParallelOptions, parallelize

    init_process_group_from_env(timeout_s=300)
    torch.set_num_threads(1)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, model_cfg["vocab_size"], (batch, model_cfg["block_size"]), generator=g)
    y = torch.randint(0, model_cfg["vocab_size"], (batch, model_cfg["block_size"]), generator=g)
    built: dict[int, Any] = {}
    for ep in eps:
        torch.manual_seed(0)
        module = GPTLightningModule(GPTConfig(**model_cfg))
        dims = ParallelDims(world_size=world, ep_size=ep)
        built[ep] = (module, parallelize(module, dims, ParallelOptions.build("ddp"), device=torch.device("cpu")))

    def step(ep: int) -> None:
        module, parallel = built[ep]
        module.zero_grad(set_to_none=False)
        loss = module.loss_fn(module(x), y)
        parallel.engine.pre_backward()
        loss.backward()
        parallel.engine.post_backward()

    out: dict[int, Any] = {}
    for ep in eps:
        module, parallel = built[ep]
        step(ep)
        parallel.step_figures()  # resets the byte counters
        step(ep)
        sent = parallel.step_figures().get("ep_all_to_all_bytes", 0.0)
        experts = [module.model.get_submodule(p) for p in module.model.expert_modules()]
        held = sum(local_tensor(p).numel() * p.element_size() for m in experts for p in m.parameters())
        out[ep] = {"sent": sent, "expert_bytes": held, "wall": []}
    for _ in range(steps):
        for ep in eps:
            dist.barrier()
            t0 = time.perf_counter()
            step(ep)
            out[ep]["wall"].append(time.perf_counter() - t0)
    for ep in eps:
        built[ep][1].engine.remove()
    return out


def render(rows: list[dict[str, Any]], cfg: dict[str, int], batch: int) -> str:
    """The markdown table of :func:`run`; each launch's ``ep1`` row is the baseline of that launch's rows."""
    from lightning_par.models import GPTConfig

    config = GPTConfig(**cfg)
    moe_layers = sum(config.is_moe(i) for i in range(config.n_layer))
    lines = [
        f"Expert parallelism, MoE GPT n_layer={cfg['n_layer']} n_embd={cfg['n_embd']} seq={cfg['block_size']} "
        f"experts={cfg['num_experts']} (every other block) top-{config.moe_top_k}, batch={batch} per rank, dp_mode=ddp, "
        "fp32, CPU/gloo; per rank (the largest over ranks); times against ep1 in the same launch (in turns).",
        "",
        "| world | layout | step wall (ms) | wall / ep1 | all-to-all sent per step (bytes) | formula (bytes) "
        "| measured / formula | expert bytes per rank | / (ep1's / ep) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base: dict[int, dict[str, Any]] = {}
    for r in rows:
        if r["ep"] == 1:
            base[r["world"]] = r
        b = base[r["world"]]
        formula = formula_bytes(r["ep"], moe_layers=moe_layers, tokens=batch * cfg["block_size"],
                                top_k=config.moe_top_k, dim=cfg["n_embd"])
        ratio = f"{r['sent'] / formula:.3f}" if formula else "-"
        lines.append(
            f"| {r['world']} | ep{r['ep']} | {r['wall_s'] * 1e3:.1f} | {r['wall_s'] / b['wall_s']:.2f} | "
            f"{int(r['sent'])} | {formula} | {ratio} | {r['expert_bytes']} | "
            f"{r['expert_bytes'] / (b['expert_bytes'] / r['ep']):.3f} |"
        )
    return "\n".join(lines)


def run(quick: bool = False) -> str:
    """Measure ep 1, 2 (world 2) and ep 1, 2, 4 (world 4); return the markdown table.

    Args:
        quick: a smaller batch (4 sequences per rank instead of 8).
    """
    from lightning_par.launcher import run_distributed

    spec = _QUICK if quick else _FULL
    cfg, batch, steps = spec["model"], spec["batch"], spec["steps"]
    rows: list[dict[str, Any]] = []
    for world, eps in LAYOUTS.items():
        per_rank = run_distributed(_worker, world, (cfg, batch, steps, eps), timeout_s=900)
        for ep in eps:
            ranks = [r[ep] for r in per_rank]
            wall = [max(r["wall"][i] for r in ranks) for i in range(steps)]
            rows.append({"world": world, "ep": ep, "wall_s": statistics.median(wall),
                         "sent": max(r["sent"] for r in ranks), "expert_bytes": max(r["expert_bytes"] for r in ranks)})
    return render(rows, cfg, batch)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller batch")
    print(run(quick=parser.parse_args().quick))
