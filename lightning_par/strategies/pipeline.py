"""``PipelineStrategy``: pipeline parallelism on pp (torch's schedules), Lightning's loop (docs/strategies.md)."""

from lightning_par.runtime.presets import PipelineCore
from lightning_par.strategies.base import MeshStrategy

__all__ = ["PipelineStrategy"]


class PipelineStrategy(PipelineCore, MeshStrategy):
    """The preset :class:`~lightning_par.runtime.presets.PipelineCore` (its keywords, defaults, registry names and
    errors) as a Trainer strategy: :class:`MeshStrategy` with that preset's defaults."""
