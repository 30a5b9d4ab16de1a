"""Benchmark rows for the experts' forms: one MoE block's step time, the grouped form vs the per-expert loop, at 8, 64
and 256 experts, and at 64 experts over a curve of tokens per expert.

One :class:`~lightning_par.models.moe.MoE` layer (width 128, expert width 256, softmax routing, dropless) runs forward
+ backward in this process on one thread in four ways taking turns step by step on the same batch and weights, so
every ratio comes from one run:

* **grouped**: ``torch._grouped_mm`` (:func:`~lightning_par.expert_parallel.grouped.choose_form` with
  ``requested="grouped_mm"``: torch's own on CUDA bf16; on CPU forward and backward as ``grouped_mm`` calls), else the
  padded ``bmm``;
* **bmm**: the tokens scattered into a zero-padded ``(experts, most tokens of an expert, d)`` batch, two ``bmm``;
* **loop**: the per-expert loop as it is now (the fallback form: the weights ``unbind``-ed once);
* **loop, indexed**: the loop as ``GroupedExperts`` ran it before (``w1[e]`` per expert: indexing's backward writes a
  zero-filled gradient of all experts per expert, so its cost grows with the square of the experts).

Two tables: the experts table (4,096 tokens, top-2, at 8, 64 and 256 experts: 1,024, 128 and 32 routed copies per
expert) and the curve (64 experts, top-2, 128 to 8,192 tokens: 4 to 256 routed copies per expert, from few tokens per
expert, as in DeepSeek-scale layers where each of many experts sees a small share of a micro-batch and the loop's
per-expert overhead dominates, to many, where the matmuls' arithmetic does). The fastest step of each (2 warm-up steps not counted) is reported: on a machine shared with other
processes the fastest is the least disturbed. On the CPU a step's time is this thread's CPU time (``time.thread_time``;
the block runs on one thread), on CUDA the wall clock after a synchronisation. The last line (:func:`summary`) states
loop / grouped at 64 experts at each measured setting and where it reaches issue 49's 2x; ``python -m
lightning_par.benchmarks.moe --curve [--tokens 64,128,4096] [--widths 64,128]`` measures the 64-expert curve alone.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["measure", "render", "run"]

#: This benchmark's section in ``recipes/benchmark.py`` (``--only moe``) and its place in the full run.
SECTION = "moe"
ORDER = 71

EXPERTS = (8, 64, 256)
#: the curve: 64 experts, top-2, these many tokens (tokens * 2 / 64 routed copies per expert)
CURVE_TOKENS = (128, 512, 2048, 8192)
_FULL = dict(dim=128, hidden=256, tokens=4096, top_k=2, steps=10, curve=CURVE_TOKENS)
_QUICK = dict(dim=128, hidden=256, tokens=2048, top_k=2, steps=5, curve=(128, 2048))
#: the forms measured, in turns, with the row's key
_FORMS = ("grouped", "bmm", "loop", "indexed")


def measure(num_experts: int, dim: int, hidden: int, tokens: int, steps: int, device: str = "cpu",
            dtype: Any = None, top_k: int = 2) -> dict[str, Any]:
    """Fastest seconds of one forward + backward of a MoE layer in each form (see the module docstring).

    Returns:
        ``{"experts", "tokens", "top_k", "form" (the grouped one chosen), "grouped_s", "bmm_s", "loop_s",
        "indexed_s"}``.
    """
    import torch

    from lightning_par.expert_parallel.grouped import choose_form
    from lightning_par.models.moe import MoE

    dtype = dtype or torch.float32
    torch.manual_seed(0)
    layer = MoE(dim, hidden, num_experts, top_k=top_k, aux_loss_coeff=0.0, z_loss_coeff=0.0).to(device, dtype)
    seq = min(tokens, 64)
    x = torch.randn(tokens // seq, seq, dim, device=device, dtype=dtype)
    experts = layer.experts
    chosen = choose_form(x.reshape(-1, dim), (experts.w1, experts.w2), requested="grouped_mm")
    times: dict[str, list[float]] = {name: [] for name in _FORMS}
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    # on the CPU the step runs on this one thread (torch.set_num_threads(1) in run()): its CPU time, not the wall
    # clock, which on a machine shared with other jobs also counts the waits for a core (measured here at a load of
    # 15 on 2 cores: wall times 3-4x the CPU times, loop/grouped ratios 20% apart from run to run)
    clock = time.perf_counter if device.startswith("cuda") else time.thread_time

    def indexed(x: Any, counts: Any, host_counts: Any = None) -> Any:  # GroupedExperts.forward before the forms
        chunks = x.split(counts.tolist())
        return torch.cat([torch.nn.functional.gelu(c @ experts.w1[e]) @ experts.w2[e] for e, c in enumerate(chunks)])

    plain = experts.forward
    forms = {"grouped": chosen, "bmm": "bmm", "loop": "loop", "indexed": "loop"}
    for step in range(steps + 2):
        for name in _FORMS:
            experts.form = forms[name]
            experts.forward = indexed if name == "indexed" else plain
            layer.zero_grad(set_to_none=True)
            sync()
            start = clock()
            layer(x).float().pow(2).mean().backward()
            sync()
            if step >= 2:
                times[name].append(clock() - start)
    experts.forward = plain
    return {"experts": num_experts, "tokens": tokens, "top_k": top_k, "form": chosen,
            **{f"{k}_s": min(v) for k, v in times.items()}}


def render(rows: list[dict[str, Any]], spec: dict[str, int], device: str = "cpu", title: str | None = None) -> str:
    """The markdown table of some rows of :func:`measure`."""
    lines = [
        title or (f"MoE block forward + backward, width {spec['dim']}, expert width {spec['hidden']}, softmax routing, "
                  f"dropless, {device}, one thread; fastest of {spec['steps']} steps, the four in turns."),
        "",
        "| experts | top-k | tokens | copies / expert | grouped form | grouped (ms) | bmm (ms) | loop (ms) "
        "| loop / grouped | loop, indexed (ms) | loop, indexed / grouped |",
        "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        per_expert = r["tokens"] * r["top_k"] / r["experts"]
        lines.append(f"| {r['experts']} | {r['top_k']} | {r['tokens']} | {per_expert:g} | {r['form']} "
                     f"| {r['grouped_s'] * 1e3:.1f} | {r['bmm_s'] * 1e3:.1f} | {r['loop_s'] * 1e3:.1f} "
                     f"| {r['loop_s'] / r['grouped_s']:.2f} | {r['indexed_s'] * 1e3:.1f} "
                     f"| {r['indexed_s'] / r['grouped_s']:.2f} |")
    return "\n".join(lines)


def run(quick: bool = False, curve_only: bool = False, tokens: tuple[int, ...] | None = None,
        widths: tuple[int, int] | None = None) -> str:
    """Measure 8, 64 and 256 experts, then the 64-expert curve, on the CPU; return the markdown tables and the
    :func:`summary` line.

    Args:
        quick: 2,048 tokens, 5 steps and two points of the curve instead of 4,096, 10 and four.
        curve_only: only the 64-expert curve, with the experts table's token count among its points (the 8- and
            256-expert rows skipped: the latter's indexed loop alone takes minutes).
        tokens: the curve's token counts instead of the default ones (with ``curve_only``).
        widths: ``(width, expert width)`` instead of ``(128, 256)``.
    """
    import torch

    spec = dict(_QUICK if quick else _FULL)
    if tokens:
        spec["curve"] = tuple(tokens)
    if widths:
        spec["dim"], spec["hidden"] = widths
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = [] if curve_only else [
            measure(e, spec["dim"], spec["hidden"], spec["tokens"], spec["steps"], top_k=spec["top_k"])
            for e in EXPERTS]
        points = spec["curve"] if tokens or not curve_only else sorted({*spec["curve"], spec["tokens"]})
        curve = [measure(64, spec["dim"], spec["hidden"], t, spec["steps"], top_k=spec["top_k"]) for t in points]
    finally:
        torch.set_num_threads(threads)
    tables = [render(rows, spec)] if rows else []
    tables.append(render(curve, spec, title=None if curve_only else (
        "The same at 64 experts over tokens per expert, from few to many:")))
    return "\n\n".join([*tables, summary(rows + curve)])


def summary(rows: list[dict[str, Any]], aim: float = 2.0) -> str:
    """One line: the loop / grouped ratios at 64 experts of ``rows`` and the settings (routed copies per expert) where
    the grouped form is at least ``aim`` times faster than the loop (issue 49's aim: 2x at 64 experts)."""
    at64 = sorted((r["tokens"] * r["top_k"] / r["experts"], r["loop_s"] / r["grouped_s"]) for r in rows
                  if r["experts"] == 64)
    cells = ", ".join(f"{ratio:.2f} at {copies:g} copies/expert" for copies, ratio in at64)
    reached = [f"{copies:g}" for copies, ratio in at64 if ratio >= aim]
    where = f"reached at {', '.join(reached)} copies/expert" if reached else "not reached in this run"
    return f"64 experts, loop / grouped: {cells}; {aim:g}x {where}."


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and steps")
    parser.add_argument("--curve", action="store_true", help="only the 64-expert curve (and the summary line)")
    parser.add_argument("--tokens", help="with --curve: comma-separated token counts (e.g. 64,128,4096)")
    parser.add_argument("--widths", help="width,expert width (default 128,256)")
    args = parser.parse_args()

    def ints(text: str | None, name: str) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(",")) if text else ()
        except ValueError:
            values = (0,)
        if any(v < 1 for v in values):
            parser.error(f"--{name}={text!r}: expected comma-separated integers >= 1")
        return values

    widths = ints(args.widths, "widths")
    if widths and len(widths) != 2:
        parser.error(f"--widths={args.widths!r}: expected two integers, width,expert width")
    print(run(quick=args.quick, curve_only=args.curve, tokens=ints(args.tokens, "tokens") or None,
              widths=widths or None))  # type: ignore[arg-type]
