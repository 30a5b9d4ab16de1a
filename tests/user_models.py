"""Users' models that are not the reference GPT, written as a user would: a LightningModule holding an ``nn.Sequential``
network at ``.model``, with its own tensor-parallel plan (``tp_plan()``, paths relative to the network) and its own
loss; nothing from ``lightning_par.models``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-norm residual MLP: ``x + fc2(gelu(fc1(norm(x))))`` on ``(batch, width)``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class ResidualMLP(L.LightningModule):
    """Regression ``(batch, d_in) -> (batch, d_out)``: input projection, ``depth`` residual blocks, head.

    Args:
        optimizer: ``"sgd"`` (SGD with momentum 0.9: a gradient summed instead of averaged moves it twice as far) or
            ``"adamw"``.
    """

    def __init__(self, d_in: int = 8, width: int = 16, depth: int = 3, d_out: int = 4, optimizer: str = "sgd",
                 lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        layers: list[tuple[str, nn.Module]] = [("0", nn.Linear(d_in, width))]
        layers += [(str(i + 1), Block(width)) for i in range(depth)]
        layers.append((str(depth + 1), nn.Linear(width, d_out)))
        self.model = nn.Sequential(OrderedDict(layers))

    def tp_plan(self) -> dict[str, str]:
        """Megatron's MLP split in every block; the projections and norms replicated."""
        depth = self.hparams.depth
        plan = {"0": "replicate", str(depth + 1): "replicate"}
        for i in range(1, depth + 1):
            plan |= {f"{i}.norm": "replicate", f"{i}.fc1": "colwise", f"{i}.fc2": "rowwise"}
        return plan

    @staticmethod
    def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(outputs, targets)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss_fn(self.model(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss_fn(self.model(x), y)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.hparams.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr / 10, eps=1e-5)


def make_mlp(optimizer: str = "sgd", depth: int = 3) -> ResidualMLP:
    """Seeded: every rank and the reference build the same initial model."""
    torch.manual_seed(0)
    return ResidualMLP(optimizer=optimizer, depth=depth)
