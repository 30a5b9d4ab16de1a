"""A user's Fabric training loop on several gloo ranks, and the one-process reference on the same global batches.

The loop is written as a Fabric user writes it: ``fabric.launch()``, ``fabric.setup(model, optimizer)``,
``fabric.setup_dataloaders`` (Fabric's own ``DistributedSampler``, here over the dp ranks), ``fabric.backward``,
``fabric.no_backward_sync`` for accumulation, ``fabric.clip_gradients``, ``optimizer.step()``. Parity is judged on the
global batch as in :mod:`tests.support.helpers`: Fabric's sampler over a sequential loader gives dp rank ``r`` the samples
``r, r + dp, ...``, so the replicas' step ``k`` together hold the reference's global batch ``k``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from tests.support.helpers import TokenDataset, update_expert_biases

#: Buffers holding a MoE router's selection bias (DeepSeek-V3's auxiliary-loss-free balancing).
BIAS_BUFFERS = ("expert_bias", "e_score_correction_bias")


def expert_biases(module: nn.Module) -> dict[str, torch.Tensor]:
    """The MoE routers' selection biases of ``module``, by name (Fabric's wrapper prefix removed)."""
    return {n.removeprefix("_forward_module."): b.detach().clone() for n, b in module.named_buffers()
            if n.endswith(BIAS_BUFFERS)}


#: The routers' biases at the end of the last :func:`reference_loop`.
LAST_REFERENCE_BIASES: dict[str, torch.Tensor] = {}



def _refused_outside_train_step(fabric, model, x) -> list:
    """The messages of a training ``model(x)`` and a ``fabric.backward`` that the strategy refuses (cp, pp: they
    belong in ``train_step``)."""
    refused = []
    for attempt in (lambda: model(x), lambda: fabric.backward(torch.zeros((), requires_grad=True))):
        try:
            attempt()
        except RuntimeError as err:
            refused.append(str(err))
    return refused

def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adamw":
        # weight_decay=0: with AdamW's default 0.01 and accumulation over 2 micro-batches, the ONE-process reference
        # itself moves by 4.2e-4 between torch.set_num_threads(1) and (2) (3 steps, this model; 2.4e-7 without
        # accumulation): a comparison at 1e-5 there judges rounding, not the strategy.
        return torch.optim.AdamW(params, lr=3e-3, eps=1e-6, weight_decay=0.0)
    return torch.optim.SGD(params, lr=0.3, momentum=0.9)


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def fabric_loop(
    fabric: L.Fabric,
    make_model: Callable[[], nn.Module],
    optimizer: str,
    micro_batch: int,
    steps: int,
    accumulate: int = 1,
    clip_norm: float | None = None,
    dataset: Any = None,
    step: bool = False,
    token_mean: bool = False,
) -> tuple[list[float], nn.Module, Any]:
    """``steps`` optimizer steps of a user's loop; returns the per-micro-step global losses (mean over the world),
    the set-up model and optimizer. ``step``: the forward and backward through ``lightning_par.fabric.train_step``
    (the step call context parallelism needs) in place of ``model(x)`` and ``fabric.backward``. ``token_mean``: the
    loss as a per-rank sum made the global token mean by ``lightning_par.fabric.token_mean_loss``."""
    from lightning_par.fabric import token_mean_loss, train_step

    model = make_model()
    opt = make_optimizer(optimizer, model.parameters())
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(DataLoader(dataset or TokenDataset(), batch_size=micro_batch, shuffle=False))
    batches = iter(loader)
    losses = []
    for _ in range(steps):
        for i in range(accumulate):
            x, y = next(batches)
            with fabric.no_backward_sync(model, enabled=i < accumulate - 1):
                if step:
                    loss = train_step(model, (x, y), loss_fn=lm_loss, loss_scale=1.0 / accumulate)
                elif token_mean:
                    logits = model(x)
                    loss_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1),
                                               reduction="sum")
                    loss = token_mean_loss(model, loss_sum, (y != -100).sum())
                    fabric.backward(loss / accumulate)
                else:
                    loss = lm_loss(model(x), y)
                    fabric.backward(loss / accumulate)
            losses.append(float(fabric.all_reduce(loss.detach())))
        if clip_norm is not None:
            fabric.clip_gradients(model, opt, max_norm=clip_norm)
        opt.step()
        opt.zero_grad()
    return losses, model, opt


def reference_loop(
    make_model: Callable[[], nn.Module], optimizer: str, global_batch: int, steps: int, accumulate: int = 1,
    clip_norm: float | None = None, dataset: Any = None, precision: str = "32-true",
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, plain torch, the same loop on global batches; under another ``precision`` than fp32, one
    process's Fabric (``devices=1``) with that precision, the loop written the same way."""
    fabric = None
    model = plain = make_model()
    opt = make_optimizer(optimizer, model.parameters())
    if precision != "32-true":
        fabric = L.Fabric(accelerator="cpu", devices=1, precision=precision)
        model, opt = fabric.setup(model, opt)
    batches = iter(DataLoader(dataset or TokenDataset(), batch_size=global_batch, shuffle=False))
    losses = []
    for _ in range(steps):
        for _ in range(accumulate):
            x, y = next(batches)
            loss = lm_loss(model(x), y)
            if fabric is not None:
                fabric.backward(loss / accumulate)
            else:
                (loss / accumulate).backward()
            losses.append(float(loss.detach()))
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        opt.step()
        update_expert_biases(plain)  # what the strategies run after every optimizer step (a no-op without a bias)
        opt.zero_grad()
    LAST_REFERENCE_BIASES.clear()
    LAST_REFERENCE_BIASES.update(expert_biases(plain))
    return losses, {n: p.detach().float().clone() for n, p in plain.named_parameters()}


