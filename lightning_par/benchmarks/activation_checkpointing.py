"""Benchmark rows for activation checkpointing: activation bytes per rank and step time, none vs full vs selective.

For the reference GPT made parallel by :func:`lightning_par.parallelize.parallelize` (each layout in its own gloo
world on CPU: one process, tp 2 with sequence parallelism, pp 2 with 1F1B), with ``activation_checkpointing``
``"none"``, ``"full"`` and ``"selective"``, one run measures per rank:

* **kept after forward**: bytes of the tensor storages created during the forward pass that are still alive when it
  returns, i.e. what the step holds for backward (saved activations, a checkpoint's kept inputs, the logits); counted
  by :class:`lightning_par.memory.StepMemoryTracker`, which follows every storage an operator creates until it is
  freed (DTensor operators through their local operators). Not defined under pipelining (forward and backward
  interleave), so ``-`` there;
* **activation peak**: the most bytes of storages created during the step alive at once, from the start of forward
  to the end of backward (model state left out; gradients of the parameters included, the same in every row of a
  layout); measured on a step after the first, whose one-off set-up is left out;
* **step time**: median seconds of forward + backward (no optimizer step, no counting mode), relative to ``none`` in
  the same layout: the price of recomputation (about one more forward for ``full``). The three modes run in turns,
  step by step, so that a change of load on a shared machine falls on all three alike.

Korthikanti et al. 2022 (§5, Table 2) give, per transformer layer, ``sbh(34 + 5as/h)`` bytes of activations without
recomputation (fp16, with dropout masks), ``2sbh`` with full recomputation and ``34sbh`` with selective; this run is
fp32 without dropout, and torch's fused attention keeps no ``s x s`` scores, so compare the trend, not the digits.
On a shared 2-core CPU machine the step times are noisy: read the ratios.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

__all__ = ["run"]

#: This benchmark's section in ``recipes/benchmark.py`` (``--only ac``) and its place in the full run.
SECTION = "ac"
ORDER = 50

_FULL = dict(model=dict(n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=256), batch=8, steps=15)
_QUICK = dict(model=_FULL["model"], batch=8, steps=5)
#: label -> (world size, strategy options)
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "1 process": (1, {}),
    "tp2 + SP": (2, {"tp_size": 2, "sequence_parallel": True}),
    "pp2 1F1B m=4": (2, {"pp_size": 2, "schedule": "1f1b", "num_microbatches": 4}),
}
MODES: tuple[str, ...] = ("none", "full", "selective")


def _worker(model_cfg: dict, batch: int, steps: int, options: dict) -> dict[str, Any]:
    import os

    import torch
    import torch.distributed as dist

    from lightning_par.launcher import init_process_group_from_env
    from lightning_par.memory import StepMemoryTracker
    from lightning_par.models import GPTConfig, GPTLightningModule
    from lightning_par.parallel_dims import ParallelDims
    from lightning_par.parallelize import ParallelOptions, parallelize
    from lightning_par.tensor_parallel import vocab_parallel_loss

    init_process_group_from_env(timeout_s=300)
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, model_cfg["vocab_size"], (batch, model_cfg["block_size"]), generator=g)
    y = torch.randint(0, model_cfg["vocab_size"], (batch, model_cfg["block_size"]), generator=g)
    sizes = {k: options[k] for k in ("tp_size", "pp_size") if k in options}
    rest = {k: v for k, v in options.items() if k not in sizes}
    built: dict[str, Any] = {}
    for mode in MODES:
        torch.manual_seed(0)
        module = GPTLightningModule(GPTConfig(**model_cfg))
        dims = ParallelDims(world_size=world, dp_size=1, **sizes)
        parallel = parallelize(module, dims, ParallelOptions.build("ddp", activation_checkpointing=mode, **rest),
                               device=torch.device("cpu"))
        built[mode] = (module, parallel)

    def step(mode: str, measure: StepMemoryTracker | None = None) -> int | None:
        """Forward and backward of one batch; with ``measure``, the bytes alive when forward returned."""
        module, parallel = built[mode]
        for p in parallel.network.parameters():
            p.grad = None
        loss_context = vocab_parallel_loss if parallel.loss_parallel else torch.enable_grad
        if parallel.pipeline is not None:
            with measure if measure is not None else torch.enable_grad():
                parallel.pipeline.train_step((x,), y)
            return None
        kept = None
        with measure if measure is not None else torch.enable_grad() as counter:
            with loss_context():
                loss = module.loss_fn(parallel.network(x), y)
            if measure is not None:
                kept = counter.live.live
            with loss_context():
                loss.backward()
        return kept

    out: dict[str, Any] = {}
    for mode in MODES:
        step(mode)  # one-off set-up (the pipeline infers its shapes on its first step) is not measured
        measure = StepMemoryTracker()
        kept = step(mode, measure)
        out[mode] = {"kept": kept, "peak": measure.peak_bytes, "checkpointed": len(built[mode][1].checkpointed)}
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(steps):
        for mode in MODES:  # in turns
            dist.barrier()
            t0 = time.perf_counter()
            step(mode)
            times[mode].append(time.perf_counter() - t0)
    for mode in MODES:
        out[mode]["step_s"] = statistics.median(times[mode])
        built[mode][1].engine.remove()
    return out


def run(quick: bool = False) -> str:
    """Measure every layout x mode side by side and return the markdown table.

    Args:
        quick: a smaller model and fewer steps.

    Returns:
        A markdown table: one row per (layout, mode), figures of the rank with the largest activation peak.
    """
    from lightning_par.launcher import run_distributed

    spec = _QUICK if quick else _FULL
    cfg, batch, steps = spec["model"], spec["batch"], spec["steps"]
    lines = [
        f"Activation checkpointing, GPT n_layer={cfg['n_layer']} n_head={cfg['n_head']} n_embd={cfg['n_embd']} "
        f"seq={cfg['block_size']} batch={batch}, fp32, CPU/gloo; per rank (the rank with the largest peak).",
        "",
        "| layout | activation_checkpointing | modules/rank | kept after forward (bytes) | vs none | activation peak "
        "(bytes) | vs none | step time vs none |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, (world, options) in LAYOUTS.items():
        per_rank = run_distributed(_worker, world, (cfg, batch, steps, options), timeout_s=900)
        worst = max(range(world), key=lambda r: per_rank[r]["none"]["peak"])
        rows = per_rank[worst]
        base = rows["none"]
        for mode in MODES:
            r = rows[mode]
            kept = "-" if r["kept"] is None else f"{r['kept']}"
            kept_ratio = "-" if r["kept"] is None else f"{r['kept'] / base['kept']:.3f}"
            lines.append(
                f"| {label} | {mode} | {r['checkpointed']} | {kept} | {kept_ratio} | {r['peak']} | "
                f"{r['peak'] / base['peak']:.3f} | {r['step_s'] / base['step_s']:.2f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer steps")
    print(run(quick=parser.parse_args().quick))
