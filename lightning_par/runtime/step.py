"""The step: one implementation for every host, on a :class:`~lightning_par.parallelize.ParallelModel`.

Each function takes the parallel model (``parallel``) and what only the host knows as arguments: the user's step
(``call``: a LightningModule's ``training_step``, or a loss function over the module's outputs), the host's
precision plugin, its backward. The Trainer adapter reaches these through the step hooks
(:class:`lightning_par.steps.StepHooks`: ``training_step`` -> :func:`forward`, ``backward`` -> :func:`backward`,
``eval_step`` -> :func:`evaluate`); the Fabric adapter through :func:`train_step` (which calls :func:`forward` and
:func:`backward` too) and the clipping functions. Hosts call them as attributes of this module (``step.forward``), so
replacing one here replaces it under both (``tests/runtime/test_one_step.py``).

The order within a step (torchtitan's ``forward_backward_step`` has the same): every axis's batch transform (cp: this
rank's piece of each sequence and its global positions), the forward and the loss inside the step contexts (the
aux-loss factor, the loss context of a tp ``vocab_head`` and of cp's attention, a packed block's document mask) and
through every axis's step wrapper (cp: the token mean over the cp ranks, each rank's gradient weighed by its counted
tokens), backward between the dp engine's pre- and post-backward hooks (the bucketed reduction overlaps it), then once
per optimizer step the gradient finishers (tp's partial sums) before clipping.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_par.aux_loss import aux_loss_scaled

__all__ = [
    "PIPELINED_STEP",
    "SPLIT_STEP",
    "backward",
    "check_loop",
    "check_positions",
    "clip_grad_norm_",
    "finishing",
    "clip_grad_value_",
    "document_attention",
    "evaluate",
    "forward",
    "global_mean",
    "optimizer_params",
    "point_optimizer",
    "refuse_pipelined_forward",
    "setup_optimizer",
    "step_inputs",
    "token_mean",
    "train_step",
]


def document_attention(parallel: Any, batch: Any) -> AbstractContextManager[None]:
    """A packed block's document masking (:mod:`lightning_par.data.doc_mask`) around a step on ``batch``, for any
    network through the contract (its attention reached unmasked through the network's
    ``context_parallel_attention``, a Hugging Face model's); a no-op for other batches."""
    from lightning_par.context_parallel.contract import context_parallel_attention
    from lightning_par.data.doc_mask import batch_document_ids
    from lightning_par.data.doc_mask import document_attention as attention

    documents = batch_document_ids(batch)
    if documents is None:
        return attention(None)
    return attention(documents, context_parallel_attention(parallel.network))


def forward(parallel: Any, call: Callable[[Any], Any], batch: Any, loss_scale: float = 1.0) -> Any:
    """One training step's forward and loss: ``call(batch)`` (the user's step on this rank's prepared ``batch``) with
    the auxiliary losses under ``loss_scale`` (the factor the loss is multiplied by before backward), in the loss
    context and a packed block's document mask, through every axis's step wrapper. Returns what ``call`` returns,
    as the wrappers leave it (cp: the token mean over the cp ranks)."""
    with aux_loss_scaled(loss_scale), parallel.loss_context(), document_attention(parallel, batch):
        return parallel.run_step(call, batch)


def evaluate(parallel: Any, call: Callable[[Any], Any], batch: Any) -> Any:
    """A validation, test or predict step: ``call(batch)`` on this rank's prepared ``batch``, in the loss context and
    a packed block's document mask, through every axis's step wrapper."""
    with parallel.loss_context(), document_attention(parallel, batch):
        return parallel.run_step(call, batch)


def backward(parallel: Any, run: Callable[[], None], after: Callable[[Any], Any]) -> Any:
    """``run()`` (the host's backward of the loss: its precision plugin's) between the dp engine's hooks, in the loss
    context; then ``after(stats)`` with the communication left exposed after backward (``None`` inside an
    accumulation window), still in the loss context (a host's ``on_after_backward`` then sees gradients reduced over
    dp, as under torch DDP). Returns what ``after`` returns."""
    engine = parallel.engine
    with parallel.loss_context():
        engine.pre_backward()
        run()
        return after(engine.post_backward())


def setup_optimizer(parallel: Any, optimizer: Any) -> None:
    """Shard ``optimizer``'s state over dp (ZeRO's) and run every axis's optimizer-step hooks after each of its steps
    (:meth:`~lightning_par.parallelize.ParallelModel.after_optimizer_step`: the MoE routers' bias update, float8's
    scales), after the engine's own post-hook (ZeRO's all-gather of the shards), also for a loop's own
    ``optimizer.step()``."""
    parallel.engine.shard_optimizer(optimizer)
    if parallel.has_optimizer_step_hooks:
        optimizer.register_step_post_hook(lambda *_: parallel.after_optimizer_step())


def optimizer_params(optimizer: Any) -> list[Tensor]:
    """Every parameter of ``optimizer`` (a host's wrapper is looked through: ``.optimizer``)."""
    optimizer = getattr(optimizer, "optimizer", optimizer)
    return [p for g in optimizer.param_groups for p in g["params"]]


def clip_grad_norm_(parallel: Any, optimizer: Any, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> Tensor:
    """Clip ``optimizer``'s gradients by the whole model's norm (every dp and tp shard, every stage:
    :meth:`~lightning_par.parallelize.ParallelModel.clip_grad_norm_`); returns the norm before clipping.

    Raises:
        RuntimeError: the norm is not finite and ``error_if_nonfinite``.
    """
    norm = parallel.clip_grad_norm_(optimizer_params(optimizer), float(max_norm), float(norm_type))
    if error_if_nonfinite and not torch.isfinite(norm).all():
        raise RuntimeError(
            f"The total norm of order {float(norm_type)} of the gradients is non-finite ({float(norm):g}): "
            f"nothing was clipped. Pass error_if_nonfinite=False to clip anyway."
        )
    return norm


def clip_grad_value_(parallel: Any, optimizer: Any, clip_value: float) -> None:
    """Clamp every gradient of ``optimizer`` to ``[-clip_value, clip_value]`` on each rank's shard (exactly the one
    process's clamp: :meth:`~lightning_par.parallelize.ParallelModel.clip_grad_value_`)."""
    parallel.clip_grad_value_(optimizer_params(optimizer), float(clip_value))


def finishing(parallel: Any, closure: Callable[[], Any]) -> Callable[[], Any]:
    """``closure`` (a host's optimizer closure: the step's last backward and its dp reduction), then the parallel
    model's gradient finishers (tp: replicated parameters' partial gradients summed), once per optimizer step."""

    def run() -> Any:
        out = closure()
        parallel.finish_gradients()
        return out

    return run


def global_mean(parallel: Any, local: Tensor, tokens: Tensor) -> Tensor:
    """``sum_r(L_r n_r) / sum_r(n_r)`` over the ranks holding other tokens of the global batch (the derived mesh
    ``dp_cp``; the tp and pp ranks of a replica hold the same): the global batch's token mean, on every rank.
    Collective over that mesh when it has more than one rank: one all-reduce of two numbers on the root device;
    ``tokens`` (this rank's counted tokens, a 0-dim tensor on the root device, from
    :func:`~lightning_par.contract.batch_counted_tokens_tensor`) and the result are never read to the host
    (``docs/host-syncs.md``); 0 where no rank counted a token."""
    value = local.detach().float().reshape(())
    mesh = parallel.dims.get_mesh("dp_cp")
    if mesh.size() == 1:
        return value
    n = tokens.detach().to(device=value.device, dtype=value.dtype).reshape(())
    # a rank that counted no token contributes 0 (its own mean is 0/0, NaN); the products in float32, the sums
    # in float64, as before the count stayed on the device
    both = torch.stack([torch.where(n > 0, value * n, torch.zeros_like(value)), n]).to(torch.float64)
    dist.all_reduce(both, group=mesh.get_group())
    return torch.where(both[1] > 0, both[0] / both[1], torch.zeros_like(both[1])).float()


def token_mean(parallel: Any, loss_sum: Tensor, tokens: Tensor | float, device: torch.device) -> Tensor:
    """``loss_sum * dp_size / N`` where ``N`` is ``tokens`` summed over the dp ranks: averaged over dp, one process's
    gradient of the global batch's token mean whatever the label mask; ``loss_sum * 0`` (NaN taken as 0) where no dp
    rank counted a token. Collective over the dp group when ``dp_size > 1`` (one all-reduce of one number on
    ``device``); the count is never read to the host (``docs/host-syncs.md``).

    Raises:
        RuntimeError: an axis splits the batch (cp): :func:`train_step` makes and differentiates the token mean there.
    """
    from lightning_par.data_parallel.token_mean import replicated_like

    dims = parallel.dims
    if parallel._batch_transforms:
        raise RuntimeError(
            f"token_mean_loss is for a loop of model(x) and fabric.backward, which this layout "
            f"({ {k: v for k, v in dims.sizes().items() if v > 1} }, context parallelism) does not run: "
            f"train_step(model, (x, y), loss_fn=loss_fn) already returns and differentiates the token mean."
        )
    count = torch.as_tensor(tokens, dtype=torch.float64, device=device).detach().reshape(()).clone()
    if dims.dp_size > 1:
        dist.all_reduce(count, group=dims.group("dp"))
    counted = count > 0
    # dp_size / N in float64 (as a Python float was), then in the loss's dtype; 0 where nothing was counted
    scale = torch.where(counted, dims.dp_size / count, torch.zeros_like(count)).to(loss_sum.dtype)
    scale, counted = replicated_like(scale, loss_sum), replicated_like(counted, loss_sum)
    return torch.where(counted, loss_sum * scale, loss_sum.nan_to_num(0.0) * 0.0)


#: Why a loop's ``model(x)`` and backward have no place under pipelining (the message of a ``RuntimeError``).
PIPELINED_STEP = (
    "under pipelining (pp_size > 1) the schedule runs forward and backward itself, micro-batch by micro-batch: "
    "replace `loss = loss_fn(model(x), y); fabric.backward(loss)` by `loss = lightning_par.fabric.train_step(model, "
    "batch)` (the model's loss_fn makes each micro-batch's loss; inside fabric.no_backward_sync for accumulation, "
    "with loss_scale=1/accumulate), then fabric.clip_gradients / optimizer.step() as usual."
)

#: Why a loop's training ``model(x)`` and backward have no place under cp (``{layout}``: the sizes above 1).
SPLIT_STEP = (
    "under context parallelism (this layout: {layout}) each rank holds a piece of every sequence, inputs and targets "
    "alike, so the step is one call: replace `loss = loss_fn(model(x), y); fabric.backward(loss)` by `loss = "
    "lightning_par.fabric.train_step(model, (x, y), loss_fn=loss_fn)` (it splits the batch, passes position_ids to "
    "the model, returns the global batch's token mean; loss_scale=1/accumulate inside fabric.no_backward_sync), "
    "then fabric.clip_gradients / optimizer.step() as usual. Evaluation (model(x) under torch.no_grad() or "
    "model.eval()) runs on whole sequences."
)


def refuse_pipelined_forward(module: nn.Module, args: Any) -> None:
    """A forward pre-hook under pipelining, for a loop that would call the module itself."""
    raise RuntimeError(
        f"{type(module).__name__}(...) was called: {PIPELINED_STEP} Evaluation is not supported in a Fabric loop "
        f"under pipelining (this rank holds only its stages): evaluate with the Trainer, or load the checkpoint into "
        f"one process (lightning_par.checkpoint.load_model_weights)."
    )


def check_loop(parallel: Any) -> None:
    """What a loop that calls the module itself (Fabric's) can run: not cp inside a pipeline schedule; under cp, a
    module :func:`train_step` can hand the positions to (:func:`check_positions`).

    Raises:
        ValueError: naming the layout and what would run.
    """
    if parallel.has_batch_transforms and parallel.pipeline is not None:
        sizes = {k: v for k, v in parallel.dims.sizes().items() if v > 1}
        raise ValueError(
            f"this layout ({sizes}) splits every sequence over ranks (context parallelism) inside a pipeline "
            f"schedule, which lightning_par.fabric.train_step does not run: use the Trainer for it, or a layout "
            f"without one of the two (either alone runs through train_step)."
        )
    if parallel.has_batch_transforms:
        check_positions(parallel.module)


def point_optimizer(parallel: Any, optimizer: Any, names: dict[int, str]) -> None:
    """Point ``optimizer``, built over the plain module's parameters (``names``: their ids -> their names) or over
    the parallel ones, at the parallel parameters, by name; another pipeline stage's parameters are dropped.

    Raises:
        ValueError: the optimizer stepped already, or holds a parameter that is not the module's.
    """
    params = dict(parallel.module.named_parameters())
    live = {id(p) for p in params.values()}
    for group in optimizer.param_groups:
        new = []
        for p in group["params"]:
            if id(p) in live:
                new.append(p)
            elif id(p) in names and names[id(p)] in params:
                if optimizer.state.get(p):
                    raise ValueError(
                        "optimizer has state already (it stepped before fabric.setup): build it fresh, or set up the "
                        "model first and build the optimizer over model.parameters()."
                    )
                new.append(params[names[id(p)]])
            elif id(p) in names and parallel.pipeline is not None:
                continue  # another pipeline stage's parameter: that stage's rank steps it
            else:
                raise ValueError(
                    f"optimizer holds a parameter of shape {tuple(p.shape)} that is not one of the model's: build "
                    f"the optimizer over the model given to fabric.setup."
                )
        group["params"] = new


def check_positions(module: nn.Module) -> None:
    """Under cp, :func:`train_step` passes the kept tokens' global positions as ``position_ids=`` to the module's
    forward, unless the module maps the batch itself (``pipeline_batch``).

    Raises:
        ValueError: neither is there.
    """
    if callable(getattr(module, "pipeline_batch", None)):
        return
    if "position_ids" not in inspect.signature(module.forward).parameters:
        raise ValueError(
            f"context parallelism in a Fabric loop is not valid for {type(module).__name__}: train_step passes each "
            f"rank's global token positions as position_ids=, and its forward takes no position_ids. Add a "
            f"position_ids argument to forward (hand it to the network), or define pipeline_batch(batch) -> "
            f"(inputs, targets) on it (the batch then ends with the positions, (seq / ranks,))."
        )


def step_inputs(module: nn.Module, batch: Any, split: bool) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """``(args, kwargs, targets)`` of one step's ``batch`` (this rank's, after the batch transforms): through the
    module's ``pipeline_batch`` when defined; else ``batch`` is ``(inputs, targets)`` (under cp with the positions
    the split appended, passed as ``position_ids=``).

    Raises:
        ValueError: a batch of another structure and no ``pipeline_batch``.
    """
    from lightning_par import contract

    if callable(getattr(module, "pipeline_batch", None)):
        inputs, targets = contract.pipeline_batch(module, batch)
        return inputs, {}, targets
    kwargs: dict[str, Any] = {}
    if split and isinstance(batch, (tuple, list)) and len(batch) == 3:
        *batch, kwargs["position_ids"] = batch
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        inputs, targets = batch
        if isinstance(inputs, Tensor):
            return (inputs,), kwargs, targets
        if isinstance(inputs, (tuple, list)) and all(isinstance(t, Tensor) for t in inputs):
            return tuple(inputs), kwargs, targets
    raise ValueError(
        f"train_step(model, batch): a batch of type {type(batch).__name__} is not valid: expected (inputs, targets), "
        f"inputs a tensor or a tuple of tensors. Define {type(module).__name__}.pipeline_batch(batch) -> (inputs, "
        f"targets) to map another structure."
    )


def train_step(
    parallel: Any,
    batch: Any,
    *,
    precision: Any,
    run_backward: Callable[[Tensor], None],
    device: torch.device,
    sync: bool,
    loss_scale: float = 1.0,
    loss_fn: Any = None,
) -> Tensor:
    """One forward and backward over ``batch`` for a loop that gives the batch and a loss function (Fabric's:
    :func:`lightning_par.fabric.train_step` documents the arguments): the pipeline schedule under ``pp_size > 1``,
    else ``loss_fn(module(*inputs), targets)`` in ``precision`` (a Fabric precision plugin: ``convert_input``,
    ``forward_context``, ``convert_output``) through :func:`forward`, then ``run_backward(loss * loss_scale)`` (the
    host's backward, which goes through :func:`backward`). ``sync``: the end of an accumulation window (a pipeline's
    dp reduction runs then). Returns the global batch's token mean (:func:`global_mean`), unscaled.

    Raises:
        ValueError: no loss function, or one under pipelining; a loss that is not a scalar with a gradient; a batch
            :func:`step_inputs` cannot read.
    """
    from lightning_par import contract

    module = parallel.module
    if parallel.pipeline is not None:
        if loss_fn is not None:
            raise ValueError(
                f"train_step(..., loss_fn={getattr(loss_fn, '__name__', type(loss_fn).__name__)}) is not valid under "
                f"pipelining (pp_size={parallel.dims.pp_size}): the schedule's loss is the model's loss_fn (or "
                f"pipeline_loss), fixed at fabric.setup; define it on {type(module).__name__} and pass no loss_fn."
            )
        prepared = parallel.prepare_batch(batch)
        inputs, targets = contract.pipeline_batch(module, prepared)
        for m in parallel.stage_modules:
            m.train(module.training)
        with parallel.engine.defer_sync():
            loss = parallel.pipeline.train_step(inputs, targets, loss_scale=float(loss_scale))
        for after in parallel.after_schedule:  # e.g. tp's partial gradients, deferred out of the schedule
            after()
        loss = parallel.steps.share_loss(loss, device)
        if sync:  # the end of an accumulation window: one dp reduction of what accumulated
            parallel.engine.reduce_now()
        # the replica's token mean (the schedule weighs its micro-batches by their counted tokens) -> the global one
        return global_mean(parallel, loss, contract.batch_counted_tokens_tensor(module, prepared, device))
    if loss_fn is None:
        loss_fn = next((m for m in (getattr(module, n, None) for n in ("pipeline_loss", "loss_fn")) if callable(m)),
                       None)
    if not callable(loss_fn):
        raise ValueError(
            f"train_step(model, batch) needs the loss: pass loss_fn=(outputs, targets) -> the batch's mean loss, "
            f"or define loss_fn(outputs, targets) on {type(module).__name__}; got loss_fn={loss_fn!r}."
        )
    own: list[Tensor] = []  # this rank's loss, before the step wrappers
    split = bool(parallel._batch_transforms)

    def call(piece: Any) -> Any:
        args, kwargs, targets = step_inputs(module, piece, split=split)
        args, kwargs = precision.convert_input((args, kwargs))
        with precision.forward_context():
            outputs = module(*args, **kwargs)
        loss = loss_fn(precision.convert_output(outputs), targets)
        own.append(loss)
        return loss

    prepared = parallel.transform_batch(batch)  # the buffer broadcast runs in the module's forward pre-hook
    loss = forward(parallel, call, prepared, float(loss_scale))
    if not (isinstance(loss, Tensor) and loss.numel() == 1 and loss.requires_grad):
        raise ValueError(
            f"loss_fn(outputs, targets) must return a scalar tensor with a gradient; got "
            f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, Tensor) else ''}."
        )
    run_backward(loss * loss_scale if loss_scale != 1.0 else loss)
    return global_mean(parallel, own[-1] if own else loss,
                       contract.batch_counted_tokens_tensor(module, prepared, device))