def fabric_worker(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Body of one rank: every case (``strategy``: a registry name or a ``lightning_par.fabric.MeshStrategy``
    factory, ``model``, ``optimizer``, ``micro_batch``, ``steps``, ...) in turn, on one process group."""
    world = int(os.environ["WORLD_SIZE"])
    out = []
    for case in cases:
        strategy = case["strategy"]
        fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy() if callable(strategy) else strategy,
                          precision=case.get("precision", "32-true"))
        fabric.launch()
        losses, model, opt = fabric_loop(
            fabric, case["model"], case["optimizer"], case["micro_batch"], case["steps"],
            case.get("accumulate", 1), case.get("clip_norm"), case.get("dataset"), case.get("step", False),
            case.get("token_mean", False),
        )
        if case.get("save"):
            fabric.save(case["save"], {"model": model, "optimizer": opt, "step": case["steps"]})
        refused = []
        if case.get("refusals"):  # a training forward and fabric.backward outside train_step are refused under cp
            x, y = next(iter(DataLoader(TokenDataset(), batch_size=case["micro_batch"])))
            refused = _refused_outside_train_step(fabric, model, x)
            with torch.no_grad():  # evaluation runs on whole sequences: one process's logits
                refused.append(model(x[:1]))
        summary = fabric.strategy.parallel.summary()
        out.append({"losses": losses, "state": fabric.strategy.parallel.full_state_dict(), "refused": refused,
                    "cp_tokens": summary.get("cp_tokens_per_sequence"), "expert_bias": expert_biases(model)})
    return out


def save_load_worker(path: str, make_model: Callable[[], nn.Module], make_other: Callable[[], nn.Module]) -> dict:
    """Train 2 steps under zero3 dp2 and ``fabric.save``; then a fresh model (other initial values) under tp2
    ``fabric.load``s it and trains step 3 (its batch: the reference's global batch 2). Returns the states."""
    world = int(os.environ["WORLD_SIZE"])
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy="zero3")
    fabric.launch()
    _, model, opt = fabric_loop(fabric, make_model, "sgd", 4, 2)
    fabric.save(path, {"model": model, "optimizer": opt, "step": 2, "note": "zero3"})
    saved = fabric.strategy.parallel.full_state_dict()

    fabric = L.Fabric(accelerator="cpu", devices=world, strategy="tensor_parallel")
    fabric.launch()
    model = make_other()
    opt = make_optimizer("sgd", model.parameters())
    model, opt = fabric.setup(model, opt)
    state = {"model": model, "optimizer": opt, "step": 0}
    remainder = fabric.load(path, state)
    loaded = fabric.strategy.parallel.full_state_dict()
    batches = iter(fabric.setup_dataloaders(DataLoader(TokenDataset(), batch_size=8, shuffle=False)))
    for _ in range(state["step"]):
        next(batches)
    x, y = next(batches)
    fabric.backward(lm_loss(model(x), y))
    opt.step()
    opt.zero_grad()
    return {"saved": saved, "loaded": loaded, "step": state["step"], "remainder": remainder,
            "after": fabric.strategy.parallel.full_state_dict()}


class PipelinedLM(nn.Module):
    """A user's model for pipelining in a Fabric loop: the network at ``.model`` (it speaks the contract's
    ``pipeline_layers`` / ``pipeline_stage``) and the micro-batch loss as ``loss_fn``; ``forward`` for the one-process
    reference."""

    def __init__(self, network: nn.Module) -> None:
        super().__init__()
        self.model = network

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    @staticmethod
    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, y)


