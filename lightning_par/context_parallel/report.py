"""What a step reports under context parallelism: the mean over the whole sequence, not one rank's piece.

Each cp rank runs the LightningModule's step on its piece of every sequence, so the loss it returns and every value it
logs is a mean over *its* tokens (the recipe's GPT at cp2 logged ``train_loss`` 5.557601 at step 0 where one process
logs 5.559302). Gradients are averaged over ``dp_cp`` by the dp axis; what the user watches is not:
:func:`cp_mean_step` runs the step with ``self.log`` (and so ``self.log_dict``) and the returned loss replaced by the
token-weighted mean over the cp ranks, ``sum_r(v_r n_r) / sum_r(n_r)``, where ``n_r`` is the number of target tokens
rank ``r`` holds that are not ``-100`` (the ignore index of ``F.cross_entropy`` and Hugging Face labels; without such a
mask every rank holds as many tokens and this is the plain mean). With a mask the ranks' gradients need the same
weights before the dp axis averages them: the returned loss carries them (``n_r cp_size / sum(n)``). The targets are the contract's
(:func:`lightning_par.contract.pipeline_batch`: ``batch[1]`` of a tuple batch, or what the module's
``pipeline_batch`` returns; a mapping batch's ``"labels"``); a batch without integer targets weighs every rank alike.

Every value logged in the step is treated as a mean over the rank's tokens (a loss, a token accuracy). A torchmetrics
``Metric`` passed to ``self.log`` is left alone (it syncs its own state). One all-reduce over the cp group per logged
value and per returned loss: every cp rank runs the same step code, so they log the same keys in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from numbers import Number
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_par import contract

__all__ = ["IGNORE_INDEX", "cp_mean_step", "target_tokens"]

IGNORE_INDEX = contract.IGNORE_INDEX


def target_tokens(module: Any, batch: Any) -> float:
    """The number of target tokens of this rank's ``batch`` that count in a token-mean loss (not ``-100``); ``1.0``
    when the batch has no integer targets to count (every rank then weighs the same): the contract's
    :func:`~lightning_par.contract.batch_counted_tokens`.

    Args:
        module: the LightningModule (its ``pipeline_batch`` maps a batch to ``(inputs, targets)``, when defined).
        batch: this rank's batch, as the step sees it (its sequence already split over cp).
    """
    return contract.batch_counted_tokens(module, batch)


def _local(value: Tensor) -> Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def _weighted_mean(value: Tensor, weight: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``sum_r(value_r * weight_r) / sum_r(weight_r)`` over ``group`` (a rank of weight 0 adds nothing, even a NaN);
    ``weight`` a 0-dim float64 tensor on ``value``'s device. One all-reduce, on that device; nothing read to the host."""
    local = _local(value).detach().to(torch.float64).reshape(-1)
    w = weight.to(local.device).reshape(1)
    part = torch.where(w > 0, local * w, torch.zeros_like(local))
    both = torch.cat([part, w])
    dist.all_reduce(both, group=group)
    mean = both[:-1] / both[-1]
    return mean.reshape(_local(value).shape).to(value.dtype)


def _device(module: Any, batch: Any) -> torch.device:
    """Where the step's tensors live: the batch's first tensor's device, else the module's parameters'."""
    from lightning_par.compat import tree_leaves

    for leaf in tree_leaves(batch):
        if isinstance(leaf, Tensor):
            return leaf.device
    for p in module.parameters():
        return _local(p).device
    return torch.device("cpu")


def cp_mean_step(group: dist.ProcessGroup) -> Callable[..., Any]:
    """The cp axis's step wrapper (:attr:`lightning_par.axis_registry.Build.step_wrappers`) over the cp ``group``.

    Returns:
        ``wrap(module, batch, run) -> output``: ``run(batch)`` with every tensor or number the step passes to
        ``module.log`` and the loss it returns (a tensor, or ``output["loss"]``) replaced by their token-weighted mean
        over ``group``. The returned loss's gradient is this rank's loss weighted by ``cp_size * n_r / sum(n)`` (1
        without masks), so that the dp axis's plain average over the cp ranks is the gradient of the token mean. The
        counts stay on the batch's device (no read to the host); a number logged comes back as a 0-dim tensor.
    """

    def wrap(module: Any, batch: Any, run: Callable[[Any], Any]) -> Any:
        device = _device(module, batch)
        weight = contract.batch_counted_tokens_tensor(module, batch, device)
        size = dist.get_world_size(group)
        counted = weight.reshape(1).clone()
        dist.all_reduce(counted, group=group)
        total = counted[0]
        had_own = "log" in module.__dict__
        original = getattr(module, "log", None)  # a plain nn.Module (a Fabric loop's model) logs nothing

        def log(name: str, value: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(value, Tensor) and value.numel() == 1:
                value = _weighted_mean(value, weight, group)
            elif isinstance(value, Number) and not isinstance(value, bool):
                value = _weighted_mean(torch.tensor(float(value), device=device), weight, group)
            assert original is not None
            return original(name, value, *args, **kwargs)

        if original is None:
            out = run(batch)
        else:
            module.log = log
            try:
                out = run(batch)
            finally:
                if had_own:
                    module.log = original
                else:
                    del module.log

        def report(loss: Any) -> Any:
            if not (isinstance(loss, Tensor) and loss.numel() == 1):
                return loss
            mean = _weighted_mean(loss, weight, group)
            if not torch.is_grad_enabled() or not loss.requires_grad:
                return mean
            # no counted token in this piece: its mean is 0/0 (NaN), its gradient zero
            loss = torch.where(weight == 0, loss.nan_to_num(0.0), loss)
            # The dp axis averages the cp ranks' gradients alike: weighing this rank's loss by its share of the
            # tokens makes that average the gradient of the token mean (a factor of exactly 1 without masks).
            factor = torch.where(total > 0, weight * size / total, torch.ones_like(total))
            scaled = loss * factor.to(loss.dtype)
            return scaled + (mean - _local(scaled).detach())

        if isinstance(out, Mapping) and "loss" in out:
            return {**out, "loss": report(out["loss"])}
        return report(out)

    return wrap
