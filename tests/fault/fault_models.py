"""A model for fault tests: the tiny reference GPT whose ``training_step`` sleeps on one rank at one step.

    python recipes/train.py model=custom model._target_=tests.fault.fault_models.SleepyGPT +model.sleep_rank=1 ...
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_par.models import GPTConfig, GPTLightningModule


class SleepyGPT(GPTLightningModule):
    """The ``tiny`` GPT; rank ``sleep_rank`` sleeps ``sleep_s`` seconds inside ``training_step`` at ``sleep_step``
    (the trainer's ``global_step``), as a rank stuck in its forward would; every rank sleeps ``step_s`` seconds in
    every ``training_step`` (a step long enough for a test to signal it in time; the losses do not change)."""

    def __init__(self, sleep_rank: int = 1, sleep_step: int = 3, sleep_s: float = 120.0, step_s: float = 0.0,
                 learning_rate: float = 3e-3, warmup_steps: int = 20) -> None:
        super().__init__(GPTConfig.from_preset("tiny"), learning_rate=learning_rate, warmup_steps=warmup_steps)
        self.sleep_rank, self.sleep_step, self.sleep_s, self.step_s = sleep_rank, sleep_step, sleep_s, step_s

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.trainer.global_rank == self.sleep_rank and self.trainer.global_step == self.sleep_step:
            time.sleep(self.sleep_s)
        time.sleep(self.step_s)
        return super().training_step(batch, batch_idx)


class EmptyTrainData(L.LightningDataModule):
    """Byte-token windows with an empty training set (every rank gets 0 batches) and a small validation set: Lightning
    skips training with a warning only."""

    def __init__(self, batch_size: int = 4, block_size: int = 32) -> None:
        super().__init__()
        self.batch_size, self.block_size = batch_size, block_size

    def _loader(self, n: int) -> DataLoader:
        data = torch.randint(0, 256, (n, self.block_size + 1), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=self.batch_size)

    def train_dataloader(self) -> DataLoader:
        return self._loader(0)

    def val_dataloader(self) -> DataLoader:
        return self._loader(8)
