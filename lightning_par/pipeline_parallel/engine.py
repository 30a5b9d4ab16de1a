"""This rank's share of a pipeline, run by ``torch.distributed.pipelining`` (``PipelineStage`` + torch's schedules).

What torch does: the schedule (GPipe, 1F1B, interleaved 1F1B, interleaved zero-bubble, ZB-V, DualPipeV), the
point-to-point transfers between stages, tensor-shape inference, and FSDP2's per-micro-batch gradient handling.
What this module adds, where torch stops:

* **Loss and targets of any structure.** torch splits ``target`` along dim 0 and calls ``loss_fn(output, target)``;
  here the schedule's target is the micro-batch index (``torch.arange(m)``) and the loss wrapper looks the user's
  targets up (any tensor, tuple, list or dict, split along dim 0), scales the loss by ``loss_scale / m`` (so the
  accumulated gradients are those of the batch mean; ``scale_grads=False``) and keeps the unscaled value for logging.
* **Token-mean losses of unequal micro-batches.** With integer targets, each micro-batch's loss (a mean over its
  counted tokens, :func:`~lightning_par.contract.counted_tokens`: targets of ``-100`` are not counted) is weighed by
  its share of the batch's counted tokens (over ``token_groups`` too: the ranks holding other pieces of the same
  sequences, cp, and the other samples of the global batch, dp), so that the loss and its gradients are those of the
  whole batch's token mean, as in one process. Equal counts (no label mask) give every micro-batch the weight 1.
  torch's schedules weigh every micro-batch alike: with an answer-only label mask the mean of micro-batch means
  differs from the batch's token mean.
* **Shapes that change.** A ``PipelineStage`` infers its tensor shapes on its first step; each distinct micro-batch
  input shape (and training vs evaluation) gets its own stage objects and schedule, built on first use.
* **Evaluation.** Forward only, then the loss of the whole batch from the merged outputs on the last stage (exact,
  whatever the micro-batch split). torch 2.13's ZB-V and DualPipeV schedules cannot run forward only ("can't
  steal_bwd_input if this stage doesn't have backward", measured), so multi-stage ranks evaluate with torch's own
  runtime (private, :func:`~lightning_par.compat.forward_only_schedule`) over a forward-only action list, chunk by
  chunk.
* **Measured bubble.** Every compute call the schedule makes on a stage (``forward_one_chunk``, ``backward_one_chunk``,
  ``backward_weight_one_chunk``) is timed (:mod:`~lightning_par.pipeline_parallel.bubble`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any, ContextManager

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_par import contract
from lightning_par.aux_loss import aux_loss_scaled
from lightning_par.compat import (
    forward_only_schedule,
    keep_buffers_through_metadata_inference,
    pipeline_stage_meta,
    stage_to_rank_mapping,
    tree_map_only,
)
from lightning_par.pipeline_parallel.bubble import StepRecord, StepTimer
from lightning_par.pipeline_parallel.options import PipelineOptions

__all__ = ["PipelineEngine", "split_tree"]


def split_tree(value: Any, num_microbatches: int, name: str = "targets") -> list[Any]:
    """``value`` (a tensor, or a tuple / list / dict of them, nested) split along dim 0 into equal micro-batches.

    Raises:
        ValueError: a tensor's dim 0 is not a multiple of ``num_microbatches``, or a leaf is not a tensor.
    """
    if isinstance(value, Tensor):
        if value.dim() == 0 or value.shape[0] % num_microbatches:
            raise ValueError(
                f"{name} of shape {tuple(value.shape)} is not valid with num_microbatches={num_microbatches}: expected "
                f"a batch dim 0 that is a multiple of {num_microbatches}."
            )
        return list(value.tensor_split(num_microbatches))
    if isinstance(value, (tuple, list)):
        parts = [split_tree(v, num_microbatches, name) for v in value]
        return [type(value)(p[i] for p in parts) for i in range(num_microbatches)]
    if isinstance(value, dict):
        parts_d = {k: split_tree(v, num_microbatches, name) for k, v in value.items()}
        return [{k: p[i] for k, p in parts_d.items()} for i in range(num_microbatches)]
    raise ValueError(f"{name} of type {type(value).__name__} is not valid: expected tensors, tuples, lists or dicts.")


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous.

    torch 2.13's ``PipelineStage`` allocates its receive buffers from the inferred metadata, strides included: the
    gradient of a stage input that feeds ``torch.cat`` is a strided slice, and gloo's ``irecv`` then refuses the
    non-contiguous buffer ("input tensor has to be contiguous", measured with a stage passing ``(h, s)`` into a
    ``cat``). Routing each received input through this keeps every gradient that crosses stages contiguous.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


def _contiguous_input_grads(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(_ContiguousGrad.apply(a) if isinstance(a, Tensor) and a.requires_grad else a for a in args)


def _plain(loss: Tensor) -> Tensor:
    """The vocab-parallel loss is a replicated DTensor: its local value is the whole loss (``to_local`` keeps the
    graph to the sharded logits)."""
    return loss.to_local() if isinstance(loss, DTensor) else loss


class PipelineEngine:
    """Runs this rank's stage modules under a torch schedule, one Lightning batch at a time.

    Args:
        modules: this rank's stage modules, in chunk order (virtual stage ``stage_ids[c]`` for ``modules[c]``).
        stage_ids: the virtual stages they run (see :meth:`PipelineOptions.stage_ids`).
        options: the pipeline options.
        pp_group: the pp process group.
        pp_size: ranks in the pp group.
        device: where stage tensors live.
        loss_fn: ``loss_fn(last stage outputs, targets of one micro-batch) -> scalar mean loss``.
        step_context: entered around every schedule run (autocast, the vocab-parallel loss context, ...).
        token_groups: process groups whose ranks (all holding the last stage when this rank does) hold other tokens
            of the same batch (cp, dp); the counted tokens are summed over them for the micro-batch weights.
        token_mean: ``False`` when the loss is no mean over counted tokens (the module's ``token_mean_loss = False``):
            every micro-batch then weighs the same.

    Raises:
        ValueError: ``len(modules)`` differs from ``len(stage_ids)``.
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        stage_ids: Sequence[int],
        options: PipelineOptions,
        pp_group: dist.ProcessGroup,
        pp_size: int,
        device: torch.device,
        loss_fn: Callable[[Any, Any], Tensor],
        step_context: Callable[[], ContextManager] | None = None,
        token_groups: Sequence[dist.ProcessGroup] = (),
        token_mean: bool = True,
    ) -> None:
        if len(modules) != len(stage_ids):
            raise ValueError(f"{len(modules)} stage modules for {len(stage_ids)} stage ids {list(stage_ids)}.")
        for module, sid in zip(modules, stage_ids):
            if sid > 0:
                module.register_forward_pre_hook(_contiguous_input_grads)
        self.modules = list(modules)
        self.stage_ids = list(stage_ids)
        self.options = options
        self.pp_group = pp_group
        self.pp_size = pp_size
        self.device = device
        self.loss_fn = loss_fn
        self.step_context = step_context or contextlib.nullcontext
        self.token_groups = list(token_groups)
        self.token_mean = token_mean
        #: per micro-batch: the factor on its loss for the gradient, and for the logged mean (see :meth:`_weights`)
        self.grad_weights: Tensor = torch.ones(0)  # (m,) float64 on the device, set by train_step on the last stage
        self.log_weights: Tensor = torch.ones(0)
        self.num_stages = options.num_stages(pp_size)
        self.history: list[StepRecord] = []
        self._schedules: dict[tuple, Any] = {}
        self._timer: StepTimer | None = None
        self._targets: list[Any] = []
        self._scale = 1.0
        self._losses: list[Tensor] = []
        self._forwarded: set[int] = set()
        self._built: list[Any] = []
        #: ``observer(i, outputs)``: called on the last stage with each real micro-batch's outputs (detached), after
        #: its loss (the LightningModule's own ``training_step`` runs there for what it logs).
        self.observer: Callable[[int, Any], None] | None = None
        #: packed documents (:mod:`lightning_par.data.doc_mask`): per micro-batch, its ``(micro_batch, seq)`` document
        #: ids; each stage's forward (and backward, which may recompute it) of micro-batch ``i`` runs with them, so the
        #: ids travel with the micro-batch through every stage. ``None``: no document masking.
        self.documents: list[Tensor] | None = None
        #: the network's context for reaching ``scaled_dot_product_attention`` unmasked (a Hugging Face model's)
        self.document_context: Callable[[], Any] | None = None

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last_stage(self) -> bool:
        """Whether this rank computes the loss."""
        return self.num_stages - 1 in self.stage_ids

    # ------------------------------------------------------------------ schedules
    def _stages(self) -> list[Any]:
        from torch.distributed.pipelining import PipelineStage

        stages = []
        for module, sid in zip(self.modules, self.stage_ids):
            stage = PipelineStage(module, sid, self.num_stages, self.device, group=self.pp_group)
            keep_buffers_through_metadata_inference(stage)  # its extra forward would count in BatchNorm statistics
            self._instrument(stage)
            stages.append(stage)
        self._built.extend(stages)
        return stages

    def sent_dtypes(self) -> list[str]:
        """Dtypes of the activations this rank's stages send to the next stage (as torch inferred them on the first
        step of each schedule; private ``PipelineStage`` metadata), e.g. ``["torch.bfloat16"]``."""
        dtypes: set[str] = set()
        for stage in self._built:
            meta = getattr(pipeline_stage_meta(stage), "outputs", None)
            if stage.stage_index < self.num_stages - 1 and meta:
                dtypes.update(str(t.dtype) for t in meta if getattr(t, "dtype", None) is not None)  # TensorMeta
        return sorted(dtypes)

    def _instrument(self, stage: Any) -> None:
        """Time every compute call the schedule makes on ``stage`` (instance attributes shadow the methods)."""
        sid = stage.stage_index

        def timed(method: Callable, kind_of: Callable[..., str]) -> Callable:
            @functools.wraps(method)
            def run(chunk_id: int, *args: Any, **kwargs: Any) -> Any:
                kind = kind_of(*args, **kwargs)
                if kind == "F" and sid == self.num_stages - 1:
                    self._forwarded.add(chunk_id)
                with contextlib.ExitStack() as stack:
                    if self.documents is not None and 0 <= chunk_id < len(self.documents):
                        from lightning_par.data.doc_mask import document_attention

                        stack.enter_context(document_attention(self.documents[chunk_id], self.document_context))
                    if self._timer is None:
                        return method(chunk_id, *args, **kwargs)
                    with self._timer.op(kind, sid, chunk_id):
                        return method(chunk_id, *args, **kwargs)

            return run

        stage.forward_one_chunk = timed(stage.forward_one_chunk, lambda *a, **k: "F")
        stage.backward_one_chunk = timed(
            stage.backward_one_chunk, lambda *a, full_backward=True, **k: "B" if full_backward else "I"
        )
        stage.backward_weight_one_chunk = timed(stage.backward_weight_one_chunk, lambda *a, **k: "W")

    def _train_schedule(self, key: tuple) -> Any:
        schedule = self._schedules.get(("train", key))
        if schedule is None:
            import torch.distributed.pipelining.schedules as schedules

            cls = getattr(schedules, self.options.spec.torch_class)
            stages = self._stages()
            schedule = cls(
                stages if len(stages) > 1 else stages[0],
                n_microbatches=self.options.num_microbatches,
                loss_fn=self._microbatch_loss,
                scale_grads=False,  # the loss wrapper scales by loss_scale / m
            )
            self._schedules[("train", key)] = schedule
        return schedule

    def _eval_schedule(self, key: tuple, num_microbatches: int) -> Any:
        schedule = self._schedules.get(("eval", key, num_microbatches))
        if schedule is None:
            stages = self._stages()
            if len(stages) == 1:
                from torch.distributed.pipelining import ScheduleGPipe

                # scale_grads=False: torch's default divides whatever .grad holds by m at the end of the step, which
                # would corrupt gradients accumulated before a validation inside an accumulation window.
                schedule = ScheduleGPipe(stages[0], n_microbatches=num_microbatches, loss_fn=None, scale_grads=False)
            else:
                schedule = _forward_only_multi(stages, num_microbatches, self.options, self.pp_size)
            self._schedules[("eval", key, num_microbatches)] = schedule
        return schedule

    def _microbatch_loss(self, outputs: Any, index: Tensor) -> Tensor:
        i = int(index.reshape(-1)[0])
        if index.numel() != 1 or i not in self._forwarded:
            # torch's metadata inference (first step of each schedule) runs the loss on placeholder outputs with the
            # whole target: let it infer the gradient's metadata, but it is no micro-batch of this step.
            return _plain(self.loss_fn(outputs, self._targets[0]))
        self._forwarded.discard(i)
        with self._timer.op("L", self.num_stages - 1, i) if self._timer is not None else contextlib.nullcontext():
            loss = _plain(self.loss_fn(outputs, self._targets[i]))
            # a micro-batch without a counted token has the mean 0/0 (NaN), the weight 0 and a zero gradient
            log_w, grad_w = self.log_weights[i].to(loss.dtype), self.grad_weights[i].to(loss.dtype)
            loss = torch.where((log_w == 0) | (grad_w == 0), loss.nan_to_num(0.0), loss)
            self._losses.append(loss.detach() * log_w)
        if self.observer is not None:
            self.observer(i, tree_map_only(Tensor, lambda t: t.detach(), outputs))
        return loss * (grad_w * self._scale)

    def _weights(self, m: int) -> tuple[Tensor, Tensor]:
        """``(gradient weights, logging weights)`` of the ``m`` micro-batches, on the last stage: two ``(m,)`` float64
        tensors on this stage's device, never read to the host.

        With ``n_i`` the counted tokens of micro-batch ``i``, ``n`` their sum on this rank, ``N`` the sum over this
        rank and its ``token_groups`` (``R`` ranks): the gradient weight is ``n_i m R / N`` (the dp axis then averages
        over the ``R`` ranks: the gradient of the token mean over all ``N`` tokens), the logging weight ``n_i m / n``
        (the mean over this rank's tokens; the cp axis's report weighs the ranks). Both are 1 when the targets are not
        integer tensors, or when nothing is counted. Collective over ``token_groups`` (one all-reduce of one number
        each, on this stage's device).
        """
        counts = [contract.counted_tokens_tensor(t) for t in self._targets]
        ones = torch.ones(m, dtype=torch.float64, device=self.device)
        if not self.token_mean or len(counts) != m or any(c is None for c in counts):
            return ones, ones
        n = torch.stack(counts).to(self.device)  # type: ignore[arg-type]
        local = n.sum()
        summed, ranks = local.reshape(1).clone(), 1
        for group in self.token_groups:
            dist.all_reduce(summed, group=group)
            ranks *= dist.get_world_size(group)
        total = summed[0]
        grad = torch.where(total > 0, n * (m * ranks) / total, ones)
        log = torch.where(local > 0, n * m / local, ones)
        return grad, log

    # ------------------------------------------------------------------ steps
    def train_step(self, inputs: tuple[Tensor, ...], targets: Any, loss_scale: float = 1.0) -> Tensor | None:
        """Run the schedule's forwards and backwards over one batch; gradients accumulate into ``.grad``.

        Args:
            inputs: the first stage's inputs, each ``(batch, ...)``; every rank passes them (the key of the tensor
                shapes), only the first stage reads them.
            targets: the batch's targets (tensors split along dim 0); read on the last stage.
            loss_scale: factor on the loss before backward (``1 / accumulate_grad_batches`` under accumulation).

        Returns:
            On the rank holding the last stage, the mean micro-batch loss (detached scalar); ``None`` elsewhere.

        Raises:
            ValueError: the batch size is not a multiple of ``num_microbatches``.
        """
        m = self.options.num_microbatches
        split_tree(inputs, m, "the batch")  # checks divisibility before any rank enters the schedule
        self._targets = split_tree(targets, m) if self.has_last_stage else []
        self.grad_weights, self.log_weights = self._weights(m) if self.has_last_stage else (torch.ones(0), torch.ones(0))
        self._scale = loss_scale / m
        self._losses = []
        self._forwarded = set()
        schedule = self._train_schedule(_shape_key(inputs))
        if self.options.measure_bubble and self.pp_size > 1:
            dist.barrier(group=self.pp_group)
        self._timer = StepTimer()
        try:
            # a MoE router's losses get the micro-batch loss's factor
            with self.step_context(), aux_loss_scaled(self._scale):
                args = inputs if self.has_first_stage else ()
                # the micro-batch indices stay on the host: their one use is int() in _microbatch_loss (on the device
                # that read was a synchronisation per micro-batch), and torch's schedule only splits them
                target = torch.arange(m, device="cpu") if self.has_last_stage else None
                schedule.step(*args, target=target, losses=[], return_outputs=False)
        finally:
            self.history.append(self._timer.finish())
            self._timer = None
        return torch.stack(self._losses).mean() if self._losses else None

    @torch.no_grad()
    def eval_step(self, inputs: tuple[Tensor, ...], targets: Any) -> Tensor | None:
        """Forward only (validation/test) and the loss of the whole batch on the last stage.

        The batch is split into the largest number of equal micro-batches up to ``num_microbatches`` (the result does
        not depend on it).

        Returns:
            The batch loss (detached scalar) on the rank holding the last stage; ``None`` elsewhere.
        """
        with self.step_context():
            outputs = self.eval_outputs(inputs)
            if not self.has_last_stage:
                return None
            return _plain(self.loss_fn(outputs, targets)).detach()

    def eval_microbatches(self, inputs: tuple[Tensor, ...]) -> int:
        """The micro-batches :meth:`eval_outputs` splits ``inputs`` into: the largest divisor of the batch size up to
        ``num_microbatches``."""
        size = inputs[0].shape[0]
        return max(d for d in range(1, min(self.options.num_microbatches, size) + 1) if size % d == 0)

    @torch.no_grad()
    def eval_outputs(self, inputs: tuple[Tensor, ...]) -> Any:
        """Forward only: the last stage's outputs of the whole batch (its micro-batches' outputs concatenated along
        dim 0) on the rank holding the last stage, ``None`` elsewhere. Run it inside :attr:`step_context`.

        The batch is split into the largest number of equal micro-batches up to ``num_microbatches`` (the result does
        not depend on it).
        """
        m = self.eval_microbatches(inputs)
        schedule = self._eval_schedule(_shape_key(inputs), m)
        outputs = schedule.step(*(inputs if self.has_first_stage else ()))
        return outputs if self.has_last_stage else None


def _shape_key(inputs: tuple[Tensor, ...]) -> tuple:
    return tuple((tuple(t.shape), t.dtype) for t in inputs)


def _forward_only_multi(stages: list[Any], num_microbatches: int, options: PipelineOptions, pp_size: int) -> Any:
    """A forward-only schedule for a rank with several stages: each stage's forwards in turn, on torch's runtime.

    Private torch API (:func:`~lightning_par.compat.forward_only_schedule`): the V schedules of torch 2.13 refuse to
    run forward only, and no public multi-stage schedule takes the V placement.
    """
    style = "v" if options.spec.placement == "v" else "loop"
    mapping = stage_to_rank_mapping(pp_size, options.num_stages(pp_size), style=style)
    return forward_only_schedule(stages, num_microbatches, mapping)
