"""``DDPOverlapStrategy``: data parallelism with the gradient all-reduce bucketed and overlapped with backward."""

from __future__ import annotations

from typing import Any, ClassVar

from lightning_par.strategies.base import MeshStrategy

__all__ = ["DDPOverlapStrategy"]


class DDPOverlapStrategy(MeshStrategy):
    """Data parallelism over the dp axis, with a bucketed gradient all-reduce launched during backward.

    Each rank keeps a full replica. As backward produces gradients they are copied into buckets of at most
    ``bucket_cap_mb`` MiB, and each full bucket is all-reduced asynchronously while backward goes on (PyTorch DDP,
    Li et al., VLDB 2020, §3.2); the optimizer step waits for the rest. Over Lightning's ``DDPStrategy`` it adds: it
    works on the data-parallel ranks of the mesh (the same reducer serves the dp axis of 2D/3D layouts,
    where torch's DDP does not compose), and it measures the communication left exposed after backward
    (``parallel/comm_exposed_ms`` in the logs, ``comm_exposed_s`` in ``summary.json``). A preset of
    :class:`MeshStrategy` with ``dp_mode="ddp"`` and every axis but tp and pp. Registered as ``"ddp_overlap"``.

    Args:
        dp_size: data-parallel size (``-1``: all processes).
        **options: the reducer group (``comm_hook`` ``"none"``/``"fp16"``/``"bf16"``/``"powersgd"``, ...) and
            :class:`MeshStrategy`'s keywords.

    Raises:
        ValueError: an invalid option, or one of an axis this strategy does not have (named in the message).
    """

    strategy_name: ClassVar[str] = "ddp_overlap"
    excluded_axes: ClassVar[frozenset[str]] = frozenset({"tp", "pp"})
    description: ClassVar[str] = "Data parallel, bucketed all-reduce overlapped with backward"

    def __init__(self, dp_size: int = -1, **options: Any) -> None:
        super().__init__(dp_size=dp_size, dp_mode="ddp", **options)
