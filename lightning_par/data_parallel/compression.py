"""Gradient compression for the bucketed all-reduce: fp16 / bf16 casts and PowerSGD.

The casts halve the bytes on the wire; PowerSGD (Vogels et al., NeurIPS 2019, Algorithm 1) replaces each
gradient matrix ``M (n, m)`` by a rank-``r`` product ``P Q^T`` with ``P (n, r)`` and ``Q (m, r)``, so a step sends
``r (n + m)`` numbers instead of ``n m``, and keeps the part it dropped as error feedback for the next step.
torch ships the same algorithm as a DDP comm hook, but a DDP hook only runs inside torch's ``DistributedDataParallel``,
which does not compose with DTensor or pipelining; this version runs on our own buckets.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["COMM_HOOKS", "CAST_DTYPES", "PowerSGDState", "validate_comm_hook"]

#: Accepted values of ``comm_hook``.
COMM_HOOKS: tuple[str, ...] = ("none", "fp16", "bf16", "powersgd")
#: Wire dtype of each casting hook.
CAST_DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}


def validate_comm_hook(comm_hook: str, powersgd_rank: int, powersgd_start_iter: int) -> None:
    """Raise ``ValueError`` naming the field if a comm-hook option is invalid."""
    if comm_hook not in COMM_HOOKS:
        raise ValueError(f"comm_hook={comm_hook!r} is not valid: expected one of {list(COMM_HOOKS)}.")
    if isinstance(powersgd_rank, bool) or not isinstance(powersgd_rank, int) or powersgd_rank < 1:
        raise ValueError(f"powersgd_rank={powersgd_rank!r} is not valid: expected an integer >= 1.")
    if isinstance(powersgd_start_iter, bool) or not isinstance(powersgd_start_iter, int) or powersgd_start_iter < 0:
        raise ValueError(f"powersgd_start_iter={powersgd_start_iter!r} is not valid: expected an integer >= 0.")


def _orthonormalize_(p: Tensor) -> None:
    """Gram-Schmidt on the columns of ``p (n, r)``, in place (Vogels et al. 2019, Alg. 1 line 5)."""
    for i in range(p.shape[1]):
        col = p[:, i]
        if i > 0:
            prev = p[:, :i]
            col -= prev @ (prev.T @ col)
        col /= col.norm().clamp_min(1e-8)


class PowerSGDState:
    """Per-parameter ``Q`` factors and error-feedback buffers of PowerSGD.

    Args:
        rank: the rank ``r`` of the approximation. A matrix with ``min(n, m) <= r`` is sent uncompressed.
        start_iter: synchronised steps that use a plain all-reduce before compression starts (the paper's warm-up;
            torch's hook requires at least 2).
        seed: seed of the random initial ``Q``; identical on every rank, as the algorithm requires.
    """

    def __init__(self, rank: int = 1, start_iter: int = 2, seed: int = 0) -> None:
        self.rank = rank
        self.start_iter = start_iter
        self.seed = seed
        self.iteration = 0
        self._q: dict[int, Tensor] = {}
        self._error: dict[int, Tensor] = {}

    def compressible(self, grad: Tensor) -> bool:
        """Whether ``grad`` is sent as low-rank factors this step (2-D or more, and larger than rank ``r``)."""
        if self.iteration < self.start_iter or grad.dim() < 2:
            return False
        n, m = grad.shape[0], grad[0].numel()
        return min(n, m) > self.rank

    def allreduce_(self, key: int, grad: Tensor, group: dist.ProcessGroup, world: int) -> None:
        """Replace ``grad`` in place by the PowerSGD estimate of its average over ``group``.

        Two blocking all-reduces: ``P = M Q`` (``n r`` numbers), then ``Q = M^T P`` (``m r`` numbers).
        """
        matrix = grad.reshape(grad.shape[0], -1)
        n, m = matrix.shape
        if key not in self._q:
            gen = torch.Generator(device="cpu").manual_seed(self.seed + key)
            self._q[key] = torch.randn(m, self.rank, generator=gen).to(matrix)
            self._error[key] = torch.zeros_like(matrix)
        q, error = self._q[key], self._error[key]
        # Error feedback: compress the gradient plus what was dropped last step (Alg. 2 of the paper).
        target = matrix / world + error
        p = target @ q
        dist.all_reduce(p, group=group)
        _orthonormalize_(p)
        q.copy_(target.T @ p)
        dist.all_reduce(q, group=group)
        # target was scaled by 1/world on each rank, so P Q^T = P P^T sum_j target_j estimates the average.
        # What this rank's own contribution loses in the projection onto span(P) is kept as its error.
        error.copy_(target - p @ (p.T @ target))
        matrix.copy_(p @ q.T)
