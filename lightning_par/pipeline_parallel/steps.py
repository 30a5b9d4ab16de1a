"""The pp axis's step hooks: a schedule runs forward and backward inside ``training_step``.

How it fits Lightning's automatic optimization (``Closure``: ``training_step``, then ``zero_grad`` on the first batch of
an accumulation window, then ``backward``, then clipping and ``optimizer.step``):

* :meth:`PipelinedSteps.training_step` runs the whole schedule (:class:`~lightning_par.pipeline_parallel.engine.
  PipelineEngine`), so forward and backward both happen there, with the dp engine's reduction deferred
  (``defer_sync``). It returns the batch loss from the last stage, shared with every rank of the pipeline.
* Lightning zeroes the gradients *after* ``training_step`` on the first batch of each window, so the new gradients are
  held aside and :meth:`PipelinedSteps.backward` (no autograd: DeepSpeed's strategy makes ``backward`` a no-op the same
  way) hands them back, then reduces them over dp once — on the batch that ends a window (Lightning wraps the others in
  ``block_backward_sync``). The result is exactly the gradients one process would hold.
* Gradient accumulation stays Lightning's: each batch's loss is scaled by ``1 / accumulate_grad_batches``.
* Evaluation runs forward only through the stages, then the LightningModule's own ``validation_step`` / ``test_step``
  on every pp rank with the last stage's outputs (:mod:`~lightning_par.pipeline_parallel.user_steps`).
* The LightningModule's ``training_step`` does not make the loss (the schedule computes each micro-batch's loss with
  ``loss_fn`` as it goes); it runs on the last stage on each micro-batch's outputs, without gradient, for what it
  logs, replayed on every rank. Manual optimization is refused before start.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_par import contract
from lightning_par.pipeline_parallel.bubble import summarize_bubble
from lightning_par.pipeline_parallel.schedules import bubble_formula
from lightning_par.pipeline_parallel.user_steps import (
    TrainingStepCapture,
    broadcast_outputs,
    network_returns,
    split_microbatches,
)
from lightning_par.steps import StepHooks

__all__ = ["PipelinedSteps"]


def _set_documents(pipeline: Any, batch: Any, num_microbatches: int, network: Any) -> None:
    """A packed block's document ids, split into the schedule's micro-batches, for the engine to run each stage's
    forward of micro-batch ``i`` with (:mod:`lightning_par.data.doc_mask`); nothing for other batches."""
    from lightning_par.context_parallel.contract import context_parallel_attention
    from lightning_par.data.doc_mask import batch_document_ids
    from lightning_par.pipeline_parallel.engine import split_tree

    documents = batch_document_ids(batch)
    if documents is None:
        pipeline.documents = None
        return
    pipeline.documents = split_tree(documents, num_microbatches, "the batch's document_ids")
    pipeline.document_context = context_parallel_attention(network)


class PipelinedSteps(StepHooks):
    """The step hooks of a parallel model with a pipeline (``parallel.pipeline``).

    Args:
        parallel: the parallel model; its ``pipeline`` runs the schedule over its ``stage_modules``.
    """

    def __init__(self, parallel: Any) -> None:
        super().__init__(parallel)
        self.sync_blocked = False
        self._held: list[Tensor | None] | None = None
        self.step_stats: list[list[tuple[float, float, int]]] = []  # per step, per pp rank

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.parallel.network.parameters() if p.requires_grad]

    def bubble_formula(self) -> float:
        """The schedule's idle share for uniform stages (interleaved: ``(p - 1) / (v m + p - 1)``)."""
        options = self.parallel.options.pipeline
        return bubble_formula(self.parallel.dims.pp_size, options.num_microbatches, options.virtual_stages)

    # ------------------------------------------------------------------ training
    def training_step(self, host: Any, call: Any, batch: Any, batch_idx: int) -> Tensor:
        """Run the schedule on the batch (forward and backward) and return the batch's mean loss on every rank.

        The LightningModule's own ``training_step`` (``call``) runs on the last stage for each micro-batch, on its
        outputs and without gradient, for what it logs; every rank then logs the micro-batch means of those values
        (:class:`~lightning_par.pipeline_parallel.user_steps.TrainingStepCapture`), and ``train_loss`` (the batch's
        mean loss) when the step logs no value of that name.

        Raises:
            ValueError: (on every rank) the step's network call is not once on the micro-batch's inputs, it logs a
                value that is not a scalar, or calls ``self.all_gather``; the step's own exception.
        """
        parallel = self.parallel
        module = host.lightning_module
        prepared = parallel.prepare_batch(batch)
        inputs, targets = contract.pipeline_batch(module, prepared)
        accumulate = module.trainer.accumulate_grad_batches
        params = self._params()
        opens_window = batch_idx % accumulate == 0
        if opens_window:  # Lightning's zero_grad comes after this step; drop the old gradients now instead
            for p in params:
                p.grad = None
        for m in parallel.stage_modules:
            m.train(module.training)
        pipeline, attr = parallel.pipeline, parallel.options.module_attr
        m = parallel.options.pipeline.num_microbatches
        capture = None
        if pipeline.has_last_stage:  # the user's training_step, per micro-batch, for what it logs
            micro = [parallel.transform_batch(b) for b in split_microbatches(batch, m)]
            firsts = [contract.pipeline_batch(module, b)[0][0] for b in micro]
            capture = TrainingStepCapture(module, getattr(module, attr), attr, call, micro, firsts)
        pipeline.observer = capture
        _set_documents(pipeline, prepared, m, parallel.network)
        try:
            with parallel.engine.defer_sync():
                loss = pipeline.train_step(inputs, targets, loss_scale=1.0 / accumulate)
        finally:
            pipeline.observer = None
            pipeline.documents = None
        for after in parallel.after_schedule:  # e.g. tp's partial gradients, deferred out of the schedule
            after()
        if opens_window:  # hold the new gradients aside while Lightning zeroes; backward() hands them back
            self._held = [p.grad for p in params]
            for p in params:
                p.grad = None
        loss = self._share_step(loss, host.root_device)
        dims = parallel.dims
        pp_group = dims.group("pp")
        last = dist.get_global_rank(pp_group, parallel.options.pipeline.last_stage_rank(dims.pp_size))
        if capture is not None:
            capture.weights = pipeline.log_weights  # read to the host with the logged values, once (capture.share)
        records = (capture or TrainingStepCapture(module, None, attr, call, [], [])).share(
            last, pp_group, pipeline.has_last_stage)

        def report(_: Any) -> Tensor:  # through the axes' step wrappers: under cp, the mean over the cp ranks' tokens
            logged = TrainingStepCapture.replay(module, records, host.root_device)
            if "train_loss" not in logged:
                module.log("train_loss", loss, prog_bar=True)
            return loss

        loss = parallel.run_step(report, prepared)
        stages = self.step_stats[-1]
        window = max(s[0] for s in stages)
        if parallel.options.pipeline.measure_bubble and window > 0:
            measured = sum(1.0 - s[1] / window for s in stages) / len(stages)
            from lightning_par.callbacks.metrics import log_host_number

            log_host_number(module, "parallel/pp_bubble", measured, on_step=True, on_epoch=False,
                            prog_bar=host.prog_bar)
            log_host_number(module, "parallel/pp_bubble_formula", self.bubble_formula(), on_step=True, on_epoch=False)
        return loss

    def _share_step(self, loss: Tensor | None, device: torch.device) -> Tensor:
        """One all-gather over the pp group: the loss from the last stage, and every pp rank's step timings."""
        record = self.parallel.pipeline.history[-1]
        own = loss.detach().reshape(1) if loss is not None else torch.full((1,), float("nan"), device=device)
        mine = torch.cat([own.to(device, torch.float64),
                          torch.tensor(record.compact(), dtype=torch.float64, device=device)])
        dims = self.parallel.dims
        parts = [torch.empty_like(mine) for _ in range(dims.pp_size)]
        dist.all_gather(parts, mine, group=dims.group("pp"))
        stats = torch.stack(parts).tolist()  # one read to the host per step: the stages' timings
        self.step_stats.append([(p[1], p[2], int(p[3])) for p in stats])
        last = parts[self.parallel.options.pipeline.last_stage_rank(dims.pp_size)]
        return last[0].to(torch.float32)

    def share_loss(self, loss: Tensor | None, device: torch.device) -> Tensor:
        """The last stage's loss of the step that just ran, on every pp rank (:meth:`_share_step`: collective over
        the pp group); the runtime's one-call step (:func:`lightning_par.runtime.step.train_step`) reads it."""
        return self._share_step(loss, device)

    def backward(self, host: Any, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """No autograd: hand back the gradients held aside during Lightning's ``zero_grad``, then reduce them over dp
        once at the end of an accumulation window."""
        module, precision = host.lightning_module, host.precision_plugin
        closure_loss = precision.pre_backward(closure_loss, module)
        if self._held is not None:
            for p, g in zip(self._params(), self._held):
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)
            self._held = None
        if not self.sync_blocked:
            host.log_comm(self.parallel.engine.reduce_now())
        return precision.post_backward(closure_loss, module)

    @contextmanager
    def block_sync(self) -> Generator[None, None, None]:
        previous, self.sync_blocked = self.sync_blocked, True
        try:
            yield
        finally:
            self.sync_blocked = previous

    # ------------------------------------------------------------------ evaluation
    def eval_step(self, host: Any, stage: str, call: Any, batch: Any) -> Any:
        """Forward only through the stages, then the LightningModule's own ``validation_step`` / ``test_step``
        (``call``) on every pp rank, its network call answered by the last stage's outputs
        (:mod:`~lightning_par.pipeline_parallel.user_steps`): what it logs, gathers and returns is the same on every
        rank, and equal to one process's on the same batch.

        Raises:
            NotImplementedError: ``stage="predict"``: the outputs live on the last stage only.
            ValueError: the step does not call the network exactly once on the batch's inputs.
        """
        if stage == "predict":
            raise NotImplementedError(
                "predict is not supported under pipelining (pp_size > 1): the outputs live on the last stage only. "
                "Consolidate the checkpoint (python -m lightning_par.checkpoint.consolidate DIR FILE) and predict "
                "with one process or pp_size=1."
            )
        parallel = self.parallel
        module = host.lightning_module
        prepared = parallel.prepare_batch(batch)
        inputs, _ = contract.pipeline_batch(module, prepared)
        for m in parallel.stage_modules:
            m.train(module.training)
        _set_documents(parallel.pipeline, prepared, parallel.pipeline.eval_microbatches(inputs), parallel.network)
        try:
            with host.precision_plugin.forward_context(), parallel.loss_context():
                outputs = parallel.pipeline.eval_outputs(inputs)
        finally:
            parallel.pipeline.documents = None
        dims = parallel.dims
        pp_group = dims.group("pp")
        last = dist.get_global_rank(pp_group, parallel.options.pipeline.last_stage_rank(dims.pp_size))
        outputs = broadcast_outputs(outputs, last, pp_group, host.root_device,
                                    mesh=lambda: dims.get_mesh("tp"))
        attr = parallel.options.module_attr
        hook = "validation_step" if stage == "val" else f"{stage}_step"
        network = getattr(module, attr)
        outputs = contract.pipeline_output(network, outputs)
        with network_returns(network, inputs[0], outputs, type(module).__name__, attr, hook):
            with parallel.loss_context():
                return parallel.run_step(call, prepared)

    # ------------------------------------------------------------------ reporting
    def summary(self) -> dict[str, Any]:
        """Schedule, split and bubble figures (the first step, with its one-off costs, left out when there are
        others)."""
        options = self.parallel.options.pipeline
        extras: dict[str, Any] = {
            "pp_schedule": options.schedule,
            "num_microbatches": options.num_microbatches,
            "virtual_stages": options.virtual_stages,
            "pp_layers_per_stage": self.parallel.layer_counts,
            "pp_bubble_formula": self.bubble_formula(),
            "pp_sent_dtypes": self.parallel.pipeline.sent_dtypes(),
        }
        steps = self.step_stats[1:] or self.step_stats
        if steps:
            per_stage = [[step[s] for step in steps] for s in range(len(steps[0]))]
            extras.update(summarize_bubble(per_stage))
            extras["pp_bubble_measured_steps"] = len(steps)
        return extras
