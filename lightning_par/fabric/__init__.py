"""lightning_par for Lightning Fabric: ``Fabric(strategy="zero3")`` and :class:`MeshStrategy` run the same layouts as
the Trainer strategies, through the same core (see :mod:`lightning_par.fabric.strategy` and ``docs/fabric.md``)."""

from __future__ import annotations

from typing import Any

from lightning_par.fabric.strategy import MeshStrategy

__all__ = ["MeshStrategy", "register_all", "train_step"]


def train_step(model: Any, batch: Any, *, loss_scale: float = 1.0) -> Any:
    """One training step of a pipelined layout (``pp_size > 1``) in a Fabric loop: the pipeline schedule runs
    forward and backward over ``batch``, micro-batch by micro-batch; the gradients accumulate into ``.grad`` and are
    reduced over dp (skipped inside ``fabric.no_backward_sync(model)``). Then ``fabric.clip_gradients`` and
    ``optimizer.step()`` as usual. Do not call ``model(x)`` or ``fabric.backward``: under pipelining both raise.

    Args:
        model: what ``fabric.setup`` returned; its module keeps the network at ``module_attr`` (``.model``) and
            defines ``loss_fn(outputs, targets)`` (or ``pipeline_loss``): one micro-batch's mean loss.
        batch: this rank's batch (``fabric.setup_dataloaders`` shards over the dp ranks; the pp ranks of a replica
            read the same one): ``(inputs, targets)``, or any structure the module's ``pipeline_batch(batch)`` maps
            to that; split along dim 0 into ``num_microbatches`` micro-batches.
        loss_scale: factor on the loss before backward (``1 / accumulate`` under accumulation); the returned loss is
            unscaled.

    Returns:
        The batch's mean loss (a detached fp32 scalar), the same on every rank of the pipeline.

    Raises:
        RuntimeError: ``model`` is not set up by a lightning_par Fabric strategy, or its layout has no pipeline.
        ValueError: the batch is not ``(inputs, targets)`` (see :func:`lightning_par.contract.pipeline_batch`).
    """
    strategy = getattr(model, "_strategy", None)
    if not isinstance(strategy, MeshStrategy):
        raise RuntimeError(
            f"train_step(model, batch) takes what fabric.setup returned under a lightning_par Fabric strategy; got "
            f"{type(model).__name__} (strategy {type(strategy).__name__ if strategy is not None else None})."
        )
    return strategy.train_step(batch, loss_scale=loss_scale)


def register_all(registry: Any | None = None) -> None:
    """Register lightning_par's names in Fabric's ``STRATEGY_REGISTRY`` (idempotent)."""
    if registry is None:
        from lightning.fabric.strategies import STRATEGY_REGISTRY as registry
    MeshStrategy.register_strategies(registry)
