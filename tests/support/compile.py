"""Helpers of the per-block ``torch.compile`` tests (``strategy.compile``): each *cell* fits the same seeded model twice
under one layout, eager then compiled, as a user runs it (``Trainer(accelerator="cpu", devices=N, strategy=...)``,
Lightning's injected shuffling sampler), so each rank sees the same batches in both runs and their losses must agree.

A cell is a picklable dict: ``"name"``, ``"strategy"`` (a registry name) and ``"options"`` (its keywords), ``"model"``
(``"attn"``: a user's causal LM, ``tests.support.user_models.AttentionLM``; ``"sp"``: a user's LM whose plan covers
sequence parallelism; ``"moe"``: a user's mixture-of-experts LM;
``"gpt"``: the reference GPT, 2 blocks; ``"gpt_moe"``: the GPT with experts), ``"optimizer"`` (``"sgd"``: SGD with
momentum, ``"adamw"``), ``"backend"`` (default ``"aot_eager"``), ``"steps"`` (default 8).
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_par.compile import is_block_compiled
from lightning_par.parallelize import parallel_model_of
from tests.support.helpers import LossRecorder, TokenDataset

#: Samples per micro-batch and tokens per sample.
MICRO, SEQ = 4, 16
#: Relative tolerance of a compiled run's losses against the eager run's (the issue's criterion).
RTOL = 1e-4


class SPBlock(torch.nn.Module):
    """A user's pre-norm block: ``x + attn(ln1(x))``, then ``h + mlp(ln2(h))``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        from tests.support.user_models import Attention

        self.ln1, self.ln2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(),
                                       torch.nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class SPNet(torch.nn.Module):
    """A user's causal LM network whose tensor-parallel plan covers sequence parallelism (every norm on the residual
    stream named), blocks named through ``checkpoint_modules``."""

    def __init__(self, vocab: int = 256, width: int = 32, heads: int = 4, depth: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.layers = torch.nn.ModuleList(SPBlock(width, heads) for _ in range(depth))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab)

    def checkpoint_modules(self, mode: str) -> list[str]:
        return [f"layers.{i}" + (".attn" if mode == "selective" else "") for i in range(len(self.layers))]

    def tp_plan(self) -> dict[str, str]:
        plan = {"embed": "vocab_embedding", "norm": "sequence_parallel", "head": "vocab_head"}
        for i in range(len(self.layers)):
            plan |= {f"layers.{i}.ln1": "sequence_parallel", f"layers.{i}.ln2": "sequence_parallel",
                     f"layers.{i}.attn": "colwise_input", f"layers.{i}.mlp": "colwise_input",
                     f"layers.{i}.attn.o": "rowwise", f"layers.{i}.mlp.0": "colwise", f"layers.{i}.mlp.2": "rowwise"}
            plan |= {f"layers.{i}.attn.{p}": "colwise" for p in ("q", "k", "v")}
        return plan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)  # (batch, seq, width), (batch, seq / tp, width) under sequence parallelism
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


class SPLM(L.LightningModule):
    """The user's LightningModule around :class:`SPNet`: batches ``(x, y)``, SGD with momentum or AdamW."""

    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.optimizer = optimizer
        self.model = SPNet()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def make_model(kind: str, optimizer: str) -> L.LightningModule:
    """The cell's model, seeded (every rank and both runs build the same one)."""
    torch.manual_seed(0)
    if kind == "attn":
        from tests.support.user_models import AttentionLM

        return AttentionLM(optimizer)
    if kind == "sp":
        return SPLM(optimizer)
    if kind == "moe":
        from tests.support.user_models import make_moe_lm

        return make_moe_lm(optimizer)
    from lightning_par.models import GPTConfig, GPTLightningModule

    extra = {"num_experts": 4, "moe_every": 2} if kind == "gpt_moe" else {}
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=SEQ, vocab_size=256, dropout=0.0, **extra)
    module = GPTLightningModule(config, learning_rate=3e-3, adam_eps=1e-6)
    if optimizer == "sgd":
        sgd = lambda: torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)  # noqa: E731
        module.configure_optimizers = sgd  # type: ignore[method-assign]
    return module


