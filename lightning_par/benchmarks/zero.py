"""Benchmark rows for ZeRO: memory and communication per rank against the paper's formulas, and step time.

For stages 0 (``ddp_overlap``) to 3 at dp 2 and 4, in one process-group launch per dp size (the stages run one after
another, in rounds A B C D A B C D so that drift on a shared machine hits all alike), on the reference GPT with fp32
AdamW on CPU:

* **memory**: the bytes of parameters, gradients and optimizer state this rank holds at the optimizer step, counted
  from the local shards' storages (:func:`lightning_par.data_parallel.zero_memory.zero_state_bytes`), maximum over
  ranks and steps, divided by the paper's formula (Rajbhandari et al., SC'20, §5: DDP ``16 Psi``, Z1
  ``8 Psi + 8 Psi/N``, Z2 ``4 Psi + 12 Psi/N``, Z3 ``16 Psi/N``). Above 1 only by Adam's 4-byte step counter per
  tensor and by padding (none for these shapes).
* **communication**: the bytes one rank sends in one optimizer step, counted at the collectives
  (:class:`lightning_par.data_parallel.comm_volume.CommCounter`, ring volumes), divided by the paper's §7 figure
  (DDP, Z1, Z2 ``2 Psi (N-1)/N``; Z3 ``3 Psi (N-1)/N``; 4 bytes per element).
* **step time**: median seconds per step after warm-up, relative to ``ddp_overlap`` at the same dp size. On CPU with
  gloo, absolute times mean little.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import lightning as L

__all__ = ["run"]

_QUICK = dict(model=dict(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=256, dropout=0.0), micro_batch=4,
              steps=6, warmup=2, rounds=1)
_FULL = dict(model=dict(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=256, dropout=0.0), micro_batch=8,
             steps=16, warmup=3, rounds=2)
_BUCKET_CAP_MB = 1.0


class _Probe(L.Callback):
    """Step wall times and the maximum model-state bytes seen at optimizer steps."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.bytes: dict[str, int] = {}
        self._t0 = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._t0)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        from lightning_par.data_parallel.zero_memory import zero_state_bytes

        for key, value in zero_state_bytes(pl_module, trainer.optimizers).items():
            self.bytes[key] = max(self.bytes.get(key, 0), value)


def _fit(stage: int, setup: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from lightning_par.data_parallel.comm_volume import CommVolumeCallback
    from lightning_par.models import GPTConfig, GPTLightningModule
    from lightning_par.strategies import DDPOverlapStrategy
    from lightning_par.strategies.zero import ZeroStrategy

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    model = setup["model"]
    torch.manual_seed(0)
    module = GPTLightningModule(GPTConfig(**model), learning_rate=1e-3)
    g = torch.Generator().manual_seed(0)
    shape = (setup["steps"] * setup["micro_batch"] * world, model["block_size"] + 1)
    data = torch.randint(0, model["vocab_size"], shape, generator=g)
    dataset = TensorDataset(data[:, :-1].contiguous(), data[:, 1:].contiguous())
    sampler = DistributedSampler(dataset, world, rank, shuffle=False)
    loader = DataLoader(dataset, batch_size=setup["micro_batch"], sampler=sampler)
    if stage == 0:
        strategy: Any = DDPOverlapStrategy(bucket_cap_mb=_BUCKET_CAP_MB, gradient_as_bucket_view=True, timeout_s=300)
    else:
        strategy = ZeroStrategy(stage=stage, bucket_cap_mb=_BUCKET_CAP_MB if stage < 3 else None, timeout_s=300)
    probe, comm = _Probe(), CommVolumeCallback(step=1)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=setup["steps"], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, limit_val_batches=0, callbacks=[probe, comm],
    )
    trainer.fit(module, loader)
    numel = sum(p.numel() for p in GPTLightningModule(GPTConfig(**model)).parameters())
    # Step 1 ran under the communication counter: leave it out of the timings with the warm-up.
    times = [t for i, t in enumerate(probe.times) if i >= setup["warmup"] and i != comm.step]
    return {"times": times, "bytes": probe.bytes, "comm": comm.bytes_per_step, "numel": numel}


