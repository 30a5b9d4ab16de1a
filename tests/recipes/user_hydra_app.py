"""A user's own Hydra app that trains with ``Trainer(strategy=...)``; the tests run it with
``-m hydra/launcher=lightning_par``. Every rank appends a line to ``ranks.txt`` in its job directory (so a test can
count how often the task ran), rank ``fail_rank`` raises, and rank 0 writes ``result.json``."""

import json
import os

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from torch.utils.data import DataLoader, TensorDataset

import lightning_par  # noqa: F401  (registers the strategies)


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg):
    out = HydraConfig.get().runtime.output_dir
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(out, "ranks.txt"), "a") as f:
        f.write(f"{rank} {os.environ.get('WORLD_SIZE')} {os.getpid()}\n")
    if rank == cfg.fail_rank:
        raise RuntimeError(f"rank {rank} fails on purpose")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    trainer = L.Trainer(strategy=cfg.strategy, accelerator="cpu", devices=cfg.devices, max_steps=cfg.steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Regression(), data)
    if trainer.global_rank == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"world_size": trainer.world_size, "loss": float(trainer.callback_metrics["train_loss"])}, f)
    return trainer.world_size


if __name__ == "__main__":
    main()