def _trainer(cell: dict[str, Any], world: int, compiled: bool, recorder: LossRecorder) -> L.Trainer:
    from lightning.pytorch.strategies import StrategyRegistry

    entry = StrategyRegistry[cell["strategy"]]
    options = {**entry["init_params"], "timeout_s": 120, **cell.get("options", {})}
    if compiled:
        options["compile"] = {"enabled": True, "backend": cell.get("backend", "aot_eager"),
                              **cell.get("compile", {})}
    return L.Trainer(
        accelerator="cpu", devices=world, strategy=entry["strategy"](**options), logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        max_steps=cell.get("steps", 8), limit_val_batches=0, callbacks=[recorder],
        precision=cell.get("precision", "32-true"),
    )


def run_cell(cell: dict[str, Any], world: int) -> dict[str, Any]:
    """Body of one rank: the eager fit, then the compiled fit, on fresh seeded models; losses and the summary."""
    train = TokenDataset(n=cell.get("steps", 8) * MICRO * world, seq=SEQ)
    out: dict[str, Any] = {}
    for compiled in (False, True):
        # dynamo caches per code object across Trainers: each cell's compiled run starts from an empty cache, as a
        # fresh process would (a block class compiled under many layouts in one process would reach dynamo's
        # recompile limit and fall back to eager)
        torch._dynamo.reset()
        recorder = LossRecorder()
        trainer = _trainer(cell, world, compiled, recorder)
        module = make_model(cell["model"], cell["optimizer"])
        trainer.fit(module, DataLoader(train, batch_size=MICRO, drop_last=True))
        key = "compiled" if compiled else "eager"
        out[key] = recorder.losses
        out[f"{key}_summary"] = trainer.strategy.summary_extras()
        owner = parallel_model_of(module)
        assert owner is not None
        owner.unparallelize()  # what a second Trainer on the same module does first
        out[f"{key}_plain_after"] = not any(is_block_compiled(m) for m in module.modules())
    return out


def worker(cells: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every cell on this rank, one after the other (one launch for all)."""
    world = int(os.environ["WORLD_SIZE"])  # Lightning deletes it at the end of a fit: read it once
    return {cell["name"]: run_cell(cell, world) for cell in cells}


def check_cells(cells: list[dict[str, Any]], runs: list[dict[str, dict[str, Any]]]) -> None:
    """Every rank's compiled losses at its eager losses (rel :data:`RTOL`), all ``steps`` of them, and finite; the
    summary names the compiled blocks and no recompilation after the second step."""
    for cell in cells:
        for rank, run in enumerate(runs):
            got = run[cell["name"]]
            steps = cell.get("steps", 8)
            assert len(got["eager"]) == steps and len(got["compiled"]) == steps, (cell["name"], rank, got)
            eager, compiled = torch.tensor(got["eager"]), torch.tensor(got["compiled"])
            assert torch.isfinite(eager).all(), (cell["name"], rank, got)
            torch.testing.assert_close(compiled, eager, rtol=RTOL, atol=0,
                                       msg=lambda m: f"{cell['name']} rank {rank}: {m}")
            summary = got["compiled_summary"]
            assert summary["compiled_blocks"] >= 1, (cell["name"], rank, summary)
            assert summary["compile_graphs"] >= 1, (cell["name"], rank, summary)
            assert summary["compile_recompiles_after_step_2"] == 0, (cell["name"], rank, summary)
            if not {"cp_size", "ep_size"} & set(cell.get("options", {})):  # no frame left to eager
                assert summary["compile_frames_not_compiled"] == 0, (cell["name"], rank, summary)
            assert "compiled_blocks" not in got["eager_summary"], (cell["name"], rank)
            assert got["compiled_plain_after"] and got["eager_plain_after"], (cell["name"], rank)
