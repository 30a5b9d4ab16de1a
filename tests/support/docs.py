"""Packed documents against each document alone: the data, the models, the distributed runs and the reference.

The data (:func:`packed_blocks`): documents whose lengths partition every block exactly (no padding, so every dp, cp
rank and micro-batch counts as many tokens; label masks are tested elsewhere), packed by
:class:`lightning_par.data.packing.PackedBlocks` (first fit keeps such documents in order, one block after another).

The reference (:func:`reference_run`): one process runs **each document alone** (a batch of one sequence, positions
``0..len-1``, plain causal attention), sums its token losses, divides by the global batch's counted tokens, and steps
the module's own optimizer with those gradients. A distributed run of the packed blocks must give the same losses and
parameters.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from lightning_par.data.packing import PackedBlocks
from lightning_par.models import GPTConfig, GPTLightningModule
from tests.support.helpers import LossRecorder, quiet_trainer
from tests.support.user_models import AttentionLM

BLOCK, VOCAB, MICRO = 16, 256, 2
CONFIG = GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=BLOCK, vocab_size=VOCAB, dropout=0.0)


class SGDGPT(GPTLightningModule):
    """The reference GPT stepped by plain SGD: a parameter's change is its gradient times the learning rate, so
    parameter parity is gradient parity (AdamW would turn the rounding noise of a zero gradient, the keys' bias, into
    a full step)."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class PackedUserLM(AttentionLM):
    """A user's causal LM (:class:`tests.support.user_models.AttentionLM`: its own tensor-parallel plan and pipeline stages)
    reading packed blocks through the contract: its step takes ``input_ids``, ``position_ids`` and ``labels`` from
    the batch and knows nothing of ``document_ids``; the strategy masks its attention per document."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(x, position_ids)

    def pipeline_batch(self, batch: Any) -> tuple[Any, torch.Tensor]:
        return (batch["input_ids"], batch["position_ids"]), batch["labels"]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss_fn(self.model(batch["input_ids"], batch["position_ids"]), batch["labels"])


def make_model(name: str) -> Any:
    """``"gpt"``: :class:`SGDGPT` (4 heads); ``"llama"``: a tiny Hugging Face llama (4 query heads over 2 key/value
    heads, SGD with momentum); ``"user"``: :class:`PackedUserLM` (SGD with momentum). Seeded: every rank and the
    reference build the same weights."""
    torch.manual_seed(0)
    if name == "gpt":
        return SGDGPT(CONFIG)
    if name == "user":
        return PackedUserLM("sgd")
    from tests.support.hf_matrix import make_model as make_hf

    return make_hf(name, "sgd")


def padded_blocks(n_blocks: int, seed: int = 0) -> PackedBlocks:
    """``n_blocks`` blocks of :data:`BLOCK` tokens packed first-fit from documents of 3 to 12 tokens, padding at the
    end of most (labels -100 there): blocks, micro-batches and cp pieces count different numbers of tokens."""
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    while True:
        lengths.append(int(rng.integers(3, 13)))
        blocks = PackedBlocks(np.zeros(sum(lengths), dtype=np.int64), np.concatenate([[0], np.cumsum(lengths)]),
                              BLOCK, buffer_blocks=1)
        if len(blocks) > n_blocks:
            lengths.pop()
            break
    tokens = rng.integers(0, VOCAB, size=sum(lengths))
    blocks = PackedBlocks(tokens, np.concatenate([[0], np.cumsum(lengths)]), BLOCK, buffer_blocks=1)
    assert len(blocks) == n_blocks and blocks.stats.padding_fraction > 0, blocks.stats
    return blocks


def packed_blocks(n_blocks: int, seed: int = 0) -> PackedBlocks:
    """``n_blocks`` blocks of :data:`BLOCK` tokens, each exactly filled by 1 to 5 documents of random lengths."""
    rng = np.random.default_rng(seed)
    lengths: list[int] = []
    for _ in range(n_blocks):
        cuts = sorted(rng.choice(np.arange(1, BLOCK), size=int(rng.integers(0, 5)), replace=False).tolist())
        pairs = np.diff([0, *cuts, BLOCK]).tolist()
        lengths += [p + 1 for p in pairs]
    tokens = rng.integers(0, VOCAB, size=sum(lengths))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    blocks = PackedBlocks(tokens, offsets, BLOCK)
    assert len(blocks) == n_blocks and blocks.stats.padding_fraction == 0.0, blocks.stats
    return blocks


def _strategy(options: dict[str, Any]) -> Any:
    from lightning.pytorch.strategies import StrategyRegistry

    entry = StrategyRegistry["parallel_3d"]
    return entry["strategy"](**{**entry["init_params"], "timeout_s": 90, **options})


def run_case(case: dict[str, Any], blocks: PackedBlocks) -> dict[str, Any]:
    """One case on this rank: fit ``case["model"]`` on ``blocks`` under ``parallel_3d`` with ``case["options"]`` for
    ``case["steps"]`` steps; the losses and the full parameters."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    strategy = _strategy(case["options"])
    dims = strategy.resolve_parallel_dims(world)
    dp_rank = dims.coordinates(rank)["dp"]
    sampler = DistributedSampler(blocks, num_replicas=dims.dp_size, rank=dp_rank, shuffle=False)
    loader = DataLoader(blocks, batch_size=case.get("micro_batch", MICRO), sampler=sampler, drop_last=True)
    recorder = LossRecorder()
    trainer = quiet_trainer(strategy, world, max_steps=case["steps"], limit_val_batches=0, callbacks=[recorder])
    module = make_model(case["model"])
    trainer.fit(module, loader)
    return {"name": case["name"], "rank": rank, "dp_rank": dp_rank, "losses": recorder.losses,
            "state": strategy.full_state_dict()}


