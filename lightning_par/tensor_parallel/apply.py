"""Apply a tensor-parallel plan to a module on the tp sub-mesh (the entry point strategies call)."""

from __future__ import annotations

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from lightning_par.parallel_dims import broadcast_from_rank0
from lightning_par.tensor_parallel.plan import Plan, resolve_style, validate_plan

__all__ = ["apply_tensor_parallel", "broadcast_from_tp_rank0", "reduce_partial_grads", "reduce_partial_grads_eagerly"]


#: Every tp rank gets tp rank 0's parameters and buffers (plain tensors, before they are sharded), so each can cut its
#: shard locally and the replicated styles (which wrap local tensors) agree.
broadcast_from_tp_rank0 = broadcast_from_rank0


def _reduce_partial_grad(param: Tensor) -> None:
    grad = param.grad
    if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
        param.grad = grad.redistribute(placements=param.placements)


def reduce_partial_grads(module: nn.Module) -> None:
    """Sum every ``Partial`` gradient of a replicated parameter of ``module`` over the tp ranks now, in parameter order
    (the deferred form of :func:`reduce_partial_grads_eagerly`, for a pipeline schedule: see ``apply_tensor_parallel``).
    """
    for param in module.parameters():
        if param.grad is not None:
            _reduce_partial_grad(param)


def reduce_partial_grads_eagerly(module: nn.Module) -> None:
    """Sum each ``Partial`` gradient of a replicated parameter over the tp ranks as soon as it is accumulated.

    Under sequence parallelism a replicated parameter that sees only this rank's positions (a LayerNorm's weight and
    bias) gets a ``Partial`` gradient. DTensor would sum it lazily, inside every optimizer and clipping op that reads
    it (several small all-reduces per parameter per step, and a slow optimizer step); this hook does it once, in
    backward, so every gradient leaves backward with its parameter's placement (which also suits the dp reducer).
    """
    for param in module.parameters():
        if isinstance(param, DTensor) and param.requires_grad and all(p.is_replicate() for p in param.placements):
            param.register_post_accumulate_grad_hook(_reduce_partial_grad)


def apply_tensor_parallel(
    module: nn.Module,
    tp_mesh: DeviceMesh,
    plan: Plan,
    sequence_parallel: bool = False,
    *,
    skip_absent: bool = False,
    eager_grad_reduction: bool = True,
) -> nn.Module:
    """Split ``module`` over the ranks of ``tp_mesh`` following ``plan`` (in place; also returned).

    Megatron-LM layout (Shoeybi et al. 2019, §3) with DTensor (``torch.distributed.tensor.parallel``), optionally with
    sequence parallelism (Korthikanti et al. 2022, §4.2.2). Afterwards every split parameter is a DTensor on
    ``tp_mesh`` (``Shard``; torch's row-parallel bias ``Replicate``) and every replicated one a plain tensor, which
    FSDP2 (``fully_shard`` on the dp mesh) and ``torch.distributed.checkpoint`` understand; vocab-parallel weights are
    padded to a multiple of the tp size (see :mod:`lightning_par.tensor_parallel.vocab`). Under sequence parallelism,
    call :func:`~lightning_par.tensor_parallel.styles.sync_tp_partial_grads` once per optimizer step.

    Args:
        module: the model (plain parameters, identical on every rank or to be taken from tp-rank 0).
        tp_mesh: the 1-D tp sub-mesh (``mesh["tp"]``).
        plan: module path -> style name or ``ParallelStyle`` (see :mod:`lightning_par.tensor_parallel.plan`).
        sequence_parallel: shard activations between sub-blocks over the sequence dim.
        skip_absent: skip plan entries for parts a pipeline stage removed (see
            :func:`~lightning_par.tensor_parallel.plan.expand_plan`).
        eager_grad_reduction: reduce ``Partial`` gradients of replicated parameters in backward, as each is
            accumulated (:func:`reduce_partial_grads_eagerly`). A pipeline schedule passes False and calls
            :func:`reduce_partial_grads` once after the schedule: measured with torch 2.13's DualPipeV at dp 2 x tp 2
            x pp 2 with sequence parallelism, the in-backward reductions gave wrong LayerNorm gradients in 2 runs of 4
            (their order across tp ranks is not fixed when a rank's two stages overlap), the deferred one in 0 of 6.

    Returns:
        ``module``.

    Raises:
        ValueError: the plan does not fit the module (see :func:`~lightning_par.tensor_parallel.plan.validate_plan`),
            ``tp_mesh`` is not 1-D, or a style fails on its module (the message names the module path and class).
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"tp_mesh has {tp_mesh.ndim} dims: expected the 1-D tp sub-mesh (mesh['tp']).")
    expanded = validate_plan(module, plan, tp_mesh.size(), sequence_parallel, skip_absent=skip_absent)
    broadcast_from_tp_rank0(module, tp_mesh.get_group())
    for path, style in expanded.items():
        # src_data_rank=None: every rank already holds tp-rank 0's values, so each cuts its shard with no traffic.
        style_obj = resolve_style(style, sequence_parallel)
        target = module.get_submodule(path)
        try:
            parallelize_module(target, tp_mesh, style_obj, src_data_rank=None)
        except (ValueError, TypeError, RuntimeError, AssertionError) as err:  # torch's messages name no module
            raise ValueError(
                f"tensor-parallel style {style!r} could not be applied to module {path!r} "
                f"({type(target).__name__}): {err}"
            ) from err
    # Replicated parameters stay plain tensors (a Replicate DTensor makes AdamW about 6x slower per tensor, see
    # styles.ReplicateParallel); DTensor ones with Partial gradients (a user's torch SequenceParallel) are still
    # summed, eagerly or by reduce_partial_grads.
    if eager_grad_reduction:
        reduce_partial_grads_eagerly(module)
    return module
