"""Run one step of a pipeline schedule over this rank's stage modules and return the loss.

The runner executes the :class:`~lightning_par.pipeline_parallel.schedules.Action` list of its rank in order:

* ``F`` (chunk ``c``, micro-batch ``i``): take the input (the micro-batch itself on virtual stage 0, else a blocking
  receive from the previous stage), run the chunk, and either send the output on (non-blocking) or, on the last
  stage, compute ``loss_fn(output, target_i)``. The input and output stay stashed until the backward.
* ``B``: on the last stage, backpropagate ``loss_i * loss_scale / m``; elsewhere receive the gradient of the output
  from the next stage and backpropagate it; then send the gradient of the input to the previous stage.

Parameter gradients accumulate in ``.grad`` over the ``m`` micro-batches, so after a step they equal the gradient of
``loss_scale * mean_i(loss_i)``: the mean loss of the whole batch when the micro-batches have equal size, i.e. what one
process computes on the whole batch. Each op is timed for the bubble accounting
(:mod:`lightning_par.pipeline_parallel.bubble`).

Only one tensor flows between stages (the hidden state, or any single tensor an ``nn.Sequential`` produces), and the
batch is one input tensor and one target tensor, split along dimension 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import ContextManager

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_par.pipeline_parallel.bubble import StepRecord, StepTimer
from lightning_par.pipeline_parallel.comm import StageComm
from lightning_par.pipeline_parallel.schedules import (
    Action,
    build_order,
    forward_only_order,
    stage_ids,
    validate_schedule,
)

__all__ = ["PipelineRunner", "split_microbatches"]


def split_microbatches(tensor: Tensor, num_microbatches: int, name: str = "batch") -> tuple[Tensor, ...]:
    """Split ``tensor`` along dimension 0 into ``num_microbatches`` equal micro-batches.

    Raises:
        ValueError: the batch size is not a multiple of ``num_microbatches`` (the message names both).
    """
    size = tensor.shape[0]
    if size % num_microbatches != 0:
        raise ValueError(
            f"{name} size {size} is not valid with num_microbatches={num_microbatches}: expected a batch size that is "
            f"a multiple of {num_microbatches} (equal micro-batches keep the loss equal to the whole batch's mean)."
        )
    return tensor.split(size // num_microbatches)


class PipelineRunner:
    """This rank's share of a pipeline: its chunks, its schedule and its links to the neighbouring stages.

    Args:
        chunks: the stage modules of this rank, chunk ``c`` being virtual stage ``c * pp_size + pp_rank``.
        pp_rank: this rank's index on the pp axis.
        pp_size: pipeline ranks.
        group: the pp process group (None: the default group).
        schedule: one of :data:`~lightning_par.pipeline_parallel.schedules.SCHEDULES`.
        num_microbatches: micro-batches per step.
        loss_fn: ``loss_fn(output, target) -> scalar`` (a mean over the micro-batch), called on the last stage.
        device: where received tensors go.
        forward_context: context manager factory entered around each forward (e.g. autocast); none by default.
        barrier: start each training step with a barrier over ``group`` so that the measured window is the step's
            own (stages that finished the previous step early do not count their wait as this step's bubble).

    Raises:
        ValueError: invalid schedule options, or ``len(chunks)`` differs from the schedule's chunks per rank.
    """

    def __init__(
        self,
        chunks: list[nn.Module],
        pp_rank: int,
        pp_size: int,
        group: dist.ProcessGroup | None,
        schedule: str,
        num_microbatches: int,
        loss_fn: Callable[[Tensor, Tensor], Tensor],
        device: torch.device | None = None,
        forward_context: Callable[[], ContextManager] | None = None,
        barrier: bool = True,
    ) -> None:
        interleaved = schedule == "interleaved_1f1b"
        virtual = validate_schedule(schedule, pp_size, num_microbatches, len(chunks) if interleaved else None)
        if len(chunks) != virtual:
            raise ValueError(f"schedule={schedule!r} runs {virtual} chunk(s) per rank but this rank has {len(chunks)}.")
        self.chunks = chunks
        self.pp_rank, self.pp_size, self.group = pp_rank, pp_size, group
        self.schedule, self.num_microbatches, self.virtual_stages = schedule, num_microbatches, virtual
        self.loss_fn = loss_fn
        self.stage_ids = stage_ids(pp_rank, pp_size, virtual)
        self.num_stages = pp_size * virtual
        self.comm = StageComm(group, pp_rank, pp_size, self.num_stages, device or torch.device("cpu"))
        self.forward_context = forward_context or contextlib.nullcontext
        self.barrier = barrier
        self.order: list[Action] = build_order(schedule, pp_rank, pp_size, num_microbatches, virtual)
        self.history: list[StepRecord] = []

    @property
    def has_last_stage(self) -> bool:
        """Whether this rank computes the loss."""
        return self.num_stages - 1 in self.stage_ids

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    # ------------------------------------------------------------------ training
    def train_step(self, inputs: Tensor, targets: Tensor, loss_scale: float = 1.0) -> Tensor | None:
        """Run the schedule's forwards and backwards over one batch; gradients accumulate into ``.grad``.

        Args:
            inputs: the batch's input ``(batch, ...)`` (token ids ``(batch, seq)`` for the GPT); every rank passes
                it (only the first stage reads it; the others use its shape to name the step's tensor shapes).
            targets: the batch's targets ``(batch, ...)``; read on the last stage.
            loss_scale: factor on the loss before backward (``1 / accumulate_grad_batches`` under accumulation).

        Returns:
            On the rank holding the last stage, the mean micro-batch loss (detached scalar); ``None`` elsewhere.

        Raises:
            ValueError: the batch size is not a multiple of ``num_microbatches``.
        """
        m = self.num_microbatches
        xs = split_microbatches(inputs, m, "batch")
        ys = split_microbatches(targets, m, "target batch")
        key = (tuple(xs[0].shape), xs[0].dtype)
        self.comm.num_microbatches = m
        if self.barrier and self.pp_size > 1:
            dist.barrier(group=self.group)
        timer = StepTimer()
        stash: dict[tuple[int, int], tuple[Tensor | None, Tensor]] = {}
        losses: list[Tensor] = []
        held = peak = 0
        for action in self.order:
            c, i = action.chunk, action.microbatch
            stage = self.stage_ids[c]
            if action.kind == "F":
                x = self._input(stage, c, i, xs, key, timer)
                with timer.op("F", c, i), self.forward_context():
                    out = self.chunks[c](x)
                    if stage == self.num_stages - 1:
                        out = self.loss_fn(out, ys[i])
                        losses.append(out.detach())
                if stage < self.num_stages - 1:
                    with timer.op("send", c, i):
                        self.comm.send_activation(out, stage, i, key)
                stash[(c, i)] = (x if stage > 0 else None, out)
                held += 1
                peak = max(peak, held)
            else:
                x, out = stash.pop((c, i))
                if stage == self.num_stages - 1:
                    grad = None
                    out = out * (loss_scale / m)
                else:
                    with timer.op("recv", c, i):
                        grad = self.comm.recv_grad(out, stage, i)
                with timer.op("B", c, i):
                    if out.requires_grad:
                        torch.autograd.backward(out, grad)
                if x is not None and x.is_floating_point():
                    with timer.op("send", c, i):
                        self.comm.send_grad(x.grad if x.grad is not None else torch.zeros_like(x), stage, i)
                held -= 1
        with timer.op("send_wait", -1, -1):
            self.comm.wait_sends()
        self.history.append(timer.finish(peak))
        return torch.stack(losses).mean() if losses else None

    def _input(self, stage: int, c: int, i: int, xs: tuple[Tensor, ...], key: tuple, timer: StepTimer) -> Tensor:
        if stage == 0:
            return xs[i]
        with timer.op("recv", c, i):
            x = self.comm.recv_activation(stage, i, key)
        return x.requires_grad_(x.is_floating_point() and torch.is_grad_enabled())

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def eval_step(self, inputs: Tensor, targets: Tensor, num_microbatches: int | None = None) -> Tensor | None:
        """Forward only (validation/test): every chunk on every micro-batch, then the mean loss on the last stage.

        Args:
            inputs, targets: as for :meth:`train_step`.
            num_microbatches: micro-batches for this batch (default: the training number). The result does not
                depend on it (equal micro-batches), so callers may pick a divisor of an odd-sized last batch.

        Returns:
            The mean loss on the rank holding the last stage; ``None`` elsewhere.
        """
        m = num_microbatches or self.num_microbatches
        xs = split_microbatches(inputs, m, "batch")
        ys = split_microbatches(targets, m, "target batch")
        key = (tuple(xs[0].shape), xs[0].dtype)
        self.comm.num_microbatches = m
        timer = StepTimer()
        losses = []
        for action in forward_only_order(m, self.virtual_stages):
            c, i = action.chunk, action.microbatch
            stage = self.stage_ids[c]
            x = self._input(stage, c, i, xs, key, timer)
            with self.forward_context():
                out = self.chunks[c](x)
            if stage == self.num_stages - 1:
                losses.append(self.loss_fn(out, ys[i]).float())
            else:
                self.comm.send_activation(out, stage, i, key)
        self.comm.wait_sends()
        return torch.stack(losses).mean() if losses else None
