"""``DDPOverlapStrategy``: data parallelism, the all-reduce overlapped with backward (docs/strategies.md)."""

from lightning_par.runtime.presets import DDPOverlapCore
from lightning_par.strategies.base import MeshStrategy

__all__ = ["DDPOverlapStrategy"]


class DDPOverlapStrategy(DDPOverlapCore, MeshStrategy):
    """The preset :class:`~lightning_par.runtime.presets.DDPOverlapCore` (its keywords, defaults, registry names and
    errors) as a Trainer strategy: :class:`MeshStrategy` with that preset's defaults."""
