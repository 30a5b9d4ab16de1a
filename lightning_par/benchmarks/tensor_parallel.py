"""Benchmark rows for tensor parallelism: communication, parameter and activation memory, step time, at tp 1, 2, 4.

One run measures, for the reference GPT split by :func:`~lightning_par.tensor_parallel.apply_tensor_parallel` (each tp
size in its own gloo world on CPU, tp 1 being the plain one-process model):

* bytes sent per rank per step by the tp collectives (:class:`~lightning_par.tensor_parallel.CommVolume`, ring
  model), per layer (the difference between an ``n_layer`` and an ``n_layer - 1`` model) against Megatron's
  ``8 b s h (t-1)/t`` elements per layer (Narayanan et al. 2021, §3.2), and for the whole step (embedding, LM
  head and the vocab-parallel loss included). Sequence parallelism adds the all-reduce of the LayerNorm gradients
  (``4 h`` elements per layer), hence a ratio a little above 1;
* parameter bytes per rank against ``1/t`` of tp 1's (LayerNorms, row-parallel biases and the position table stay
  replicated, so the ratio sits a little above ``1/t``);
* activation bytes per rank per layer: bytes of the tensors autograd saves for backward in one layer (measured with
  ``saved_tensors_hooks``, parameters excluded), with and without sequence parallelism, against the ratios of
  Korthikanti et al. 2022, §4.2 (``(10 + 24/t + 5as/(ht)) / (34 + 5as/h)`` without and ``1/t`` with sequence
  parallelism; the paper counts 2-byte activations and 1-byte dropout masks, this run has fp32 and no dropout, so
  compare the trend, not the digits). With sequence parallelism the measured ratio stays above ``1/t`` because
  DTensor's column-parallel layers keep their all-gathered input ``(b, s, h)`` for the weight gradient, which the
  paper avoids by gathering it again in backward (§4.2.2);
* median step time (forward, backward, AdamW step) relative to tp 1. On a shared 2-core CPU machine the tp ranks
  compete for the same cores, so tp > 1 is *slower* here; the row shows the overhead, not a speed-up.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

__all__ = ["run"]

_FULL = dict(model=dict(n_layer=4, n_head=8, n_embd=128, block_size=128, vocab_size=256), batch=8, steps=6)
_QUICK = dict(model=dict(n_layer=2, n_head=8, n_embd=128, block_size=128, vocab_size=256), batch=8, steps=3)


def _saved_bytes(fn: Any, exclude: set[int]) -> tuple[int, Any]:
    """Run ``fn()`` and return the bytes of distinct storages autograd saved for backward (and fn's result)."""
    import torch
    from torch.distributed.tensor import DTensor

    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        local = t._local_tensor if isinstance(t, DTensor) else t
        key = local.untyped_storage().data_ptr()
        if key not in seen and key not in exclude:
            seen.add(key)
            total += local.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return total, out


def _worker(model_cfg: dict, batch: int, steps: int) -> dict[str, Any]:
    import os

    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_par.launcher import init_process_group_from_env
    from lightning_par.memory import model_state_bytes
    from lightning_par.models import GPT, GPTConfig
    from lightning_par.models.gpt_tp_plan import gpt_tp_plan
    from lightning_par.tensor_parallel import CommVolume, apply_tensor_parallel, vocab_parallel_loss

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
            params = {(p._local_tensor if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
                      for p in model.parameters()}
            counter = CommVolume(mesh.get_group())
            with counter, vocab_parallel_loss():
                acts[layers], loss = _saved_bytes(lambda: loss_of(model), params)
                loss.backward()
            comm[layers] = counter.sent_bytes
            if layers == n:
                row["collectives"] = counter.counts()
                row["param_bytes"] = model_state_bytes(model)["param_bytes"]
        row["comm_step_bytes"] = comm[n]
        row["comm_layer_bytes"] = comm[n] - comm[n - 1]
        row["act_layer_bytes"] = acts[n] - acts[n - 1]
        # step time: forward, backward and an AdamW step
        model = build(n, sp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        times = []
        for i in range(steps + 1):
            torch.distributed.barrier()
            t0 = time.perf_counter()
            with vocab_parallel_loss():
                loss_of(model).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i:  # the first step includes one-off set-up
                times.append(time.perf_counter() - t0)
        row["step_s"] = statistics.median(times)
        out["plain" if sp is None else ("sp" if sp else "tp")] = row
    return out


def _korthikanti_ratio(t: int, sp: bool, cfg: dict) -> float:
    """Activation memory per layer at tp ``t`` over tp 1 (Korthikanti et al. 2022, §4.2, eqs. 2-4)."""
    a, s, h = cfg["n_head"], cfg["block_size"], cfg["n_embd"]
    attn = 5 * a * s / h
    base = 34 + attn
    per_rank = (34 / t + attn / t) if sp else (10 + 24 / t + attn / t)
    return per_rank / base


def run(quick: bool = False) -> str:
    """Measure tp 1, 2, 4 side by side and return the markdown table.

    Args:
        quick: a smaller model and fewer steps (under a minute on 2 CPU cores).

    Returns:
        A markdown table: one row per (tp size, sequence parallelism).
    """
    from lightning_par.launcher import run_distributed
    from lightning_par.tensor_parallel import megatron_layer_comm_bytes

    spec = _QUICK if quick else _FULL
    cfg, batch, steps = spec["model"], spec["batch"], spec["steps"]
    results = {t: run_distributed(_worker, t, (cfg, batch, steps), timeout_s=600)[0] for t in (1, 2, 4)}
    base = results[1]["plain"]
    h, s = cfg["n_embd"], cfg["block_size"]
    lines = [
        f"Tensor parallelism, GPT n_layer={cfg['n_layer']} n_head={cfg['n_head']} n_embd={h} seq={s} "
        f"batch={batch} vocab={cfg['vocab_size']}, fp32, CPU/gloo (one world per tp size).",
        "",
        "| tp | sequence parallel | comm bytes/layer/rank | theory 8bsh(t-1)/t | measured/theory "
        "| comm bytes/step/rank | collectives/step | param bytes/rank | vs tp1 | 1/t | activation bytes/layer/rank "
        "| vs tp1 | Korthikanti ratio | step time vs tp1 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
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
            f"{r['act_layer_bytes'] / base['act_layer_bytes']:.3f} | {_korthikanti_ratio(t, sp, cfg):.3f} | "
            f"{r['step_s'] / base['step_s']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer steps")
    print(run(quick=parser.parse_args().quick))
