"""The Lightning side of a pipelined step: a schedule runs forward and backward inside ``training_step``.

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
* Evaluation runs forward only through the stages; the loss is broadcast from the last stage.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_par import contract
from lightning_par.pipeline_parallel.bubble import summarize_bubble
from lightning_par.pipeline_parallel.schedules import bubble_formula
from lightning_par.tensor_parallel.apply import reduce_partial_grads
from lightning_par.tensor_parallel.styles import sync_tp_partial_grads

__all__ = ["PipelinedSteps"]


class PipelinedSteps:
    """The pipelined training and evaluation steps of a :class:`~lightning_par.strategies.base.MeshStrategy`.

    Args:
        strategy: the strategy whose ``parallel`` model has a pipeline.
    """

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.sync_blocked = False
        self._held: list[Tensor | None] | None = None
        self.step_stats: list[list[tuple[float, float, int]]] = []  # per step, per pp rank

    @property
    def _parallel(self) -> Any:
        return self.strategy.parallel

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for p in self._parallel.network.parameters() if p.requires_grad]

    def bubble_formula(self) -> float:
        """The schedule's idle share for uniform stages (interleaved: ``(p - 1) / (v m + p - 1)``)."""
        options = self.strategy.options.pipeline
        return bubble_formula(self.strategy.parallel_dims.pp_size, options.num_microbatches, options.virtual_stages)

    # ------------------------------------------------------------------ training
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        """Run the schedule on the batch (forward and backward) and return the batch's mean loss on every rank."""
        parallel, strategy = self._parallel, self.strategy
        module = strategy.lightning_module
        inputs, targets = contract.pipeline_batch(module, batch)
        accumulate = module.trainer.accumulate_grad_batches
        params = self._params()
        opens_window = batch_idx % accumulate == 0
        if opens_window:  # Lightning's zero_grad comes after this step; drop the old gradients now instead
            for p in params:
                p.grad = None
        for m in parallel.stage_modules:
            m.train(module.training)
        with parallel.engine.defer_sync():
            loss = parallel.pipeline.train_step(inputs, targets, loss_scale=1.0 / accumulate)
        if strategy.parallel_dims.tp_enabled:
            reduce_partial_grads(parallel.network)  # deferred out of the schedule (see apply_tensor_parallel)
        if opens_window:  # hold the new gradients aside while Lightning zeroes; backward() hands them back
            self._held = [p.grad for p in params]
            for p in params:
                p.grad = None
        loss = self._share_step(loss)
        module.log("train_loss", loss, prog_bar=True)
        stages = self.step_stats[-1]
        window = max(s[0] for s in stages)
        if strategy.options.pipeline.measure_bubble and window > 0:
            measured = sum(1.0 - s[1] / window for s in stages) / len(stages)
            module.log("parallel/pp_bubble", measured, on_step=True, on_epoch=False, prog_bar=strategy.prog_bar)
            module.log("parallel/pp_bubble_formula", self.bubble_formula(), on_step=True, on_epoch=False)
        return loss

    def _share_step(self, loss: Tensor | None) -> Tensor:
        """One all-gather over the pp group: the loss from the last stage, and every pp rank's step timings."""
        record = self._parallel.pipeline.history[-1]
        mine = torch.tensor([float(loss) if loss is not None else float("nan"), *record.compact()], dtype=torch.float64)
        dims = self.strategy.parallel_dims
        parts = [torch.empty_like(mine) for _ in range(dims.pp_size)]
        dist.all_gather(parts, mine, group=self.strategy.group("pp"))
        self.step_stats.append([(p[1].item(), p[2].item(), int(p[3].item())) for p in parts])
        last = parts[self.strategy.options.pipeline.last_stage_rank(dims.pp_size)]
        return last[0].to(torch.float32).to(self.strategy.root_device)

    def backward(self, closure_loss: Tensor) -> Tensor:
        """No autograd: hand back the gradients held aside during Lightning's ``zero_grad``, then reduce them over dp
        once at the end of an accumulation window."""
        strategy = self.strategy
        module = strategy.lightning_module
        closure_loss = strategy.precision_plugin.pre_backward(closure_loss, module)
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
            stats = self._parallel.engine.reduce_now()
            strategy.log_comm(stats)
            if strategy.parallel_dims.tp_enabled:  # replicated parameters' partial gradients: once per step
                sync_tp_partial_grads(self._parallel.module, strategy.group("tp"), self._parallel.engine)
        return strategy.precision_plugin.post_backward(closure_loss, module)

    # ------------------------------------------------------------------ evaluation
    def eval_loss(self, batch: Any) -> Tensor:
        """Forward only through the stages; the batch loss on every rank (broadcast from the last stage)."""
        strategy = self.strategy
        module = strategy.lightning_module
        inputs, targets = contract.pipeline_batch(module, batch)
        for m in self._parallel.stage_modules:
            m.train(module.training)
        with strategy.precision_plugin.forward_context():
            loss = self._parallel.pipeline.eval_step(inputs, targets)
        value = torch.tensor([float(loss) if loss is not None else 0.0], dtype=torch.float32)
        pp_group = strategy.group("pp")
        last = strategy.options.pipeline.last_stage_rank(strategy.parallel_dims.pp_size)
        dist.broadcast(value, src=dist.get_global_rank(pp_group, last), group=pp_group)
        return value[0].to(strategy.root_device)

    # ------------------------------------------------------------------ reporting
    def summary(self) -> dict[str, Any]:
        """Schedule, split and bubble figures (the first step, with its one-off costs, left out when there are
        others)."""
        options = self.strategy.options.pipeline
        extras: dict[str, Any] = {
            "pp_schedule": options.schedule,
            "num_microbatches": options.num_microbatches,
            "virtual_stages": options.virtual_stages,
            "pp_layers_per_stage": self._parallel.layer_counts if self._parallel is not None else None,
            "pp_bubble_formula": self.bubble_formula(),
            "pp_sent_dtypes": self._parallel.pipeline.sent_dtypes() if self._parallel is not None else [],
        }
        steps = self.step_stats[1:] or self.step_stats
        if steps:
            per_stage = [[step[s] for step in steps] for s in range(len(steps[0]))]
            extras.update(summarize_bubble(per_stage))
            extras["pp_bubble_measured_steps"] = len(steps)
        return extras
