"""The gradient of the global batch's token mean under data parallelism, whatever the label mask.

A token-mean loss (``F.cross_entropy`` with its default ``ignore_index=-100``, Hugging Face labels) on each dp replica
is the mean over *that replica's* counted tokens ``n_r`` (targets that are not ``-100``). The dp axis averages the
replicas' gradients alike, so without weighing the gradient is that of ``(1/R) sum_r L_r``, the mean of per-replica
means; one process on the same global batch takes the gradient of ``sum_r n_r L_r / N`` (``N = sum_r n_r``). They
agree only when every replica counts as many tokens: an answer-only label mask (chat or instruction records, prompts
of different lengths) or padding breaks that. :func:`dp_token_mean_step` weighs each replica's loss by
``R n_r / N`` for the gradient, so that the dp average is the gradient of the global token mean (a factor of exactly 1
when the counts are equal: without a mask nothing changes).

The counts are the contract's (:func:`lightning_par.contract.batch_counted_tokens`: ``batch[1]`` of a tuple
batch, or what the module's ``pipeline_batch`` returns; a mapping batch's ``"labels"``); a batch without integer
targets weighs every replica alike. Under context parallelism a replica's tokens are spread over its cp ranks: the cp
axis's wrapper weighs those ranks within the replica (``cp n_r / N_cp``), and this one weighs the replicas
(``dp N_cp / N``): the product is the token mean's weight over every rank of ``dp_cp``. Under pipelining the schedule
weighs each micro-batch itself (:meth:`~lightning_par.pipeline_parallel.engine.PipelineEngine._weights`, over the dp
group too, listed in ``Build.token_groups``); the loss the pipelined step returns has no gradient and passes through
this wrapper unchanged.

The value the step returns (and logs) stays this replica's own mean, as under Lightning's ``DDPStrategy``; only its
gradient changes. A rank whose batch counts no token at all (prompts and padding only) returns 0.0 in place of
``F.cross_entropy``'s 0/0 (NaN, which a non-finite check would stop on); its gradient is zero either way. One
all-reduce of one number over the dp group per training step (and one over the cp group before it under cp), only
while the step's loss has a gradient; the count is a tensor on the loss's device and is never read to the host
(``docs/host-syncs.md``).

A LightningModule whose loss is *not* a token mean over integer targets (a sum, a per-sample mean of a
classification loss with ``-100`` entries) sets ``token_mean_loss = False``: every replica then weighs the same, as
before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from lightning_par import contract

__all__ = ["dp_token_mean_step", "replica_weight", "replicated_like"]


def replica_weight(tokens: Tensor, dp_group: dist.ProcessGroup, cp_group: dist.ProcessGroup | None = None) -> Tensor:
    """``R * N_r / N``: the factor on this replica's loss gradient that turns the dp average into the gradient of the
    global token mean.

    Args:
        tokens: the counted tokens of this rank's batch, a 0-dim (or one-element) tensor on the groups' device (the
            strategy's root device: NCCL takes CUDA tensors only), as
            :func:`~lightning_par.contract.batch_counted_tokens_tensor` gives it.
        dp_group: the ranks holding the other samples of the global batch (the ``dp`` mesh, ``R`` ranks).
        cp_group: the ranks holding the other pieces of this replica's sequences (``None`` without cp).

    Returns:
        The weight, a 0-dim float64 tensor on ``tokens``'s device (``1.0`` when nothing is counted anywhere), never
        read to the host. Collective over ``cp_group`` then ``dp_group`` (one all-reduce of one number each).
    """
    count = tokens.detach().to(torch.float64).reshape(1).clone()
    if cp_group is not None:
        dist.all_reduce(count, group=cp_group)
    replica = count.clone()
    dist.all_reduce(count, group=dp_group)
    weight = dist.get_world_size(dp_group) * replica / count
    return torch.where(count > 0, weight, torch.ones_like(weight)).reshape(())


def dp_token_mean_step(dp_group: dist.ProcessGroup, cp_group: dist.ProcessGroup | None = None) -> Callable[..., Any]:
    """The dp axis's step wrapper (:attr:`lightning_par.axis_registry.Build.step_wrappers`).

    Returns:
        ``wrap(module, batch, run) -> output``: ``run(batch)`` with the returned loss (a scalar tensor, or
        ``output["loss"]``) carrying the gradient of ``loss * replica_weight(...)`` and the value of ``loss``. The
        count and the weight stay on the loss's device: the wrapper reads nothing to the host.
    """
    def wrap(module: Any, batch: Any, run: Callable[[Any], Any]) -> Any:
        out = run(batch)
        loss = out["loss"] if isinstance(out, Mapping) and "loss" in out else out
        if not (isinstance(loss, Tensor) and loss.numel() == 1 and loss.requires_grad and torch.is_grad_enabled()):
            return out  # evaluation, manual optimization, a pipelined step: nothing to weigh
        tokens = contract.batch_counted_tokens_tensor(module, batch, loss.device)
        weight = replicated_like(replica_weight(tokens, dp_group, cp_group).to(loss.dtype), loss)
        # no counted token on this rank: its mean is 0/0 (NaN), its gradient zero (its weight is 0)
        loss = torch.where(replicated_like(tokens == 0, loss), loss.nan_to_num(0.0), loss)
        scaled = loss * weight
        weighted = scaled + (loss.detach() - scaled.detach())  # the value of loss, the gradient of loss * weight
        return {**out, "loss": weighted} if isinstance(out, Mapping) else weighted

    return wrap


def replicated_like(value: Tensor, loss: Tensor) -> Tensor:
    """``value`` (a plain 0-dim tensor) as a replicated DTensor on ``loss``'s mesh when ``loss`` is a DTensor."""
    if isinstance(loss, DTensor):
        mesh = loss.device_mesh
        return DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return value
