"""A user script whose rank 1 raises in its third training step, launched by Lightning itself."""

import sys
import lightning as L
import lightning_par  # noqa: F401
from lightning_par.models import GPTConfig, GPTLightningModule
from lightning_par.data import ByteCorpusDataModule

class Crashy(GPTLightningModule):
    def training_step(self, batch, batch_idx):
        if batch_idx == 2 and self.global_rank == 1:
            raise RuntimeError("rank 1 fails on purpose")
        return super().training_step(batch, batch_idx)

if __name__ == "__main__":
    module = Crashy(GPTConfig.from_preset("tiny"))
    dm = ByteCorpusDataModule(synthetic=True, block_size=32, batch_size=8, val_batches=2)
    trainer = L.Trainer(strategy=sys.argv[1], accelerator="cpu", devices=2, max_steps=5, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, val_check_interval=5)
    trainer.fit(module, dm)
