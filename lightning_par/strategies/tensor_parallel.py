"""``TensorParallelStrategy``: Megatron tensor parallelism on tp, bucketed dp (docs/strategies.md)."""

from lightning_par.runtime.presets import TensorParallelCore
from lightning_par.strategies.base import MeshStrategy

__all__ = ["TensorParallelStrategy"]


class TensorParallelStrategy(TensorParallelCore, MeshStrategy):
    """The preset :class:`~lightning_par.runtime.presets.TensorParallelCore` (its keywords, defaults, registry names and
    errors) as a Trainer strategy: :class:`MeshStrategy` with that preset's defaults."""
