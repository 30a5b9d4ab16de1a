"""``ZeroStrategy``: ZeRO stages 1, 2 and 3 on the dp axes, HSDP too (docs/strategies.md)."""

from lightning_par.runtime.presets import ZeroCore
from lightning_par.strategies.base import MeshStrategy

__all__ = ["ZeroStrategy"]


class ZeroStrategy(ZeroCore, MeshStrategy):
    """The preset :class:`~lightning_par.runtime.presets.ZeroCore` (its keywords, defaults, registry names and
    errors) as a Trainer strategy: :class:`MeshStrategy` with that preset's defaults."""
