"""lightning_par's names in Fabric's registry, and what the Fabric strategy refuses before any process starts."""

from __future__ import annotations

import lightning as L
import pytest

import lightning_par  # noqa: F401 - registers the names
from lightning_par.fabric import MeshStrategy
from lightning_par.strategies import TensorParallelStrategy, ZeroStrategy


@pytest.mark.parametrize("name", ["ddp_overlap", "zero1", "zero2", "zero3", "tensor_parallel", "parallel_3d"])
def test_registry_names_build_the_fabric_strategy(name: str) -> None:
    fabric = L.Fabric(strategy=name, accelerator="cpu", devices=2)
    assert isinstance(fabric.strategy, MeshStrategy)
    assert fabric.strategy.strategy_name == name


def test_presets_are_the_trainer_strategies() -> None:
    """One core: the registry name's preset is the class the Trainer strategy of that name is made of (the preset on
    the Trainer's MeshStrategy), with the same keywords; Fabric's core is the preset alone, no Trainer strategy."""
    from lightning.pytorch.strategies import Strategy as TrainerStrategy

    from lightning_par.runtime.presets import TensorParallelCore, ZeroCore

    zero3 = L.Fabric(strategy="zero3", accelerator="cpu", devices=2).strategy
    assert issubclass(ZeroStrategy, ZeroCore) and type(zero3.core) is ZeroCore and zero3.core.stage == 3
    tp = L.Fabric(strategy="tensor_parallel", accelerator="cpu", devices=2).strategy
    assert issubclass(TensorParallelStrategy, TensorParallelCore) and type(tp.core) is TensorParallelCore
    assert not isinstance(zero3.core, TrainerStrategy) and not isinstance(tp.core, TrainerStrategy)
    assert tp.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}


def test_same_keywords_and_errors_as_the_trainer() -> None:
    strategy = MeshStrategy(dp_size=2, tp_size=2, dp_mode="zero2", bucket_cap_mb=5)
    assert strategy.options.dp_mode == "zero2"
    with pytest.raises(ValueError, match="dp_mode"):
        MeshStrategy(dp_mode="zero4")
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        MeshStrategy(dp_mode="zero3", bucket_cap_mb=5)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "pipeline"])
def test_pipeline_names_build_the_fabric_strategy(name: str) -> None:
    """Pipelining runs in a Fabric loop through lightning_par.fabric.train_step (tests/fabric/
    test_fabric_pipeline.py)."""
    strategy = L.Fabric(strategy=name, accelerator="cpu", devices=2).strategy
    assert isinstance(strategy, MeshStrategy) and strategy.core._sizes.get("pp_size", 1) > 1


def test_train_step_misuse_is_refused() -> None:
    import torch

    from lightning_par.fabric import train_step

    with pytest.raises(RuntimeError, match="takes what fabric.setup returned"):
        train_step(torch.nn.Linear(2, 2), (torch.zeros(4, 2), torch.zeros(4, 2)))
    with pytest.raises(RuntimeError, match="before fabric.setup"):
        MeshStrategy(pp_size=2).train_step((torch.zeros(4, 2), torch.zeros(4, 2)))
