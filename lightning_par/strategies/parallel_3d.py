"""``Parallel3DStrategy``: TP in each pipeline stage, PP across stages, DP across replicas (docs/strategies.md)."""

from lightning_par.runtime.presets import Parallel3DCore
from lightning_par.strategies.base import MeshStrategy

__all__ = ["Parallel3DStrategy"]


class Parallel3DStrategy(Parallel3DCore, MeshStrategy):
    """The preset :class:`~lightning_par.runtime.presets.Parallel3DCore` (its keywords, defaults, registry names and
    errors) as a Trainer strategy: :class:`MeshStrategy` with that preset's defaults."""
