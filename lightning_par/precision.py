"""Mixed precision through every strategy: what Lightning's ``precision=`` means on each dp mode, and loss scaling that
agrees across ranks.

Lightning's precision plugins decide the compute dtype: ``"bf16-mixed"`` / ``"16-mixed"`` run forward under
``torch.autocast`` with fp32 parameters (Micikevicius et al. 2018, "Mixed Precision Training": fp32 master weights,
half-precision arithmetic); ``"bf16-true"`` converts the module (parameters, gradients, optimizer state) to bf16. On top
of that, per dp mode (:class:`~lightning_par.strategies.base.MeshStrategy` applies it before
:func:`~lightning_par.parallelize.parallelize`):

* ``ddp``, ``zero1``, ``zero2`` (and the tp and pp axes): the parameters stay fp32 under the ``-mixed`` precisions,
  so they *are* the fp32 master weights, the optimizer state is fp32, and gradients are reduced in fp32; activations
  are bf16/fp16 where autocast makes them so, hence the tensor-parallel collectives of a row-parallel layer's output
  carry bf16. A ZeRO run may instead keep bf16 *compute* weights beside fp32 master shards with
  ``zero.mixed_precision`` (its ``param_dtype``), which then wins.
* ``zero3``: FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16 | fp16, reduce_dtype=fp32)`` (:func:`fsdp_mixed_precision`)
  unless ``zero.mixed_precision`` is given: the sharded parameters and the optimizer state stay fp32, the parameters
  are all-gathered and computed with in half precision (half the all-gather bytes), the gradients reduce-scattered in
  fp32. The residual stream is then bf16 too, so pipeline stages send bf16 activations.
* ``"16-mixed"`` scales the loss (``torch.amp.GradScaler``). A step is skipped when any gradient is not finite; with
  sharded gradients (ZeRO, tensor parallelism) each rank sees only its shard, so the decision must be taken over the
  whole world: :func:`distributed_scaler` replaces the plugin's scaler by a :class:`DistributedGradScaler` (torch's
  ``ShardedGradScaler``, which all-reduces the "found inf" flag, so every rank skips or steps together; it unscales
  DTensor and plain gradients alike). Pipelining cannot scale the loss inside
  its schedule: it refuses ``"16-mixed"`` (use ``"bf16-mixed"``, which needs no scaling).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from lightning_par.compat import (
    foreach_non_finite_check_and_unscale_,
    grad_scaler_init_kwargs,
    local_tensor,
    multi_device_replicator,
    replicated_tensors,
)

__all__ = [
    "DistributedGradScaler",
    "MIXED_PRECISIONS",
    "check_precision",
    "compute_dtype",
    "distributed_scaler",
    "fsdp_mixed_precision",
    "route_clipping",
]

#: Lightning precisions that autocast with fp32 parameters, and their compute dtype.
MIXED_PRECISIONS: dict[str, torch.dtype] = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype a Lightning precision computes matmuls in (``torch.float32`` for the full-precision ones)."""
    return MIXED_PRECISIONS.get(precision) or {"bf16-true": torch.bfloat16, "16-true": torch.float16,
                                               "64-true": torch.float64}.get(precision, torch.float32)


def check_precision(precision: str, pp_size: int, scaled: bool | None = None) -> None:
    """Refuse fp16 loss scaling with pipelining.

    Args:
        precision: Lightning's precision (``trainer.precision``).
        pp_size: pipeline ranks.
        scaled: whether the precision plugin has a gradient scaler (``None``: assume ``"16-mixed"`` has one, as on
            a GPU; on CPU Lightning turns ``"16-mixed"`` into ``"bf16-mixed"`` unless given the plugin).

    Raises:
        ValueError: loss scaling with ``pp_size > 1``; the message names what to use instead.
    """
    if scaled is None:
        scaled = precision == "16-mixed"
    if pp_size > 1 and scaled:
        raise ValueError(
            f"precision={precision!r} is not valid with pipelining (pp_size={pp_size}): fp16 loss scaling would have to "
            f"scale each micro-batch's loss inside the schedule and skip the step on every stage together, which is "
            f"not supported. Use precision='bf16-mixed' (bf16 needs no loss scaling) or '32-true'."
        )


