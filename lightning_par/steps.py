"""The step protocol of a parallel model: how the strategy runs a training or evaluation step, whatever the layout.

:class:`StepHooks` runs the LightningModule's own ``*_step`` methods with the dp engine's hooks around backward (the
bucketed reduction overlaps it, and is skipped inside an accumulation window). A parallelism that runs steps itself
(pipelining: a schedule runs forward and backward inside ``training_step``) replaces it in its ``parallelize()`` step
with a subclass (:class:`~lightning_par.pipeline_parallel.steps.PipelinedSteps`); the strategy only calls the protocol.

The *host* passed to each hook is the strategy: the hooks read its ``lightning_module``, ``precision_plugin``,
``root_device``, ``prog_bar`` and call its ``log_comm``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from lightning_par.runtime import step

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["StepHooks"]


class StepHooks:
    """The LightningModule's own steps, with the dp engine's hooks around backward.

    Args:
        parallel: the parallel model the steps run.
    """

    def __init__(self, parallel: Any) -> None:  # a lightning_par.parallelize.ParallelModel (not imported: below it)
        self.parallel = parallel

    def training_step(self, host: Any, call: Callable[[Any], Any], batch: Any, batch_idx: int) -> Any:
        """One training step: ``call(batch)`` runs the LightningModule's ``training_step`` on this rank's batch
        (:meth:`~lightning_par.parallelize.ParallelModel.prepare_batch`), through the runtime's
        :func:`~lightning_par.runtime.step.forward` with Lightning's loss factor ``1 / accumulate_grad_batches``."""
        scale = 1.0 / host.lightning_module.trainer.accumulate_grad_batches
        return step.forward(self.parallel, call, self.parallel.prepare_batch(batch), scale)

    def backward(self, host: Any, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Backward, then the end of the dp reduction, then ``on_after_backward`` (the runtime's
        :func:`~lightning_par.runtime.step.backward` around the precision plugin's).

        Lightning's own ``Strategy.backward`` calls ``on_after_backward`` (in the precision plugin's ``post_backward``)
        before the strategy's ``post_backward``; under ``DDPStrategy`` and ``FSDPStrategy`` the reduction has ended
        inside backward by then, so a user's ``on_after_backward`` (gradient-norm logging, say) sees gradients averaged
        over dp. The dp engine here finishes after backward returns, so this runs it before that hook; otherwise the
        hook would see this rank's unreduced gradients (tests/data_parallel/test_ddp_overlap.py).
        """
        module, precision = host.lightning_module, host.precision_plugin
        loss = [closure_loss]

        def run() -> None:
            loss[0] = precision.pre_backward(loss[0], module)
            precision.backward(loss[0], module, optimizer, *args, **kwargs)

        def after(stats: Any) -> Tensor:
            host.log_comm(stats)
            return precision.post_backward(loss[0], module)

        return step.backward(self.parallel, run, after)

    def block_sync(self) -> AbstractContextManager[None]:
        """Entered for every batch of an accumulation window but the last: no dp reduction then."""
        return self.parallel.engine.no_sync()

    def eval_step(self, host: Any, stage: str, call: Callable[[Any], Any], batch: Any) -> Any:
        """A validation (``stage="val"``), test or predict step: ``call(batch)`` runs the LightningModule's own on
        this rank's batch (the runtime's :func:`~lightning_par.runtime.step.evaluate`)."""
        return step.evaluate(self.parallel, call, self.parallel.prepare_batch(batch))

    def summary(self) -> dict[str, Any]:
        """Figures for ``summary.json``."""
        return {}
