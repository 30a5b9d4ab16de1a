"""Benchmark rows for the experts' forms: one MoE block's step time, grouped vs the per-expert loop, at 8, 64 and 256
experts.

One :class:`~lightning_par.models.moe.MoE` layer (width 128, expert width 256, top-2 softmax routing, dropless,
4,096 tokens) runs forward + backward in this process on one thread in three ways taking turns step by step on the
same batch and weights, so every ratio comes from one run:

* **grouped**: ``grouped_mm`` where it runs (CUDA bf16), else the padded ``bmm``
  (:func:`~lightning_par.expert_parallel.grouped.choose_form` with ``requested="grouped_mm"``);
* **loop**: the per-expert loop as it is now (the fallback form: the weights ``unbind``-ed once);
* **loop, indexed**: the loop as ``GroupedExperts`` ran it before (``w1[e]`` per expert: indexing's backward writes a
  zero-filled gradient of all experts per expert, so its cost grows with the square of the experts).

The fastest step of each (2 warm-up steps not counted) is reported: on a machine shared with other processes the
fastest is the least disturbed.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["measure", "render", "run"]

#: This benchmark's section in ``recipes/benchmark.py`` (``--only moe``) and its place in the full run.
SECTION = "moe"
ORDER = 71

EXPERTS = (8, 64, 256)
_FULL = dict(dim=128, hidden=256, tokens=4096, steps=10)
_QUICK = dict(dim=128, hidden=256, tokens=2048, steps=5)


def measure(num_experts: int, dim: int, hidden: int, tokens: int, steps: int, device: str = "cpu",
            dtype: Any = None) -> dict[str, Any]:
    """Fastest seconds of one forward + backward of a MoE layer in the chosen form, as the loop and as the indexed
    loop (see the module docstring).

    Returns:
        ``{"experts", "form" (the chosen one), "grouped_s", "loop_s", "indexed_s"}``.
    """
    import torch

    from lightning_par.expert_parallel.grouped import choose_form
    from lightning_par.models.moe import MoE

    dtype = dtype or torch.float32
    torch.manual_seed(0)
    layer = MoE(dim, hidden, num_experts, top_k=2, aux_loss_coeff=0.0, z_loss_coeff=0.0).to(device, dtype)
    x = torch.randn(tokens // 64, 64, dim, device=device, dtype=dtype)
    w = layer.experts.w1
    # the grouped form: grouped_mm where it runs, else the padded bmm (what "auto" takes off the CPU; on CPU "auto" is
    # the loop, measured faster there by this benchmark)
    chosen = choose_form(x.reshape(-1, dim), (w, layer.experts.w2), requested="grouped_mm")
    times: dict[str, list[float]] = {"grouped": [], "loop": [], "indexed": []}
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    experts = layer.experts

    def indexed(x: Any, counts: Any, host_counts: Any = None) -> Any:  # GroupedExperts.forward before the forms
        chunks = x.split(counts.tolist())
        return torch.cat([torch.nn.functional.gelu(c @ experts.w1[e]) @ experts.w2[e] for e, c in enumerate(chunks)])

    plain = experts.forward
    for step in range(steps + 2):
        for name, form in (("grouped", chosen), ("loop", "loop"), ("indexed", "loop")):
            experts.form = form
            experts.forward = indexed if name == "indexed" else plain
            layer.zero_grad(set_to_none=True)
            sync()
            start = time.perf_counter()
            layer(x).float().pow(2).mean().backward()
            sync()
            if step >= 2:
                times[name].append(time.perf_counter() - start)
    experts.forward = plain
    return {"experts": num_experts, "form": chosen, **{f"{k}_s": min(v) for k, v in times.items()}}


def render(rows: list[dict[str, Any]], spec: dict[str, int], device: str = "cpu") -> str:
    """The markdown table of :func:`run`."""
    lines = [
        f"MoE block forward + backward, width {spec['dim']}, expert width {spec['hidden']}, {spec['tokens']} tokens, "
        f"top-2, dropless, {device}, one thread; fastest of {spec['steps']} steps, the three in turns.",
        "",
        "| experts | grouped form | grouped (ms) | loop (ms) | loop / grouped | loop, indexed (ms) "
        "| loop, indexed / grouped |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['experts']} | {r['form']} | {r['grouped_s'] * 1e3:.1f} | {r['loop_s'] * 1e3:.1f} | "
                     f"{r['loop_s'] / r['grouped_s']:.2f} | {r['indexed_s'] * 1e3:.1f} | "
                     f"{r['indexed_s'] / r['grouped_s']:.2f} |")
    return "\n".join(lines)


def run(quick: bool = False) -> str:
    """Measure 8, 64 and 256 experts on the CPU; return the markdown table.

    Args:
        quick: 2,048 tokens and 5 steps instead of 4,096 and 10.
    """
    import torch

    spec = _QUICK if quick else _FULL
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = [measure(e, spec["dim"], spec["hidden"], spec["tokens"], spec["steps"]) for e in EXPERTS]
    finally:
        torch.set_num_threads(threads)
    return render(rows, spec)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and steps")
    print(run(quick=parser.parse_args().quick))
