"""lightning_par for Lightning Fabric: ``Fabric(strategy="zero3")`` and :class:`MeshStrategy` run the same layouts as
the Trainer strategies, through the same core (see :mod:`lightning_par.fabric.strategy` and ``docs/fabric.md``)."""

from __future__ import annotations

from typing import Any

from lightning_par.fabric.strategy import MeshStrategy

__all__ = ["MeshStrategy", "register_all"]


def register_all(registry: Any | None = None) -> None:
    """Register lightning_par's names in Fabric's ``STRATEGY_REGISTRY`` (idempotent)."""
    if registry is None:
        from lightning.fabric.strategies import STRATEGY_REGISTRY as registry
    MeshStrategy.register_strategies(registry)
