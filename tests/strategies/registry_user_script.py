"""What a user writes: `Trainer(strategy="<registry name>", devices=2)`, launched by Lightning itself."""

import sys
import lightning as L
import torch
import lightning_par  # noqa: F401
from lightning_par.models import GPTConfig, GPTLightningModule
from lightning_par.data import ByteCorpusDataModule

if __name__ == "__main__":
    strategy = sys.argv[1]
    torch.manual_seed(0)
    module = GPTLightningModule(GPTConfig.from_preset("tiny"))
    dm = ByteCorpusDataModule(synthetic=True, block_size=32, batch_size=8, val_batches=2)
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=5, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, val_check_interval=5)
    trainer.fit(module, dm)
    if trainer.global_rank == 0:
        print("DONE", strategy, float(trainer.callback_metrics["val_loss"]))
