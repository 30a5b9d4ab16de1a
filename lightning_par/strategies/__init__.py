"""lightning_par's Lightning strategies; :func:`register_all` adds them to Lightning's ``StrategyRegistry``."""

from __future__ import annotations

from typing import Any

from lightning_par.strategies.base import MeshStrategy
from lightning_par.strategies.ddp_overlap import DDPOverlapStrategy
from lightning_par.strategies.parallel_3d import Parallel3DStrategy
from lightning_par.strategies.pipeline import PipelineStrategy
from lightning_par.strategies.tensor_parallel import TensorParallelStrategy
from lightning_par.strategies.zero import ZeroStrategy

__all__ = ["DDPOverlapStrategy", "MeshStrategy", "Parallel3DStrategy", "PipelineStrategy", "STRATEGIES", "TensorParallelStrategy", "ZeroStrategy", "register_all"]

#: Every concrete strategy class, registered under the names its ``register_strategies`` gives.
STRATEGIES: tuple[type[MeshStrategy], ...] = (DDPOverlapStrategy, TensorParallelStrategy, ZeroStrategy, PipelineStrategy, Parallel3DStrategy)


def register_all(registry: Any | None = None) -> None:
    """Register every lightning_par strategy (idempotent)."""
    if registry is None:
        from lightning.pytorch.strategies import StrategyRegistry as registry
    for cls in STRATEGIES:
        cls.register_strategies(registry)
