"""Benchmark rows for one GPU: tokens/s and MFU of the reference GPT in bf16, with ``torch.compile`` off and on.

For the GPT-2-shaped presets (``gpt2``: 12 layers x 768, the 124M-parameter shape, here with an untied head and the
vocabulary padded to 50304; ``gpt2-medium``: 24 x 1024, the 350M shape), one process trains ``steps`` optimizer steps
(forward and backward under ``torch.autocast(bfloat16)`` with fp32 parameters, the module's own AdamW) on random
tokens of the full context, after ``warmup`` steps that are not timed (compilation, allocator, cuDNN/cuBLAS
heuristics), and reports:

* **tokens/s**: ``batch * block_size * steps`` over the timed wall time (``torch.cuda.synchronize`` before each
  clock reading);
* **MFU**: ``flops_per_token * tokens/s / peak`` (PaLM, Chowdhery et al. 2022, App. B), ``flops_per_token`` from
  :meth:`~lightning_par.models.GPTConfig.flops_per_token` and the peak bf16 dense FLOP/s of the device from Lightning's
  table (``lightning.fabric.utilities.throughput.get_available_flops``);
* **peak memory**: ``torch.cuda.max_memory_allocated``.

Without a CUDA device the section measures nothing and says so (the harness itself runs on CPU in the tests, where
there is no peak FLOP/s and so no MFU).
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["PRESETS", "measure", "run"]

#: This benchmark's section in ``recipes/benchmark.py`` (``--only gpu``) and its place in the full run.
SECTION = "gpu"
ORDER = 80

#: presets -> micro-batch per step at block_size 1024 (fits an 80 GB GPU with fp32 AdamW state).
PRESETS: dict[str, int] = {"gpt2": 16, "gpt2-medium": 8}


def measure(
    preset: str,
    compiled: bool,
    device: str = "cuda",
    batch: int = 16,
    steps: int = 20,
    warmup: int = 5,
    **overrides: Any,
) -> dict[str, Any]:
    """Train ``steps`` timed steps of one preset on one device and return its figures.

    Args:
        preset: a key of :data:`lightning_par.models.GPT_PRESETS`.
        compiled: wrap the network in ``torch.compile``.
        device: ``"cuda"`` (or ``"cpu"`` to test the harness).
        batch: sequences per step.
        steps: timed optimizer steps.
        warmup: untimed steps before them.
        **overrides: :class:`~lightning_par.models.GPTConfig` fields (e.g. a shorter ``block_size``).

    Returns:
        ``preset``, ``compiled``, ``params``, ``tokens_per_s``, ``step_s``, ``mfu`` (``None`` without a known peak),
        ``peak_mem_bytes`` (``None`` off CUDA), ``loss`` (the last step's).
    """
    import torch
    from lightning.fabric.utilities.throughput import get_available_flops

    from lightning_par.models import GPTConfig, GPTLightningModule

    torch.manual_seed(0)
    dev = torch.device(device)
    module = GPTLightningModule(GPTConfig.from_preset(preset, **overrides)).to(dev)
    config = module.config
    network = torch.compile(module.model) if compiled else module.model
    optimizer = module.configure_optimizers()["optimizer"]
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, config.vocab_size, (batch, config.block_size), generator=g).to(dev)
    y = torch.randint(0, config.vocab_size, (batch, config.block_size), generator=g).to(dev)
    cuda = dev.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    def step() -> torch.Tensor:
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = module.loss_fn(network(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    sync()
    elapsed = time.perf_counter() - start
    tokens_per_s = batch * config.block_size * steps / elapsed
    peak = get_available_flops(dev, torch.bfloat16) if cuda else None
    return {
        "preset": preset,
        "compiled": compiled,
        "params": sum(p.numel() for p in module.parameters()),
        "tokens_per_s": tokens_per_s,
        "step_s": elapsed / steps,
        "mfu": config.flops_per_token() * tokens_per_s / peak if peak else None,
        "peak_mem_bytes": torch.cuda.max_memory_allocated(dev) if cuda else None,
        "loss": float(loss),
    }


def run(quick: bool = False) -> str:
    """Measure both presets with ``torch.compile`` off and on, on this machine's first GPU.

    Args:
        quick: fewer steps (5 timed after 3 untimed).

    Returns:
        A markdown table, or one line saying that there is no CUDA device and nothing was measured.
    """
    import torch

    if not torch.cuda.is_available():
        return ("Single GPU: not measured (no CUDA device on this machine). On a GPU this section reports tokens/s, "
                "MFU and peak memory of the GPT presets gpt2 and gpt2-medium in bf16, torch.compile off and on.")
    steps, warmup = (5, 3) if quick else (20, 5)
    name = torch.cuda.get_device_name(0)
    lines = [
        f"Single GPU ({name}), bf16 autocast, fp32 AdamW, block_size 1024, {steps} timed steps after {warmup}.",
        "",
        "| preset | params | batch | torch.compile | tokens/s | vs eager | MFU | step (s) | peak memory (GiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for preset, batch in PRESETS.items():
        eager = None
        for compiled in (False, True):
            r = measure(preset, compiled, "cuda", batch=batch, steps=steps, warmup=warmup)
            eager = eager or r["tokens_per_s"]
            mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
            lines.append(
                f"| {preset} | {r['params'] / 1e6:.1f}M | {batch} | {'on' if compiled else 'off'} | "
                f"{r['tokens_per_s']:.0f} | {r['tokens_per_s'] / eager:.2f} | {mfu} | {r['step_s']:.3f} | "
                f"{r['peak_mem_bytes'] / 2**30:.1f} |"
            )
            torch.cuda.empty_cache()
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    print(run(quick=parser.parse_args().quick))
