"""Benchmark rows for tensor parallelism: step time against torch's stock plan, communication, parameter and
activation memory.

Two tables:

1. **Step time** (one launch of 2 ranks, CPU, gloo, the reference GPT, fp32 AdamW, contenders in turns step by step:
   :func:`~lightning_par.benchmarks.common.run_in_turns`): tp 1 (each rank trains its own copy of the plain model on
   the same batch, so the machine is as loaded as for tp 2), this project's plan
   (:func:`~lightning_par.tensor_parallel.apply_tensor_parallel` with the GPT's plan) at tp 2, and torch's stock
   Megatron plan (:func:`~lightning_par.benchmarks.tp_stock.apply_stock_tp`, torch's styles only) at tp 2, each with
   and without sequence parallelism. Wall time is the slowest rank's; CPU time is the training thread's own
   (``time.thread_time``), which a shared machine disturbs far less. On 2 cores the two tp ranks compete with
   each other and with everything else, so tp 2 is not faster than tp 1 here: read the ratios between plans.
2. **Bytes** (one world per tp size, tp 1 being the plain one-process model):

   * bytes sent per rank per step by the tp collectives (:class:`~lightning_par.tensor_parallel.CommVolume`, ring
     model), per layer (the difference between an ``n_layer`` and an ``n_layer - 1`` model) against Megatron's
     ``8 b s h (t-1)/t`` elements per layer (Narayanan et al. 2021, §3.2), and for the whole step (embedding, LM
     head and the vocab-parallel loss included). Sequence parallelism adds the all-reduce of the LayerNorm gradients
     (``4 h`` elements per layer), hence a ratio a little above 1;
   * parameter bytes per rank against ``1/t`` of tp 1's (LayerNorms, row-parallel biases and the position table stay
     replicated, so the ratio sits a little above ``1/t``);
   * activation bytes per rank per layer: bytes of the tensors autograd saves for backward in one layer (measured
     with ``saved_tensors_hooks``, parameters excluded), with and without sequence parallelism, against the ratios of
     Korthikanti et al. 2022, §4.2 (``(10 + 24/t + 5as/(ht)) / (34 + 5as/h)`` without and ``1/t`` with sequence
     parallelism; the paper counts 2-byte activations and 1-byte dropout masks, this run has fp32 and no dropout, so
     compare the trend, not the digits). With sequence parallelism the measured ratio stays above ``1/t`` because
     DTensor's column-parallel layers keep their all-gathered input ``(b, s, h)`` for the weight gradient, which the
     paper avoids by gathering it again in backward (§4.2.2).

Where sequence parallelism's extra time goes (on this CPU, gloo): each sub-block's one all-reduce becomes an
all-gather plus a reduce-scatter (the same bytes, twice the collectives and DTensor redistributions), and the
norms' partial weight gradients need one more all-reduce per step (one flat collective here; one per parameter with
torch's ``SequenceParallel`` and eager reduction, or several per parameter when DTensor reduces them lazily inside
the optimizer). What it buys is memory: the norms' and dropouts' activations are ``1/t`` per rank.
"""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["run"]

#: This benchmark's section in ``recipes/benchmark.py`` (``--only tp``) and its place in the full run.
SECTION = "tp"
ORDER = 20

_FULL = dict(model=dict(n_layer=4, n_head=8, n_embd=128, block_size=128, vocab_size=256), batch=8, steps=30, warmup=4)
_QUICK = dict(model=dict(n_layer=4, n_head=8, n_embd=128, block_size=128, vocab_size=256), batch=8, steps=12,
              warmup=3)
_TIMED = ("tp 1", "ours tp 2", "torch stock tp 2", "ours tp 2 + SP", "torch stock tp 2 + SP")


def _saved_bytes(fn: Any, exclude: set[int]) -> tuple[int, Any]:
    """Run ``fn()`` and return the bytes of distinct storages autograd saved for backward (and fn's result)."""
    import torch

    from lightning_par.compat import local_tensor

    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        local = local_tensor(t)
        key = local.untyped_storage().data_ptr()
        if key not in seen and key not in exclude:
            seen.add(key)
            total += local.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return total, out


