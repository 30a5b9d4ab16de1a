"""Benchmark rows for data parallelism: ``ddp_overlap`` vs Lightning's ``DDPStrategy`` vs a raw torch DDP loop.

Same model, global batch, data and number of steps, world size 2 on CPU (gloo), the three measured one after another
in rounds (A B C A B C ...) so that drift on a shared machine hits all three alike. Reports the median step time of
each relative to the raw torch loop, and the fraction of ``ddp_overlap``'s all-reduce time hidden behind backward.
On CPU absolute times mean little; the ratios are the result.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import lightning as L

__all__ = ["StepTimer", "run"]

_MODEL = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=256, dropout=0.0)
_MICRO_BATCH = 8


class StepTimer(L.Callback):
    """Wall time of each training batch, in seconds."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._t0 = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._t0)


def _make_data(n: int):
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, _MODEL["vocab_size"], (n, _MODEL["block_size"] + 1), generator=g)
    return TensorDataset(data[:, :-1].contiguous(), data[:, 1:].contiguous())


def _lightning_worker(mode: str, steps: int, bucket_cap_mb: float) -> dict[str, Any]:
    import torch
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, DistributedSampler

    from lightning_par.models import GPTConfig, GPTLightningModule
    from lightning_par.strategies import DDPOverlapStrategy

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.manual_seed(0)
    module = GPTLightningModule(GPTConfig(**_MODEL), learning_rate=1e-3)
    data = _make_data(steps * _MICRO_BATCH * world)
    loader = DataLoader(data, batch_size=_MICRO_BATCH, sampler=DistributedSampler(data, world, rank, shuffle=False))
    strategy = (
        DDPOverlapStrategy(bucket_cap_mb=bucket_cap_mb, timeout_s=120)
        if mode == "ddp_overlap"
        else DDPStrategy(bucket_cap_mb=bucket_cap_mb)
    )
    timer = StepTimer()
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, limit_val_batches=0, callbacks=[timer],
    )
    trainer.fit(module, loader)
    extras = strategy.summary_extras() if hasattr(strategy, "summary_extras") else {}
    return {"times": timer.times, "extras": extras}


def _raw_worker(steps: int, bucket_cap_mb: float) -> dict[str, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from lightning_par.launcher import init_process_group_from_env
    from lightning_par.models import GPT, GPTConfig, GPTLightningModule

    init_process_group_from_env(timeout_s=120)
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.manual_seed(0)
    model = DDP(GPT(GPTConfig(**_MODEL)), bucket_cap_mb=bucket_cap_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = _make_data(steps * _MICRO_BATCH * world)
    loader = DataLoader(data, batch_size=_MICRO_BATCH, sampler=DistributedSampler(data, world, rank, shuffle=False))
    times = []
    for x, y in loader:
        t0 = time.perf_counter()
        loss = GPTLightningModule.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return {"times": times, "extras": {}}


def run(quick: bool = False, world_size: int = 2, bucket_cap_mb: float = 1.0) -> str:
    """Measure and return the markdown table (see the module docstring).

    Args:
        quick: 1 round of 12 steps instead of 3 rounds of 30.
        world_size: processes (all data-parallel).
        bucket_cap_mb: bucket size for all three (small enough that the model spans several buckets).
    """
    from lightning_par.launcher import run_distributed

    rounds, steps, warmup = (1, 12, 2) if quick else (3, 30, 5)
    threads = max(1, (os.cpu_count() or 1) // world_size)
    samples: dict[str, list[float]] = {"raw torch DDP": [], "Lightning DDPStrategy": [], "ddp_overlap": []}
    overlap: list[float] = []
    for _ in range(rounds):
        res = run_distributed(_raw_worker, world_size, (steps, bucket_cap_mb), timeout_s=600, threads_per_rank=threads)
        samples["raw torch DDP"] += res[0]["times"][warmup:]
        res = run_distributed(_lightning_worker, world_size, ("lightning_ddp", steps, bucket_cap_mb), timeout_s=600, threads_per_rank=threads)
        samples["Lightning DDPStrategy"] += res[0]["times"][warmup:]
        res = run_distributed(_lightning_worker, world_size, ("ddp_overlap", steps, bucket_cap_mb), timeout_s=600, threads_per_rank=threads)
        samples["ddp_overlap"] += res[0]["times"][warmup:]
        overlap.append(res[0]["extras"]["comm_overlap_fraction"])
    base = statistics.median(samples["raw torch DDP"])
    lines = [
        f"### Data parallel, world size {world_size} (CPU, gloo), GPT {_MODEL['n_layer']}x{_MODEL['n_embd']}, "
        f"micro-batch {_MICRO_BATCH}x{_MODEL['block_size']}, bucket_cap_mb={bucket_cap_mb}, {rounds} round(s) x {steps - warmup} steps",
        "",
        "| loop | median step (ms) | step time / raw torch DDP |",
        "|---|---:|---:|",
    ]
    for name, times in samples.items():
        med = statistics.median(times)
        lines.append(f"| {name} | {med * 1e3:.1f} | {med / base:.3f} |")
    lines += ["", f"ddp_overlap: share of all-reduce time hidden behind backward = {statistics.mean(overlap):.3f}"]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    print(run(quick=parser.parse_args().quick))
