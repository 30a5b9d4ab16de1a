"""``Parallel3DStrategy``: TP inside each pipeline stage, PP across stages, DP (ddp or ZeRO) across replicas."""

from __future__ import annotations

from typing import Any, ClassVar

from lightning_par.parallelize import ParallelOptions
from lightning_par.strategies.base import MeshStrategy

__all__ = ["Parallel3DStrategy"]


class Parallel3DStrategy(MeshStrategy):
    """TP inside each pipeline stage, PP across stages, DP (``dp_mode``) across replicas: ``dp * tp * pp = world``.

    The layout of Megatron-LM's "PTD-P" (Narayanan et al. 2021, §2.3: tp innermost, pp outermost), applied by
    :func:`lightning_par.parallelize.parallelize` in its fixed order: pipeline cut -> tensor parallel -> dp mode ->
    schedule. It is :class:`MeshStrategy` with every axis and every option (its keywords and errors);
    ``pp_size=1`` runs the LightningModule's own steps (no pipeline). Registered as ``"parallel_3d"``.
    """

    strategy_name: ClassVar[str] = "parallel_3d"
    excluded_axes: ClassVar[frozenset[str]] = frozenset()
    description: ClassVar[str] = "3D parallel: TP in each pipeline stage, PP across stages, ddp/zero1/zero2/zero3 on dp"

    def __init__(self, dp_size: int = -1, tp_size: int = 1, pp_size: int = 1, dp_mode: str = ParallelOptions.dp_mode,
                 **options: Any) -> None:
        super().__init__(dp_size=dp_size, tp_size=tp_size, pp_size=pp_size, dp_mode=dp_mode, **options)
