"""ZeRO options and models are refused with a clear ValueError before any process group starts."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

from lightning_par.data_parallel.fsdp import find_shard_units
from lightning_par.data_parallel.zero_memory import paper_comm_bytes, paper_state_bytes
from lightning_par.data_parallel.zero_options import parse_mixed_precision, resolve_zero_options
from lightning_par.models import GPT, GPTConfig
from lightning_par.parallel_dims import ParallelDims
from lightning_par.strategies.zero import ZeroStrategy


@pytest.fixture
def restore_environ():
    """Lightning's launcher writes MASTER_ADDR, WORLD_SIZE, ... into this process: put the environment back."""
    import os

    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize("stage", [0, 4, "3", True, None, 2.5])
def test_unknown_stage(stage):
    with pytest.raises(ValueError, match=r"stage=.* is not valid: expected one of \[1, 2, 3\]"):
        resolve_zero_options(stage)
    with pytest.raises(ValueError, match=r"stage=.* is not valid"):
        ZeroStrategy(stage=stage)


@pytest.mark.parametrize("stage", [1, 2])
def test_cpu_offload_below_stage_3(stage):
    with pytest.raises(ValueError, match=rf"cpu_offload=True is not valid with stage={stage}: .* Use stage=3"):
        ZeroStrategy(stage=stage, cpu_offload=True)


def test_cpu_offload_on_cpu_is_refused_before_the_process_group_starts(restore_environ):
    module = _Linear()
    strategy = ZeroStrategy(stage=3, cpu_offload=True)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match="cpu_offload=True is not valid on a CPU device"):
        trainer.fit(module, [torch.zeros(2, 4)])
    assert not dist.is_initialized()


class _Linear(L.LightningModule):
    def __init__(self, trainable: bool = True) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)
        self.layer.requires_grad_(trainable)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer(batch).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Empty(L.LightningModule):
    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return batch.sum()


@pytest.mark.parametrize("module", [_Empty(), _Linear(trainable=False)], ids=["no-parameters", "all-frozen"])
def test_model_with_nothing_to_shard(module):
    strategy = ZeroStrategy(stage=2)
    strategy.parallel_devices = [torch.device("cpu")]
    strategy.connect(module)
    with pytest.raises(ValueError, match="has no parameter that requires a gradient: dp_mode='zero2' has nothing to shard"):
        strategy.validate_model(ParallelDims(dp_size=2, world_size=2))


def test_model_with_nothing_to_shard_fails_before_the_process_group_starts(restore_environ):
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=1), max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match="nothing to shard"):
        trainer.fit(_Linear(trainable=False), [torch.zeros(2, 4)])
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, (None, None)),
        ("bf16", (torch.bfloat16, torch.bfloat16)),
        ("fp16", (torch.float16, torch.float16)),
        ({"param_dtype": "bf16", "reduce_dtype": "fp32"}, (torch.bfloat16, torch.float32)),
        ({"reduce_dtype": "bf16"}, (None, torch.bfloat16)),
    ],
)
def test_mixed_precision_values(value, expected):
    assert parse_mixed_precision(value) == expected


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("int8", r"mixed_precision='int8' is not valid: expected None or one of"),
        ({"param": "bf16"}, r"mixed_precision keys \['param'\] are not valid"),
        ({"param_dtype": "fp8"}, r"mixed_precision.param_dtype='fp8' is not valid"),
        (16, r"mixed_precision=16 is not valid"),
    ],
)
def test_bad_mixed_precision(value, match):
    with pytest.raises(ValueError, match=match):
        ZeroStrategy(stage=3, mixed_precision=value)


def test_stage1_reduces_in_the_parameter_dtype():
    with pytest.raises(ValueError, match=r"reduce_dtype=torch.float32 is not valid with stage=1"):
        resolve_zero_options(1, mixed_precision={"param_dtype": "bf16", "reduce_dtype": "fp32"})
    options = resolve_zero_options(2, mixed_precision={"param_dtype": "bf16", "reduce_dtype": "fp32"})
    assert options.reduce_dtype == torch.float32


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stage": 3, "bucket_cap_mb": 10}, r"bucket_cap_mb=10 is not valid with dp_mode='zero3'"),
        ({"stage": 1, "bucket_cap_mb": 0}, r"bucket_cap_mb=0 is not valid: expected a number > 0"),
        ({"stage": 2, "bucket_cap_mb": "big"}, r"bucket_cap_mb='big' is not valid"),
        ({"stage": 2, "comm_hook": "fp16"}, r"comm_hook='fp16' is not valid with stage=2"),
        ({"stage": 1, "comm_hook": "zip"}, r"comm_hook='zip' is not valid: expected one of"),
        ({"stage": 3, "reshard_after_forward": "yes"}, r"reshard_after_forward='yes' is not valid: expected True"),
        ({"stage": 3, "cpu_offload": 1}, r"cpu_offload=1 is not valid: expected True or False"),
    ],
)
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ZeroStrategy(**kwargs)


def test_defaults_and_registry_presets():
    assert ZeroStrategy().options.zero.stage == 3
    assert ZeroStrategy(stage=1).options.zero.bucket_cap_mb == 25.0
    registry = StrategyRegistry.__class__()
    ZeroStrategy.register_strategies(registry)
    for stage in (1, 2, 3):
        strategy = registry.get(f"zero{stage}")
        assert isinstance(strategy, ZeroStrategy) and strategy.options.zero.stage == stage
        assert strategy.strategy_name == f"zero{stage}"


def test_stage3_units_are_the_blocks():
    model = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=16, block_size=8))
    assert find_shard_units(model) == [model.blocks[str(i)] for i in range(3)]


def test_paper_formulas():
    psi, n = 1000, 4
    assert [paper_state_bytes(s, psi, n) for s in range(4)] == [16000, 10000, 7000, 4000]
    assert paper_comm_bytes(0, psi, n) == paper_comm_bytes(2, psi, n) == 2 * 4 * psi * 3 / 4
    assert paper_comm_bytes(3, psi, n) == 3 * 4 * psi * 3 / 4
    with pytest.raises(ValueError, match="stage=5 is not valid"):
        paper_state_bytes(5, psi, n)