def fsdp_mixed_precision(precision: str) -> tuple[torch.dtype, torch.dtype] | None:
    """``(param_dtype, reduce_dtype)`` of the FSDP2 ``MixedPrecisionPolicy`` that ``zero3`` uses under a Lightning
    precision: half-precision parameters for compute, fp32 gradient reduction, under the ``-mixed`` precisions;
    ``None`` otherwise (``"bf16-true"`` shards bf16 parameters as they are)."""
    dtype = MIXED_PRECISIONS.get(precision)
    return (dtype, torch.float32) if dtype is not None else None


class DistributedGradScaler(ShardedGradScaler):
    """torch's ``ShardedGradScaler`` (the "found inf" flag all-reduced over ``process_group`` before a step is taken or
    skipped) that also unscales a mix of DTensor and plain gradients.

    An optimizer here may hold both: tensor-parallel DTensor parameters beside replicated ones kept plain, or ZeRO-1/2's
    plain local shards. One ``torch._amp_foreach_non_finite_check_and_unscale_`` call cannot take both ("got mixed
    torch.Tensor and DTensor", measured with torch 2.13), so every gradient is unscaled through its local tensor; the
    flag is then all-reduced over the whole process group, which covers the tensor-parallel ranks too.
    """

    def _unscale_grads_(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool = True
    ) -> dict[torch.device, torch.Tensor]:
        per_device_inv_scale = multi_device_replicator(inv_scale)
        per_device_found_inf = multi_device_replicator(found_inf)
        grads: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is None:
                        continue
                    grad = local_tensor(grad)
                    if not allow_fp16 and grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    if grad.is_sparse:
                        grad = grad.coalesce().values()
                    grads[grad.device][grad.dtype].append(grad)
            for device, per_dtype in grads.items():
                for tensors in per_dtype.values():
                    foreach_non_finite_check_and_unscale_(
                        tensors, per_device_found_inf.get(device), per_device_inv_scale.get(device)
                    )
        if not replicated_tensors(per_device_found_inf):  # a rank with no gradient still takes part in the all-reduce
            assert self._scale is not None
            per_device_found_inf.get(self._scale.device)
        return replicated_tensors(per_device_found_inf)


def distributed_scaler(scaler: Any, process_group: Any = None) -> Any:
    """A :class:`DistributedGradScaler` with ``scaler``'s settings (scale, growth and back-off factors, growth
    interval), whose "found inf" flag is all-reduced over ``process_group`` (default: the world) before each step.

    Args:
        scaler: the precision plugin's ``torch.amp.GradScaler`` (its state, if any, is carried over).
        process_group: the ranks that must skip a step together.

    Returns:
        The new scaler (``scaler`` itself if it already is one).
    """
    import torch.distributed as dist

    if isinstance(scaler, ShardedGradScaler):
        return scaler
    new = DistributedGradScaler(
        **grad_scaler_init_kwargs(scaler),
        growth_factor=scaler.get_growth_factor(),
        backoff_factor=scaler.get_backoff_factor(),
        growth_interval=scaler.get_growth_interval(),
        enabled=scaler.is_enabled(),
        process_group=process_group if process_group is not None else dist.group.WORLD,
    )
    state = scaler.state_dict()
    if state:
        new.load_state_dict(state)
    return new


def route_clipping(plugin: Any, parallel: Any, clip_norm: Any, clip_value: Any) -> None:
    """Make Lightning's precision plugin ``plugin`` clip through the parallel model ``parallel``
    (:class:`~lightning_par.parallelize.ParallelModel`) with the runtime's clipping functions ``clip_norm`` and
    ``clip_value`` (``(parallel, optimizer, value)``: :func:`lightning_par.runtime.step.clip_grad_norm_` by the whole
    model's norm, every shard and stage; :func:`~lightning_par.runtime.step.clip_grad_value_` on each rank's gradient
    shards, as torch's ``clip_grad_value_`` refuses DTensor gradients), the ones the Fabric adapter calls too.
    Lightning 2.6's ``Precision.clip_gradients`` calls the plugin's ``clip_grad_by_norm`` / ``clip_grad_by_value``
    with ``(optimizer, clip_val)``; they are set on this instance only."""

    def by_norm(optimizer: Any, clip_val: float) -> None:
        clip_norm(parallel, optimizer, float(clip_val))

    def by_value(optimizer: Any, clip_val: float) -> None:
        clip_value(parallel, optimizer, float(clip_val))

    plugin.clip_grad_by_norm = by_norm
    plugin.clip_grad_by_value = by_value
