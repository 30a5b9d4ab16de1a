"""One-process references in a given Lightning precision, for the mixed-precision parity tests.

:func:`reference_fit_precision` replays, in one process, what a data/pipeline-parallel run computes: each dp replica's
batch cut into micro-batches, each micro-batch's forward and loss under the precision's context, gradients accumulated
per replica and averaged as the all-reduce does. For ``"bf16-mixed"`` the forward runs under
``torch.autocast("cpu", torch.bfloat16)`` with fp32 parameters (what Lightning's ``MixedPrecision`` does); for
``"16-mixed"`` under fp16 autocast with a ``torch.amp.GradScaler``; for ``"bf16-true"`` the module, its optimizer state
and the floating inputs are bf16 (Lightning's ``HalfPrecision``). With ``compute_dtype`` (FSDP2's
``MixedPrecisionPolicy(param_dtype=...)``) each replica computes with a copy of the parameters cast to that dtype and
its gradients are cast back to fp32 before the average.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import lightning as L
import torch

from tests.support.pipeline import _epochs, _replica_loader

__all__ = ["reference_fit_precision"]


def _context(precision: str) -> Any:
    if precision == "bf16-mixed":
        return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)
    if precision == "16-mixed":
        return torch.autocast("cpu", dtype=torch.float16, cache_enabled=False)
    return nullcontext()


def _cast_inputs(batch: Any, precision: str) -> Any:
    if precision != "bf16-true":
        return batch
    return tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in batch)


def reference_fit_precision(
    make_module: Callable[[], L.LightningModule],
    dataset: torch.utils.data.Dataset,
    micro_batch: int,
    steps: int,
    num_microbatches: int,
    dp_size: int,
    precision: str,
    compute_dtype: torch.dtype | None = None,
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``steps`` optimizer steps in one process (see the module docstring).

    Returns:
        Per-step losses (mean over micro-batches, then replicas), the final parameters and the initial ones.
    """
    torch.manual_seed(0)
    module = make_module()
    if precision == "bf16-true":
        module = module.to(torch.bfloat16)
    initial = {n: p.detach().clone() for n, p in module.named_parameters()}
    config = module.configure_optimizers()
    optimizer = config["optimizer"] if isinstance(config, dict) else config
    scheduler = config.get("lr_scheduler") if isinstance(config, dict) else None
    if isinstance(scheduler, dict):
        scheduler = scheduler["scheduler"]
    scaler = torch.amp.GradScaler("cpu") if precision == "16-mixed" else None
    loaders = [_epochs(_replica_loader(dataset, micro_batch, dp_size, r)) for r in range(dp_size)]
    params = [p for p in module.parameters() if p.requires_grad]
    losses: list[float] = []
    m = num_microbatches
    for _ in range(steps):
        replica_grads, replica_losses = [], []
        for r in range(dp_size):
            x, y = _cast_inputs(next(loaders[r]), precision)
            worker = module
            if compute_dtype is not None:
                worker = copy.deepcopy(module).to(compute_dtype)
            for p in worker.parameters():
                p.grad = None
            mb = []
            for xs, ys in zip(x.split(micro_batch // m), y.split(micro_batch // m)):
                with _context(precision):
                    loss = worker.loss_fn(worker.model(xs), ys)
                mb.append(float(loss.detach()))
                scaled = loss / m
                (scaler.scale(scaled) if scaler is not None else scaled).backward()
            replica_losses.append(sum(mb) / m)
            grads = [p.grad for p in worker.parameters() if p.requires_grad]
            replica_grads.append([g.to(params[i].dtype) if g is not None else torch.zeros_like(params[i])
                                  for i, g in enumerate(grads)])
        for i, p in enumerate(params):
            total = replica_grads[0][i] / dp_size
            for r in range(1, dp_size):
                total = total + replica_grads[r][i] / dp_size
            p.grad = total
        losses.append(sum(replica_losses) / dp_size)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
    return losses, {n: p.detach().clone() for n, p in module.named_parameters()}, initial