def _worker(model_cfg: dict, batch: int) -> dict[str, Any]:
    import os

    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_par.compat import local_tensor
    from lightning_par.launcher import init_process_group_from_env
    from lightning_par.memory import model_state_bytes
    from lightning_par.models import GPT, GPTConfig
    from lightning_par.models.gpt_tp_plan import gpt_tp_plan
    from lightning_par.tensor_parallel import (
        CommVolume,
        apply_tensor_parallel,
        sync_tp_partial_grads,
        vocab_parallel_loss,
    )

    init_process_group_from_env(timeout_s=300)
    t = int(os.environ["WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (t,), mesh_dim_names=("tp",))
    seq = model_cfg["block_size"]
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, model_cfg["vocab_size"], (batch, seq), generator=g)
    y = torch.randint(0, model_cfg["vocab_size"], (batch, seq), generator=g)

    def build(n_layer: int, sp: bool | None) -> GPT:
        torch.manual_seed(0)
        model = GPT(GPTConfig(**{**model_cfg, "n_layer": n_layer}))
        if sp is not None:
            apply_tensor_parallel(model, mesh, gpt_tp_plan(), sp)
        return model

    def loss_of(model: GPT) -> torch.Tensor:
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))

    modes = [None] if t == 1 else [False, True]  # None: the plain one-process model
    n = model_cfg["n_layer"]
    out: dict[str, Any] = {}
    for sp in modes:
        row: dict[str, Any] = {}
        # communication and activations: one step of an n- and an (n-1)-layer model, the difference is one layer
        comm, acts = {}, {}
        for layers in (n, n - 1):
            model = build(layers, sp)
            params = {local_tensor(p).untyped_storage().data_ptr() for p in model.parameters()}
            counter = CommVolume(mesh.get_group())
            with counter, vocab_parallel_loss():
                acts[layers], loss = _saved_bytes(lambda: loss_of(model), params)
                loss.backward()
                if sp:
                    sync_tp_partial_grads(model, mesh.get_group())
            comm[layers] = counter.sent_bytes
            if layers == n:
                row["collectives"] = counter.counts()
                row["param_bytes"] = model_state_bytes(model)["param_bytes"]
        row["comm_step_bytes"] = comm[n]
        row["comm_layer_bytes"] = comm[n] - comm[n - 1]
        row["act_layer_bytes"] = acts[n] - acts[n - 1]
        out["plain" if sp is None else ("sp" if sp else "tp")] = row
    return out


def _korthikanti_ratio(t: int, sp: bool, cfg: dict) -> float:
    """Activation memory per layer at tp ``t`` over tp 1 (Korthikanti et al. 2022, §4.2, eqs. 2-4)."""
    a, s, h = cfg["n_head"], cfg["block_size"], cfg["n_embd"]
    attn = 5 * a * s / h
    base = 34 + attn
    per_rank = (34 / t + attn / t) if sp else (10 + 24 / t + attn / t)
    return per_rank / base