def plan_worker(cases: list[dict[str, Any]], blocks: PackedBlocks) -> list[dict[str, Any]]:
    env = dict(os.environ)
    torch.set_num_threads(1)
    out = []
    for case in cases:
        os.environ.clear()
        os.environ.update(env)  # Lightning's teardown removes WORLD_SIZE and friends after each fit
        out.append(run_case(case, blocks))
    return out


def run_cases(world: int, cases: list[dict[str, Any]], blocks: PackedBlocks, timeout_s: float = 900) -> dict:
    """``{case name: [rank 0's result, rank 1's, ...]}``, every case in one launch of ``world`` ranks."""
    from lightning_par.launcher import run_distributed

    per_rank = run_distributed(plan_worker, world, (cases, blocks), timeout_s=timeout_s)
    return {c["name"]: [per_rank[r][i] for r in range(world)] for i, c in enumerate(cases)}


def documents_alone_loss(module: Any, blocks: PackedBlocks, indices: list[int]) -> torch.Tensor:
    """The token-mean loss of the blocks ``indices`` computed document by document: each document run alone (one
    sequence, positions ``0..len-1``), its token losses summed, the sum divided by every counted token."""
    total, loss = 0, torch.zeros(())
    for i in indices:
        for doc, start, stop in blocks.documents_of(i):
            base = int(blocks.offsets[doc])
            window = torch.as_tensor(np.asarray(blocks.tokens[base + start: base + stop]), dtype=torch.long)
            x, y = window[:-1].unsqueeze(0), window[1:].unsqueeze(0)
            logits = module(x, position_ids=torch.arange(x.shape[1]).unsqueeze(0))
            loss = loss + F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1), reduction="sum")
            total += y.numel()
    return loss / total


def reference_run(model: str, blocks: PackedBlocks, global_batch: int, steps: int) -> tuple[list[float], dict]:
    """One process, each document alone: the losses of ``steps`` steps over consecutive global batches of
    ``global_batch`` blocks, and the final parameters."""
    torch.manual_seed(0)
    module = make_model(model)
    config = module.configure_optimizers()
    optimizer = config["optimizer"] if isinstance(config, dict) else config
    losses = []
    for step in range(steps):
        loss = documents_alone_loss(module, blocks, list(range(step * global_batch, (step + 1) * global_batch)))
        losses.append(float(loss.detach()))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, {n: p.detach().clone() for n, p in module.named_parameters()}


def update_rel_error(actual: dict, expected: dict, initial: dict) -> float:
    """``|Δ_actual - Δ_expected| / |Δ_expected|`` over all parameters together, ``Δ = final - initial``: the relative
    error of the summed updates (with SGD, of the gradients)."""
    num = sum(float(((actual[n].float() - initial[n]) - (expected[n] - initial[n])).pow(2).sum()) for n in expected)
    den = sum(float((expected[n] - initial[n]).pow(2).sum()) for n in expected)
    return (num / den) ** 0.5
