"""lightning_par for Lightning Fabric: ``Fabric(strategy="zero3")`` and :class:`MeshStrategy` run the same layouts as
the Trainer strategies, through the same runtime (see :mod:`lightning_par.fabric.strategy` and ``docs/fabric.md``)."""

from __future__ import annotations

from typing import Any

from lightning_par.compat.fabric import fabric_module_strategy
from lightning_par.fabric.strategy import MeshStrategy
from lightning_par.runtime.presets import PRESETS

__all__ = ["MeshStrategy", "register_all", "token_mean_loss", "train_step"]


def train_step(model: Any, batch: Any, *, loss_scale: float = 1.0, loss_fn: Any = None) -> Any:
    """One training step's forward and backward in a Fabric loop, under any layout; the step call of pipelining
    (``pp_size > 1``) and of context parallelism (``cp_size > 1``), where ``model(x)`` then ``fabric.backward`` has
    no place. The gradients accumulate into ``.grad`` and are reduced over dp (skipped inside
    ``fabric.no_backward_sync(model)``). Then ``fabric.clip_gradients`` and ``optimizer.step()`` as usual.

    * ``pp_size > 1``: the pipeline schedule runs forward and backward over ``batch``, micro-batch by micro-batch
      (split along dim 0 into ``num_microbatches``), with the model's ``loss_fn``.
    * otherwise: ``loss_fn(model(*inputs), targets)`` on this rank's piece of the batch, in Fabric's precision,
      through every axis's step wrapper, then backward. Under cp the piece is every tensor of the batch whose dim 1
      is the sequence (inputs and targets) cut into ``2 cp_size`` chunks (rank ``i`` keeps chunks ``i`` and
      ``2 cp_size - 1 - i``), and the model gets the kept tokens' global positions as ``position_ids=`` (shape
      ``(seq / cp_size,)``); the returned loss is the token mean over the cp ranks (targets equal to ``-100`` not
      counted). Under dp (and cp) each rank's gradient is weighed by its share of the counted tokens, so the dp
      average is one process's gradient of the global token mean, label masks included.

    Args:
        model: what ``fabric.setup`` returned. Under pipelining its module keeps the network at ``module_attr``
            (``.model``).
        batch: this rank's batch (``fabric.setup_dataloaders`` shards over the dp ranks; the tp, cp and pp ranks of a
            replica read the same one): ``(inputs, targets)``, inputs a tensor or a tuple of tensors; or any structure
            the module's ``pipeline_batch(batch)`` maps to that (under cp it receives the batch with the positions
            appended, as a LightningModule's step does).
        loss_scale: factor on the loss before backward (``1 / accumulate`` under accumulation; also the factor of an
            attached auxiliary loss); the returned loss is unscaled.
        loss_fn: ``(outputs, targets) -> the mean loss`` (a scalar tensor); default: the module's ``pipeline_loss``
            or ``loss_fn``. Under pipelining only the module's (fixed at ``fabric.setup``).

    Returns:
        The global batch's token mean (a detached fp32 scalar, the same on every rank): the ranks' losses weighed by
        their counted tokens over every dp and cp rank (under pipelining, the replicas' token means over their
        micro-batches weighed over dp), one process's value on the same global batch, label masks included.

    Raises:
        RuntimeError: ``model`` is not set up by a lightning_par Fabric strategy.
        ValueError: no loss function; ``loss_fn`` under pipelining; a batch that is not ``(inputs, targets)`` and no
            ``pipeline_batch`` (see :func:`lightning_par.contract.pipeline_batch`).
    """
    strategy = fabric_module_strategy(model)
    if not isinstance(strategy, MeshStrategy):
        raise RuntimeError(
            f"train_step(model, batch) takes what fabric.setup returned under a lightning_par Fabric strategy; got "
            f"{type(model).__name__} (strategy {type(strategy).__name__ if strategy is not None else None})."
        )
    return strategy.train_step(batch, loss_scale=loss_scale, loss_fn=loss_fn)


def token_mean_loss(model: Any, loss_sum: Any, tokens: Any) -> Any:
    """The loss of a plain Fabric loop (``model(x)``, ``fabric.backward``) whose gradient, averaged over the dp ranks
    by the strategy, is one process's gradient of the global batch's token mean, whatever the label mask.

    ``F.cross_entropy`` with its default mean on each dp rank is the mean over *that rank's* counted tokens (targets
    not ``-100``): the dp average of those gradients is the mean of the replicas' means, which differs from one
    process's token mean as soon as the ranks count different numbers of tokens (answer-only labels, padding). Give
    the rank's loss *sum* and its token count instead::

        loss_sum = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
        loss = token_mean_loss(model, loss_sum, (y != -100).sum())
        fabric.backward(loss)
        global_mean = fabric.all_reduce(loss.detach())   # the global batch's token mean

    Args:
        model: what ``fabric.setup`` returned.
        loss_sum: this rank's summed loss over its counted tokens (a scalar tensor).
        tokens: this rank's number of counted tokens (a number or a scalar tensor).

    Returns:
        ``loss_sum * dp_size / N``, ``N`` the counted tokens summed over the dp ranks (the tp and pp ranks of a
        replica count the same batch and are not added); its mean over the dp ranks is the global token mean. ``0``
        (with a zero gradient) when no rank counts a token. Collective over the dp group: every rank calls it.

    Raises:
        RuntimeError: ``model`` is not set up by a lightning_par Fabric strategy, or the layout has ``cp_size > 1``
            (:func:`train_step` does this there itself).
    """
    strategy = fabric_module_strategy(model)
    if not isinstance(strategy, MeshStrategy):
        raise RuntimeError(
            f"token_mean_loss(model, ...) takes what fabric.setup returned under a lightning_par Fabric strategy; got "
            f"{type(model).__name__}."
        )
    return strategy.token_mean(loss_sum, tokens)


def register_all(registry: Any | None = None, presets: tuple[Any, ...] = PRESETS) -> None:
    """Register lightning_par's names in Fabric's ``STRATEGY_REGISTRY`` (idempotent): every registry name of
    ``presets`` (the Trainer's too: :data:`lightning_par.runtime.presets.PRESETS`), each with its core."""
    if registry is None:
        from lightning.fabric.strategies import STRATEGY_REGISTRY as registry
    MeshStrategy.register_strategies(registry, presets)
