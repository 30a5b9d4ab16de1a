"""What only a GPU can check: the strategies with a CUDA device and an nccl process group of one rank, and float8 with
CUDA's float8 matrix products, each against one process of plain torch on the same device."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from tests.support.float8 import dataset, make_gpt, reference_float8
from tests.support.helpers import LossRecorder

pytestmark = pytest.mark.gpu

STEPS = 4


class Backend(L.Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        self.backend = dist.get_backend() if dist.is_initialized() else None
        self.device = next(pl_module.parameters()).device.type


def _fit(strategy, **trainer_kwargs) -> tuple[list[float], Backend]:
    module, recorder, backend = make_gpt(), LossRecorder(), Backend()
    loader = DataLoader(dataset(), batch_size=8, shuffle=False, drop_last=True)
    trainer = L.Trainer(accelerator="cuda", devices=1, strategy=strategy, max_steps=STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, num_sanity_val_steps=0, limit_val_batches=0,
                        callbacks=[recorder, backend], **trainer_kwargs)
    trainer.fit(module, loader)
    return recorder.losses, backend


def _rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) == STEPS
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", ["ddp_overlap", "zero3"])
def test_nccl_at_world_1_matches_one_process(name):
    from lightning_par.strategies import DDPOverlapStrategy, ZeroStrategy

    strategy = DDPOverlapStrategy() if name == "ddp_overlap" else ZeroStrategy(stage=3)
    losses, seen = _fit(strategy)
    assert seen.backend == "nccl" and seen.device == "cuda"
    expected = reference_float8(STEPS, 8, float8=False, device="cuda")
    assert _rel(losses, expected) < 1e-5, (losses, expected)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_float8_on_cuda_matches_plain_torchao(precision):
    from lightning_par.strategies import ZeroStrategy

    losses, _ = _fit(ZeroStrategy(stage=3, float8={"enabled": True}), precision=precision)
    expected = reference_float8(STEPS, 8, precision=precision, device="cuda")
    assert _rel(losses, expected) < 1e-3, (losses, expected)
