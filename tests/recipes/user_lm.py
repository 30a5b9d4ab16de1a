"""A user's own language model, not the reference GPT: embedding -> residual MLP -> vocabulary head.

Used by the tests as a user would: copied into a temporary directory put on PYTHONPATH and named on the command line
(``model=custom model._target_=user_lm.UserLM +model.hidden=48``). It brings its tensor-parallel plan through the
model contract: ``tp_plan()`` on the network at ``.model``, paths relative to it.
"""
import lightning as L
import torch
import torch.nn.functional as F
from torch import nn


class MLPNet(nn.Module):
    def __init__(self, vocab_size: int = 256, hidden: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden)
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        x = x + self.down(F.gelu(self.up(x)))
        return self.head(x)

    def tp_plan(self) -> dict[str, str]:
        """Megatron MLP split, paths relative to this network (the model contract)."""
        return {"up": "colwise", "down": "rowwise"}


class UserLM(L.LightningModule):
    def __init__(self, hidden: int = 32, block_size: int = 16, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.block_size = block_size
        self.model = MLPNet(hidden=hidden)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
