"""Benchmark rows for Muon (:class:`lightning_par.optim.MuonAdamW`) against AdamW at the same layout.

One launch of 2 ranks (CPU, gloo, fp32, the reference GPT ``small`` shape), three layouts: dp 2 under ``zero2`` and
``zero3`` (this project's engines) and tp 2 (the GPT's plan); in each, AdamW on every parameter and Muon + AdamW
(Muon on the hidden matrices) take turns step by step (:func:`~lightning_par.benchmarks.common.run_in_turns`).
Per contender and rank:

* **step time**: median wall (the slowest rank's) and training-thread CPU time of forward, backward and the step;
* **bytes received at the step** (the busiest rank): Muon's gathers of pieces to each matrix's owner and scatters of
  the results back (``MuonAdamW.gather_bytes_last_step``) against the planner's
  :func:`~lightning_par.planner.muon.muon_step_cost`; AdamW moves nothing at the step (the dp engine's own
  communication is the same for both);
* **optimizer-state bytes**: every state tensor's local bytes, against the planner's
  :func:`~lightning_par.planner.muon.muon_state_bytes` (``4`` bytes per Muon element, ``8`` per AdamW element,
  ``4`` per AdamW tensor) over the elements the layout gives a rank: ``1/N`` of each tensor under ZeRO (the rows
  rounded up to whole rows), the tp plan's split under tensor parallelism.
"""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["run"]

SECTION = "muon"
ORDER = 35

_QUICK = dict(steps=8, warmup=2, batch=8, shape="small")
_FULL = dict(steps=30, warmup=3, batch=8, shape="small")
_LAYOUTS = ("dp2 zero2", "dp2 zero3", "tp2")


def _state_bytes(opt: Any) -> int:
    from lightning_par.compat import local_tensor

    total = 0
    for state in opt.state.values():
        for v in state.values():
            if hasattr(v, "numel"):
                t = local_tensor(v)
                total += t.numel() * t.element_size()
    return total


