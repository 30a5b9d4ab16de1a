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
    """One core: the registry name's preset is the Trainer strategy with the same keywords."""
    zero3 = L.Fabric(strategy="zero3", accelerator="cpu", devices=2).strategy
    assert isinstance(zero3.core, ZeroStrategy) and zero3.core.stage == 3
    tp = L.Fabric(strategy="tensor_parallel", accelerator="cpu", devices=2).strategy
    assert isinstance(tp.core, TensorParallelStrategy)
    assert tp.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}


def test_same_keywords_and_errors_as_the_trainer() -> None:
    strategy = MeshStrategy(dp_size=2, tp_size=2, dp_mode="zero2", bucket_cap_mb=5)
    assert strategy.options.dp_mode == "zero2"
    with pytest.raises(ValueError, match="dp_mode"):
        MeshStrategy(dp_mode="zero4")
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        MeshStrategy(dp_mode="zero3", bucket_cap_mb=5)


def test_pipeline_is_refused_before_start() -> None:
    with pytest.raises(ValueError, match="pp_size=2 is not supported in a Fabric loop.*Trainer"):
        MeshStrategy(pp_size=2)


def test_pipeline_names_are_refused_before_start() -> None:
    with pytest.raises(ValueError, match="pp_size=2 is not supported in a Fabric loop"):
        L.Fabric(strategy="1f1b", accelerator="cpu", devices=2)
