"""LitGPT's ``GPT`` (random weights from its own configs, no download) in a Fabric loop written the way LitGPT's
``litgpt/pretrain.py`` writes it: ``fabric.init_module``, ``fabric.setup(model)`` then the optimizer over the set-up
model's parameters and ``fabric.setup_optimizers``, ``fabric.no_backward_sync`` while accumulating, LitGPT's
``chunked_cross_entropy``, ``fabric.backward(loss / accumulation_iters)``, ``fabric.clip_gradients``."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from tests.support.helpers import TokenDataset

VOCAB = 256
SEQ = 16

#: LitGPT config names, shrunk (2 layers, small widths, a 256-token vocabulary): the architecture of each family.
CONFIGS: dict[str, dict[str, Any]] = {
    "pythia": dict(name="pythia-14m", n_layer=2, n_embd=32, n_head=4, padded_vocab_size=VOCAB, vocab_size=VOCAB,
                   block_size=SEQ),
    "llama": dict(name="tiny-llama-1.1b", n_layer=2, n_embd=32, n_head=4, n_query_groups=2, intermediate_size=64,
                  padded_vocab_size=VOCAB, vocab_size=VOCAB, block_size=SEQ),
}


def make_gpt(family: str) -> torch.nn.Module:
    from litgpt.model import GPT, Config

    kwargs = dict(CONFIGS[family])
    config = Config.from_name(kwargs.pop("name"), **kwargs)
    torch.manual_seed(0)
    return GPT(config)


def pretrain_loop(fabric: L.Fabric | None, family: str, micro_batch: int, steps: int, accumulation_iters: int,
                  optimizer: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """LitGPT's pretraining loop on ``fabric``; ``fabric=None``: the same loop in one process, plain torch."""
    from litgpt.utils import chunked_cross_entropy

    if fabric is not None:
        with fabric.init_module(empty_init=False):
            model = make_gpt(family)
        model = fabric.setup(model)
    else:
        model = make_gpt(family)
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, eps=1e-6, weight_decay=0.0, betas=(0.9, 0.95))
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    loader = DataLoader(TokenDataset(n=128, seq=SEQ, vocab=VOCAB), batch_size=micro_batch, shuffle=False)
    if fabric is not None:
        opt = fabric.setup_optimizers(opt)
        loader = fabric.setup_dataloaders(loader)
    batches = iter(loader)
    losses = []
    for _ in range(steps):
        for i in range(accumulation_iters):
            input_ids, targets = next(batches)
            is_accumulating = i < accumulation_iters - 1
            ctx = fabric.no_backward_sync(model, enabled=is_accumulating) if fabric is not None else _null()
            with ctx:
                logits = model(input_ids)
                loss = chunked_cross_entropy(logits, targets)
                if fabric is not None:
                    fabric.backward(loss / accumulation_iters)
                else:
                    (loss / accumulation_iters).backward()
            losses.append(float(fabric.all_reduce(loss.detach())) if fabric is not None else float(loss.detach()))
        if fabric is not None:
            fabric.clip_gradients(model, opt, max_norm=1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    state = (fabric.strategy.parallel.full_state_dict() if fabric is not None
             else {n: p.detach().clone() for n, p in model.named_parameters()})
    return losses, state


def _null() -> Any:
    from contextlib import nullcontext

    return nullcontext()


def litgpt_worker(cases: list[tuple[str, Any, str]], micro_batch: int, steps: int, accumulation_iters: int) -> list:
    world = int(os.environ["WORLD_SIZE"])
    out = []
    for family, strategy, optimizer in cases:
        if strategy == "tp2":
            strategy = tp2(family)
        fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
        fabric.launch()
        out.append(pretrain_loop(fabric, family, micro_batch, steps, accumulation_iters, optimizer))
    return out


def litgpt_tp_plan(family: str, n_layer: int = 2) -> dict[str, str]:
    """A tensor-parallel plan for LitGPT's ``GPT``: each block's MLP split Megatron-style (up projections colwise,
    ``proj`` rowwise), everything else replicated. The attention stays whole: LitGPT 0.5's fused ``attn.qkv`` holds
    ``[all q | all k | all v]`` and its forward splits it with the config's head counts, so a colwise shard of it
    would hand each rank half the queries and none of the values."""
    ups = ("fc_1", "fc_2") if family == "llama" else ("fc",)
    plan: dict[str, str] = {}
    for i in range(n_layer):
        block = f"transformer.h.{i}"
        plan |= {f"{block}.mlp.{u}": "colwise" for u in ups}
        plan |= {f"{block}.mlp.proj": "rowwise", f"{block}.attn": "replicate", f"{block}.norm_1": "replicate"}
        plan |= {f"{block}.norm_2": "replicate"}
    plan |= {"transformer.wte": "replicate", "transformer.ln_f": "replicate", "lm_head": "replicate"}
    return plan


def tp2(family: str) -> Any:
    from lightning_par.fabric import MeshStrategy

    return MeshStrategy(tp_size=2, plan=litgpt_tp_plan(family))