def _timing_worker(model_cfg: dict, batch: int, steps: int, warmup: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_par.benchmarks.common import Contender, run_in_turns, token_batches
    from lightning_par.benchmarks.tp_stock import apply_stock_tp
    from lightning_par.launcher import init_process_group_from_env
    from lightning_par.models import GPT, GPTConfig
    from lightning_par.models.gpt_tp_plan import gpt_tp_plan
    from lightning_par.tensor_parallel import apply_tensor_parallel, sync_tp_partial_grads, vocab_parallel_loss

    init_process_group_from_env(timeout_s=600)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    batches = token_batches(steps + warmup, batch, model_cfg["block_size"], model_cfg["vocab_size"])

    def contender(name: str) -> Contender:
        torch.manual_seed(0)
        model = GPT(GPTConfig(**model_cfg, dropout=0.0))
        sp = name.endswith("SP")
        if name.startswith("ours"):
            apply_tensor_parallel(model, mesh, gpt_tp_plan(), sp)
        elif name.startswith("torch"):
            apply_stock_tp(model, mesh, sp)
        parallel = name != "tp 1"
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step(i: int) -> None:
            x, y = batches[i % len(batches)]
            with vocab_parallel_loss() if parallel else torch.enable_grad():
                logits = model(x)
                F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
            if name.startswith("ours") and sp:
                sync_tp_partial_grads(model, mesh.get_group())
            opt.step()
            opt.zero_grad(set_to_none=True)

        return Contender(name, step)

    contenders = [contender(n) for n in _TIMED]
    run_in_turns(contenders, steps, warmup)
    return {c.name: (statistics.median(c.times), statistics.median(c.cpu_times)) for c in contenders}


def run(quick: bool = False) -> str:
    """Measure and return the markdown tables (see the module docstring).

    Args:
        quick: 12 measured steps per contender instead of 30.

    Returns:
        Two markdown tables: step times at tp 2 against the stock plan and tp 1, and the bytes per tp size.
    """
    from lightning_par.launcher import run_distributed
    from lightning_par.tensor_parallel import megatron_layer_comm_bytes

    spec = _QUICK if quick else _FULL
    cfg, batch = spec["model"], spec["batch"]
    h, s = cfg["n_embd"], cfg["block_size"]
    timed = run_distributed(_timing_worker, 2, (cfg, batch, spec["steps"], spec["warmup"]), timeout_s=1200)[0]
    wall1, cpu1 = timed["tp 1"]
    lines = [
        f"### Tensor parallel step time, GPT n_layer={cfg['n_layer']} n_head={cfg['n_head']} n_embd={h} seq={s} "
        f"batch={batch} vocab={cfg['vocab_size']}, fp32 AdamW, CPU/gloo, 2 ranks; median of {spec['steps']} steps, "
        "contenders in turns",
        "",
        "| plan | median step, wall (ms) | median step, CPU (ms) | wall / stock plan | CPU / stock plan | "
        "CPU / tp 1 | CPU / same plan without SP |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in _TIMED:
        wall, cpu = timed[name]
        if name == "tp 1":
            lines.append(f"| {name} | {wall * 1e3:.1f} | {cpu * 1e3:.1f} | - | - | 1.000 | - |")
            continue
        sp = name.endswith(" + SP")
        stock = timed["torch stock tp 2 + SP" if sp else "torch stock tp 2"]
        vs_plain = f"{cpu / timed[name[: -len(' + SP')]][1]:.3f}" if sp else "-"
        lines.append(
            f"| {name} | {wall * 1e3:.1f} | {cpu * 1e3:.1f} | {wall / stock[0]:.3f} | {cpu / stock[1]:.3f} | "
            f"{cpu / cpu1:.3f} | {vs_plain} |"
        )

    results = {t: run_distributed(_worker, t, (cfg, batch), timeout_s=600)[0] for t in (1, 2, 4)}
    base = results[1]["plain"]
    lines += [
        "",
        "### Tensor parallel bytes, same GPT and batch (one world per tp size)",
        "",
        "| tp | sequence parallel | comm bytes/layer/rank | theory 8bsh(t-1)/t | measured/theory "
        "| comm bytes/step/rank | collectives/step | param bytes/rank | vs tp1 | 1/t | activation bytes/layer/rank "
        "| vs tp1 | Korthikanti ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def fmt_counts(counts: dict[str, int]) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "-"

    rows = [(1, False, base)]
    rows += [(t, sp, results[t]["sp" if sp else "tp"]) for t in (2, 4) for sp in (False, True)]
    for t, sp, r in rows:
        theory = megatron_layer_comm_bytes(batch, s, h, t, bytes_per_element=4)
        ratio = f"{r['comm_layer_bytes'] / theory:.3f}" if theory else "-"
        lines.append(
            f"| {t} | {'yes' if sp else 'no'} | {r['comm_layer_bytes']:.0f} | {theory:.0f} | {ratio} | "
            f"{r['comm_step_bytes']:.0f} | {fmt_counts(r['collectives'])} | {r['param_bytes']} | "
            f"{r['param_bytes'] / base['param_bytes']:.3f} | {1 / t:.3f} | {r['act_layer_bytes']} | "
            f"{r['act_layer_bytes'] / base['act_layer_bytes']:.3f} | {_korthikanti_ratio(t, sp, cfg):.3f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    print(run(quick=parser.parse_args().quick))
