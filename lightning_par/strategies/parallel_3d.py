"""``Parallel3DStrategy``: tensor parallelism inside each pipeline stage, pipelining across stages, data parallelism
across replicas (ddp, ZeRO-1, ZeRO-2 or ZeRO-3), on one mesh of named axes."""

from __future__ import annotations

from typing import Any, ClassVar

from lightning_par.parallelize import ParallelOptions
from lightning_par.strategies.base import MeshStrategy

__all__ = ["Parallel3DStrategy"]


class Parallel3DStrategy(MeshStrategy):
    """TP inside each pipeline stage, PP across stages, DP (``dp_mode``) across replicas: ``dp * tp * pp = world``.

    The layout of Megatron-LM's "PTD-P" (Narayanan et al. 2021, §2.3: tp innermost, pp outermost), applied by
    :func:`lightning_par.parallelize.parallelize` in its fixed order: pipeline cut -> tensor parallel -> dp mode ->
    schedule. It is :class:`MeshStrategy` with every axis and every option; ``pp_size=1`` runs the LightningModule's
    own steps (no pipeline).

    Registered as ``"parallel_3d"``.

    Args:
        dp_size: data-parallel replicas (``-1``: ``world_size // (tp_size * pp_size)``).
        tp_size: tensor-parallel ranks per stage.
        pp_size: pipeline ranks.
        dp_mode: ``"ddp"``, ``"zero1"``, ``"zero2"`` or ``"zero3"`` (Rajbhandari et al. 2020).
        **options: the option groups (reducer, zero, tensor_parallel, pipeline), flat or nested, and
            :class:`MeshStrategy`'s keywords; see :class:`MeshStrategy`.

    Raises:
        ValueError: see :class:`MeshStrategy`.
    """

    strategy_name: ClassVar[str] = "parallel_3d"
    excluded_axes: ClassVar[frozenset[str]] = frozenset()
    description: ClassVar[str] = "3D parallel: TP in each pipeline stage, PP across stages, ddp/zero1/zero2/zero3 on dp"

    def __init__(self, dp_size: int = -1, tp_size: int = 1, pp_size: int = 1, dp_mode: str = ParallelOptions.dp_mode,
                 **options: Any) -> None:
        super().__init__(dp_size=dp_size, tp_size=tp_size, pp_size=pp_size, dp_mode=dp_mode, **options)