def _worker(setup: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_par.benchmarks.common import GPT_SHAPES, Contender, run_in_turns, token_batches
    from lightning_par.compat import local_tensor
    from lightning_par.data_parallel.zero import apply_zero
    from lightning_par.data_parallel.zero_options import resolve_zero_options
    from lightning_par.launcher import init_process_group_from_env
    from lightning_par.models import GPT, GPTConfig
    from lightning_par.models.gpt_tp_plan import gpt_tp_plan
    from lightning_par.optim import MuonAdamW, muon_param_groups, muon_split
    from lightning_par.tensor_parallel import apply_tensor_parallel, vocab_parallel_loss

    init_process_group_from_env(timeout_s=600)
    rank = dist.get_rank()
    shape = GPT_SHAPES[setup["shape"]]
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    tp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    total = setup["steps"] + setup["warmup"]
    dp_batches = token_batches(total, setup["batch"], shape["block_size"], shape["vocab_size"], seed=rank)
    tp_batches = token_batches(total, setup["batch"], shape["block_size"], shape["vocab_size"])

    def contender(layout: str, optimizer: str) -> Contender:
        torch.manual_seed(0)
        model = GPT(GPTConfig(**shape, dropout=0.0))
        muon_names = {n for n, _ in muon_split(model)[0]}
        engine = None
        if layout == "tp2":
            apply_tensor_parallel(model, tp_mesh, gpt_tp_plan(), False)
        else:
            stage = int(layout[-1])
            engine = apply_zero(model, mesh, resolve_zero_options(stage, bucket_cap_mb=1.0 if stage < 3 else None))
        held = {n: local_tensor(p).numel() for n, p in model.named_parameters()}
        if optimizer == "adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        else:
            opt = MuonAdamW(muon_param_groups(model), lr=0.02, adamw_lr=1e-3)
        if engine is not None and stage < 3:
            engine.shard_optimizer(opt)
        batches = tp_batches if layout == "tp2" else dp_batches

        def step(i: int) -> None:
            x, y = batches[i % len(batches)]
            if engine is not None:
                engine.pre_backward()
            with vocab_parallel_loss() if layout == "tp2" else torch.enable_grad():
                logits = model(x)
                F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
            if engine is not None:
                engine.post_backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        c = Contender(f"{layout} {optimizer}", step)
        c.extra.update(opt=opt, held=held, muon_names=muon_names,
                       whole={n: p.numel() for n, p in GPT(GPTConfig(**shape, dropout=0.0)).named_parameters()},
                       shapes={n: tuple(p.shape) for n, p in model.named_parameters()})
        return c

    out: dict[str, Any] = {}
    for layout in _LAYOUTS:
        contenders = [contender(layout, o) for o in ("adamw", "muon")]
        run_in_turns(contenders, setup["steps"], setup["warmup"])
        for c in contenders:
            opt = c.extra["opt"]
            out[c.name] = dict(
                wall=statistics.median(c.times), cpu=statistics.median(c.cpu_times), state=_state_bytes(opt),
                gather=getattr(opt, "gather_bytes_last_step", 0), held=c.extra["held"],
                muon_names=c.extra["muon_names"], whole=c.extra["whole"], shapes=c.extra["shapes"],
            )
        del contenders
    return out


def _predicted_state(row: dict[str, Any], optimizer: str, layout: str, world: int) -> int:
    """The planner's optimizer-state bytes for one rank: ``1/N`` of each tensor's rows under ZeRO (rounded up), the
    tp plan's local shard under tensor parallelism."""
    from lightning_par.planner.muon import muon_state_bytes

    if layout == "tp2":
        per_rank = row["held"]
    else:
        per_rank = {}
        for n, numel in row["whole"].items():
            shape = row["shapes"][n]
            rows = shape[0]
            per_row = numel // rows
            per_rank[n] = -(-rows // world) * per_row
    if optimizer == "adamw":
        return muon_state_bytes(0, sum(per_rank.values()), len(per_rank))
    muon = sum(v for n, v in per_rank.items() if n in row["muon_names"])
    adamw = {n: v for n, v in per_rank.items() if n not in row["muon_names"]}
    return muon_state_bytes(muon, sum(adamw.values()), len(adamw))


def run(quick: bool = False, world_size: int = 2, setup: dict[str, Any] | None = None) -> str:
    """Measure and return the markdown table (see the module docstring).

    Args:
        quick: 8 measured steps per contender (30 without).
        world_size: ranks (the dp and tp size).
        setup: replaces the quick/full settings (``steps``, ``warmup``, ``batch``, ``shape``: a key of
            :data:`~lightning_par.benchmarks.common.GPT_SHAPES`).
    """
    from lightning_par.benchmarks.common import GPT_SHAPES
    from lightning_par.launcher import run_distributed
    from lightning_par.planner.muon import muon_step_cost

    setup = setup or (_QUICK if quick else _FULL)
    res = run_distributed(_worker, world_size, (setup,), timeout_s=1800, threads_per_rank=1)
    shape = GPT_SHAPES[setup["shape"]]
    lines = [
        f"### Muon vs AdamW (CPU, gloo, fp32): GPT {setup['shape']} ({shape['n_layer']}x{shape['n_embd']}), micro-batch "
        f"{setup['batch']}x{shape['block_size']} per rank; median of {setup['steps']} steps, in turns; bytes and "
        "state per rank (the largest over ranks)",
        "",
        "| layout | optimizer | step wall (ms) | / AdamW | step CPU (ms) | / AdamW | bytes received at the step | "
        "planner | optimizer state (bytes) | planner | measured / planner |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for layout in _LAYOUTS:
        base = res[0][f"{layout} adamw"]
        for optimizer in ("adamw", "muon"):
            name = f"{layout} {optimizer}"
            row = res[0][name]
            state = max(r[name]["state"] for r in res)
            gather = max(r[name]["gather"] for r in res)
            predicted = max(_predicted_state(r[name], optimizer, layout, world_size) for r in res)
            if optimizer == "muon":
                matrices = [row["shapes"][n] for n in sorted(row["muon_names"])]
                planned_gather = muon_step_cost(matrices, world_size).received_bytes
            else:
                planned_gather = 0
            lines.append(
                f"| {layout} | {optimizer} | {row['wall'] * 1e3:.1f} | {row['wall'] / base['wall']:.2f} | "
                f"{row['cpu'] * 1e3:.1f} | {row['cpu'] / base['cpu']:.2f} | {gather} | {planned_gather:.0f} | "
                f"{state} | {predicted} | {state / predicted:.4f} |"
            )
    lines += [
        "",
        "Muon's state is one fp32 momentum per matrix element (AdamW: two), sharded like the parameter; at the step "
        "each matrix's update is gathered to one owner rank (owners balanced by Newton-Schulz flops), orthogonalised "
        "there and scattered back (docs/muon.md). On this CPU the bf16 Newton-Schulz matmuls are slow (no bf16 "
        "matrix units), so the step-time ratio is an upper bound of what a GPU sees.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(run(quick=True))
