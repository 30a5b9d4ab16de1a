"""Benchmark rows for checkpointing: the step-time cost of a checkpoint written synchronously against one written in
the background (``trainer.async_checkpoint=true``), and the cost of the commit record's checksums.

One launch of ``world_size`` ranks (CPU, gloo, the ``small`` GPT, fp32 AdamW, ``ddp_overlap``): ``Trainer.fit`` with
:class:`~lightning_par.fault.step_checkpoint.StepCheckpoint` saving every ``every`` steps synchronously, in the
background, and not at all, in rounds (none, sync, async, none, ...) so drift in the machine's load reaches all three.
A step's *period* is the wall time from one batch's start to the next one's: it includes a save made at the end of
the batch. Figures, each a ratio within one round (the three fits next to each other in time), then the median over
rounds: the mean period over every measured step (saves included, as a run pays them) and the median period of the
steps that saved, each over the same without checkpoints; and the extra time per save, ``(mean - mean without) *
every``, of the background save over the synchronous one's. The CPU column is the training thread's own CPU time
(``time.thread_time``) of a saving step over a plain one: the work the save leaves on the training thread, which
other jobs on the machine disturb far less than wall time (it misses the background writer's thread).

The checksum rows time :func:`lightning_par.checkpoint.verify.file_manifest` (CRC-32) and SHA-256 over one of the
checkpoints written, against the time the synchronous save took.
"""

from __future__ import annotations

import hashlib
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_par.benchmarks.common import GPT_SHAPES, token_batches

__all__ = ["run"]

#: This benchmark's section in ``recipes/benchmark.py`` (``--only checkpoint``) and its place in the full run.
SECTION = "checkpoint"
ORDER = 90

_SHAPE = GPT_SHAPES["small"]
_MICRO_BATCH = 8
_QUICK = dict(every=4, steps=16, warmup=4, rounds=3)
_FULL = dict(every=4, steps=24, warmup=4, rounds=8)
_MODES = ("no checkpoint", "sync", "async")


class _Periods(L.Callback):
    """Wall and training-thread CPU seconds from each batch's start to the next one's, and the global step after
    each batch: ``(wall_s, step, cpu_s)``."""

    def __init__(self) -> None:
        self.starts: list[tuple[float, float]] = []
        self.steps: list[int] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.starts.append((time.perf_counter(), time.thread_time()))

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.steps.append(trainer.global_step)

    def periods(self) -> list[tuple[float, int, float]]:
        return [(b[0] - a[0], s, b[1] - a[1]) for a, b, s in zip(self.starts, self.starts[1:], self.steps)]


def _fit(mode: str, setup: dict[str, Any], env: dict[str, str], directory: Path) -> list[tuple[float, int]]:
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from lightning_par.fault.step_checkpoint import StepCheckpoint
    from lightning_par.models import GPTConfig, GPTLightningModule
    from lightning_par.strategies import DDPOverlapStrategy

    os.environ.update(env)  # Lightning's environment teardown removes WORLD_SIZE after a fit
    world, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
    steps = setup["warmup"] + setup["steps"] + 1
    xs, ys = zip(*token_batches(steps * world, _MICRO_BATCH, _SHAPE["block_size"], _SHAPE["vocab_size"]))
    data = TensorDataset(torch.cat(xs), torch.cat(ys))
    loader = DataLoader(data, batch_size=_MICRO_BATCH, sampler=DistributedSampler(data, world, rank, shuffle=False))
    torch.manual_seed(0)
    module = GPTLightningModule(GPTConfig(**_SHAPE, dropout=0.0), learning_rate=1e-3)
    timer = _Periods()
    callbacks: list[Any] = [timer]
    if mode != "no checkpoint":
        callbacks.append(StepCheckpoint(directory, setup["every"], keep_last_k=2, async_save=mode == "async"))
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=DDPOverlapStrategy(timeout_s=300), max_steps=steps, logger=False,
        enable_checkpointing=mode != "no checkpoint", enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, limit_val_batches=0, callbacks=callbacks, default_root_dir=str(directory),
    )
    trainer.fit(module, loader)
    return timer.periods()[setup["warmup"]:]


def _checksum_s(directory: Path) -> dict[str, float]:
    from lightning_par.checkpoint.verify import file_manifest

    ckpt = max(directory.glob("step-*.ckpt"))
    files = [p for p in ckpt.iterdir() if p.is_file()]
    start = time.perf_counter()
    file_manifest(ckpt)
    crc = time.perf_counter() - start
    start = time.perf_counter()
    for p in files:
        hashlib.sha256(p.read_bytes()).hexdigest()
    sha = time.perf_counter() - start
    return {"bytes": sum(p.stat().st_size for p in files), "crc32_s": crc, "sha256_s": sha}