def fabric_pipelined_loop(
    fabric: L.Fabric, make_model: Callable[[], nn.Module], optimizer: str, micro_batch: int, steps: int,
    accumulate: int = 1, clip_norm: float | None = None, dataset: Any = None,
) -> tuple[list[float], nn.Module, Any]:
    """:func:`fabric_loop` as a user writes it under pipelining: ``loss = train_step(model, batch)`` in place of the
    forward and ``fabric.backward``."""
    from lightning_par.fabric import train_step

    model = make_model()
    opt = make_optimizer(optimizer, model.parameters())
    model, opt = fabric.setup(model, opt)
    loader = fabric.setup_dataloaders(DataLoader(dataset or TokenDataset(), batch_size=micro_batch, shuffle=False))
    batches = iter(loader)
    losses = []
    for _ in range(steps):
        for i in range(accumulate):
            with fabric.no_backward_sync(model, enabled=i < accumulate - 1):
                loss = train_step(model, next(batches), loss_scale=1.0 / accumulate)
            losses.append(float(fabric.all_reduce(loss)))
        if clip_norm is not None:
            fabric.clip_gradients(model, opt, max_norm=clip_norm)
        opt.step()
        opt.zero_grad()
    return losses, model, opt


def fabric_pipelined_worker(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`fabric_worker` for the pipelined loop; each case also checks that ``model(x)`` and ``fabric.backward``
    are refused, naming ``train_step``, and ``train_step(..., loss_fn=...)``."""
    from lightning_par.fabric import train_step

    world = int(os.environ["WORLD_SIZE"])
    out = []
    for case in cases:
        fabric = L.Fabric(accelerator="cpu", devices=world, strategy=case["strategy"]())
        fabric.launch()
        losses, model, opt = fabric_pipelined_loop(
            fabric, case["model"], case["optimizer"], case["micro_batch"], case["steps"], case.get("accumulate", 1),
            case.get("clip_norm"), case.get("dataset"),
        )
        if case.get("save"):
            fabric.save(case["save"], {"model": model, "optimizer": opt, "step": case["steps"]})
        x, y = next(iter(DataLoader(TokenDataset(), batch_size=case["micro_batch"])))
        refused = _refused_outside_train_step(fabric, model, x)
        loss_fn_refused = ""
        try:  # the schedule's loss is the module's
            train_step(model, next(iter(DataLoader(TokenDataset(), batch_size=case["micro_batch"]))), loss_fn=lm_loss)
        except ValueError as err:
            loss_fn_refused = str(err)
        out.append({"losses": losses, "state": fabric.strategy.parallel.full_state_dict(), "refused": refused,
                    "loss_fn_refused": loss_fn_refused})
    return out