def _worker(setup: dict[str, Any]) -> dict[int, list[dict[str, Any]]]:
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: os.environ[k] for k in names}
    out: dict[int, list[dict[str, Any]]] = {s: [] for s in (0, 1, 2, 3)}
    for _ in range(setup["rounds"]):
        for stage in (0, 1, 2, 3):
            os.environ.update(env)  # Lightning's environment teardown removes WORLD_SIZE after a fit
            out[stage].append(_fit(stage, setup))
    return out


def run(quick: bool = False, dp_sizes: tuple[int, ...] = (2, 4)) -> str:
    """Measure and return the markdown table (see the module docstring).

    Args:
        quick: a 2-layer GPT of width 64, 6 steps, 1 round (about half a minute on 2 cores) instead of the 4x128
            "small" shape, 16 steps, 2 rounds.
        dp_sizes: data-parallel sizes (one launch each).
    """
    from lightning_par.data_parallel.zero_memory import paper_comm_bytes, paper_state_bytes
    from lightning_par.launcher import run_distributed

    setup = _QUICK if quick else _FULL
    model = setup["model"]
    lines = [
        f"### ZeRO stages vs the paper (CPU, gloo, fp32 AdamW), GPT {model['n_layer']}x{model['n_embd']}, "
        f"micro-batch {setup['micro_batch']}x{model['block_size']} per rank, bucket_cap_mb={_BUCKET_CAP_MB} "
        f"(stages 0-2), {setup['rounds']} round(s) x {setup['steps']} steps",
        "",
        "| stage | dp | Psi | bytes/rank measured | paper formula | measured / formula | sent/step measured | "
        "paper §7 | measured / paper | step time / ddp_overlap |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for dp in dp_sizes:
        threads = max(1, (os.cpu_count() or 1) // dp)
        per_rank = run_distributed(_worker, dp, (setup,), timeout_s=900, threads_per_rank=threads)
        base = None
        for stage in (0, 1, 2, 3):
            runs = [r[stage] for r in per_rank]
            numel = runs[0][0]["numel"]
            measured = max(sum(rr[0]["bytes"].values()) for rr in runs)
            formula = paper_state_bytes(stage, numel, dp)
            sent = max(rr[0]["comm"] for rr in runs)
            theory = paper_comm_bytes(stage, numel, dp)
            step = statistics.median(t for rr in runs for run_ in rr for t in run_["times"])
            base = step if stage == 0 else base
            name = "0 (ddp_overlap)" if stage == 0 else str(stage)
            lines.append(
                f"| {name} | {dp} | {numel} | {measured} | {formula:.0f} | {measured / formula:.4f} | {sent:.0f} | "
                f"{theory:.0f} | {sent / theory:.3f} | {step / base:.2f} |"
            )
    root = 2 * model["vocab_size"] * model["n_embd"] + model["block_size"] * model["n_embd"] + 2 * model["n_embd"]
    numel = per_rank[0][0][0]["numel"]
    lines += [
        "",
        "Memory is above 1 only by AdamW's 4-byte `step` tensor per parameter tensor. Communication: stage 1 "
        "all-reduces gradients and then all-gathers parameters, 3 Psi (N-1)/N, hence 1.5 (the paper's P_os "
        "reduce-scatters: 2 Psi); stage 2 = reduce-scatter + all-gather = 1.0; stage 3 = all-gather in forward and "
        f"in backward + reduce-scatter, minus the root unit (embeddings, final norm, head: {root} of {numel} "
        f"parameters) that FSDP2 keeps gathered from forward to backward: expected (3 Psi - root) / 3 Psi = "
        f"{(3 * numel - root) / (3 * numel):.3f}. A few bytes more come from the all-reduce of the gradient norm "
        "when clipping (off here).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    print(run(quick=parser.parse_args().quick))