def _worker(setup: dict[str, Any], root: str) -> dict[str, Any]:
    from lightning_par.launcher import init_process_group_from_env

    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: os.environ[k] for k in names}
    init_process_group_from_env(timeout_s=600)
    periods: dict[str, list[tuple[float, int]]] = {m: [] for m in _MODES}
    for r in range(setup["rounds"]):
        for mode in _MODES:
            periods[mode] += _fit(mode, setup, env, Path(root) / f"{mode}-{r}")
    checksum = _checksum_s(Path(root) / "sync-0") if int(env["RANK"]) == 0 else None
    return {"periods": periods, "checksum": checksum}


def run(quick: bool = False, world_size: int = 2) -> str:
    """Measure and return the markdown table (see the module docstring).

    Args:
        quick: 2 rounds of 16 measured steps per mode (4 rounds of 24 without); a save every 4 steps.
        world_size: processes (all data-parallel).
    """
    from lightning_par.launcher import run_distributed

    setup = _QUICK if quick else _FULL
    every = setup["every"]
    with tempfile.TemporaryDirectory(prefix="lp-bench-ckpt-") as root:
        res = run_distributed(_worker, world_size, (setup, root), timeout_s=1800, threads_per_rank=1)
    # A step is as slow as its slowest rank: the max over ranks, step by step; then per round.
    per_rank = [r["periods"] for r in res]
    n = setup["steps"]
    rounds = [{m: [(max(rank[m][i][0] for rank in per_rank), per_rank[0][m][i][1]) for i in range(r * n, (r + 1) * n)]
               for m in _MODES} for r in range(setup["rounds"])]
    cpu_rounds = [{m: [(max(rank[m][i][2] for rank in per_rank), per_rank[0][m][i][1])
                       for i in range(r * n, (r + 1) * n)] for m in _MODES} for r in range(setup["rounds"])]

    def mean(v: list[tuple[float, int]]) -> float:
        return statistics.mean(t for t, _ in v)

    def saving(v: list[tuple[float, int]]) -> float:
        return statistics.median(t for t, s in v if s % every == 0)

    def plain(v: list[tuple[float, int]]) -> float:
        return statistics.median(t for t, _ in v)

    def med(f: Any, of: list[dict[str, Any]] = rounds) -> float:
        return statistics.median(f(r) for r in of)

    none = "no checkpoint"
    lines = [
        f"### Checkpoint cost, world size {world_size} (CPU, gloo), GPT small ({_SHAPE['n_layer']}x{_SHAPE['n_embd']}, "
        f"AdamW), ddp_overlap, a save every {every} steps; {setup['rounds']} rounds of {setup['steps']} measured "
        f"steps per mode, modes in turns; ratios within a round, median over rounds",
        "",
        "| checkpoint | mean step (ms) | mean step / no checkpoint | step with a save, median (ms) | "
        "saving step / plain step | extra per save (ms) | extra per save / sync | saving step / plain step, CPU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        f"| no checkpoint | {med(lambda r: mean(r[none])) * 1e3:.1f} | 1.000 | - | - | - | - | - |",
    ]
    for m in ("sync", "async"):
        extra = med(lambda r: (mean(r[m]) - mean(r[none])) * every)
        lines.append(
            f"| {m} | {med(lambda r: mean(r[m])) * 1e3:.1f} | {med(lambda r: mean(r[m]) / mean(r[none])):.3f} | "
            f"{med(lambda r: saving(r[m])) * 1e3:.1f} | {med(lambda r: saving(r[m]) / plain(r[none])):.3f} | "
            f"{extra * 1e3:.1f} | "
            f"{med(lambda r: (mean(r[m]) - mean(r[none])) / (mean(r['sync']) - mean(r[none]))):.3f} | "
            f"{med(lambda r: saving(r[m]) / plain(r[none]), cpu_rounds):.3f} |"
        )
    sync_saving = med(lambda r: saving(r["sync"]))
    c = res[0]["checksum"]
    lines += [
        "",
        f"Commit record checksums over one checkpoint ({c['bytes'] / 2**20:.1f} MiB, read from the page cache): "
        f"CRC-32 {c['crc32_s'] * 1e3:.1f} ms, SHA-256 {c['sha256_s'] * 1e3:.1f} ms "
        f"(SHA-256 / CRC-32 = {c['sha256_s'] / c['crc32_s']:.2f}); CRC-32 / median saving step (sync) = "
        f"{c['crc32_s'] / sync_saving:.3f}.",
    ]
    return "\n".join(lines)
