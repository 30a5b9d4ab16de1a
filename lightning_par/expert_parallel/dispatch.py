"""Token dispatch and combine for expert parallelism: the all-to-alls around an experts module.

A mixture-of-experts layer calls ``experts(x, counts)`` with its routed tokens sorted by expert (``x`` ``(n, d)``) and
the number of tokens of each of the ``E`` experts (``counts`` ``(E,)``). With the experts split over the ``ep`` ranks
(rank ``r`` holds experts ``r E/ep ... (r+1) E/ep - 1``), :class:`ExpertDispatch` hooks that call
(GShard, Lepikhin et al. 2020, §2.2; torchtitan's ``ExpertParallel`` works at the same seam):

1. exchange the counts (one ``all_to_all_single`` of ``ep x E/ep`` integers, on the tokens' device), so each rank
   knows how many tokens every other rank sends to each of its experts; then read the split sizes and the tokens per
   local expert to the host in *one* read (the layer's only host sync; the experts get the counts as ``host_counts``
   when they declare ``accepts_host_counts``, so they do not read them again);
2. send the tokens (``all_to_all_single`` with uneven splits), then order them by local expert;
3. the experts run on their tokens;
4. restore the arrival order and send the outputs back (the reverse all-to-all), so the layer gets its tokens in the
   order it sent them and combines them as in one process.

Gradients: the backward of each all-to-all is the all-to-all with the splits swapped. An expert's gradient sums the
contributions of every token any ep rank sent it; the dp axis then averages it over the ``edp`` ranks (the ranks
holding the same expert, ``dp_shard_cp / ep`` of them per replica). A one-process gradient is that sum divided by all
``dp_shard_cp`` ranks, so the expert weights' gradients are scaled by ``1 / ep`` on the way in (and the tokens'
gradients by ``ep`` on the way out, which leaves them unchanged); the factor is a power of two for the usual sizes, so
it is exact.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["ExpertDispatch", "all_to_all"]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> Tensor:
    """``all_to_all_single`` along dim 0 with uneven splits, differentiable (backward: the reverse exchange).

    Written here because torch's autograd-aware all-to-all is deprecated in ``torch.distributed.nn`` and private in
    ``torch.distributed._functional_collectives`` (torch 2.13).
    """
    return _AllToAll.apply(x, out_splits, in_splits, group)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.factor, None


class ExpertDispatch:
    """The forward pre-hook and forward hook that run an experts module over the ep ranks (see the module docstring).

    Args:
        group: the ep process group.
        ep_size: ranks in it.

    Attributes:
        bytes_sent: bytes this rank sent to other ranks in tokens (dispatch and combine) since :meth:`reset_bytes`.
        calls: forwards since :meth:`reset_bytes`.
    """

    def __init__(self, group: Any, ep_size: int) -> None:
        self.group, self.ep_size = group, ep_size
        self.rank = dist.get_rank(group)
        self.bytes_sent = 0
        self.calls = 0
        self._state: tuple[Tensor, list[int], list[int]] | None = None

    def attach(self, module: nn.Module) -> None:
        """Register the hooks on ``module`` (an experts module, see :mod:`lightning_par.contract`)."""
        module.register_forward_pre_hook(self.dispatch, with_kwargs=True)
        module.register_forward_hook(self.combine)

    def reset_bytes(self) -> None:
        self.bytes_sent, self.calls = 0, 0

    # Eager under a compiled block (strategy.compile, lightning_par/compile.py): the split sizes are read from the
    # routing (.tolist()) and the all-to-all is a process-group call, neither of which dynamo traces.
    @torch.compiler.disable
    def dispatch(self, module: nn.Module, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> tuple[tuple[Tensor, Tensor], dict[str, Any]]:
        """``(x sorted by expert, counts (E,))`` -> ``(tokens of this rank's experts sorted by local expert,
        counts (E/ep,))``; an experts module with ``accepts_host_counts`` also gets ``host_counts`` (the counts as a
        list, read in the same host read as the split sizes)."""
        x, counts = args
        ep = self.ep_size
        per_rank = counts.reshape(ep, -1)  # (ep, E/ep) on the tokens' device
        received = torch.empty_like(per_rank)
        dist.all_to_all_single(received, per_rank.contiguous(), group=self.group)  # row s: source s's counts
        # Deliberate host sync, the one of this MoE layer: the all-to-all's split sizes (sent, received) and the
        # tokens per local expert, in one read (docs/context-expert.md lists it).
        host = torch.cat([per_rank.sum(1), received.sum(1), received.sum(0)]).tolist()
        in_splits, out_splits, local = host[:ep], host[ep:2 * ep], host[2 * ep:]
        tokens = all_to_all(x, out_splits, in_splits, self.group)
        # arrival order is (source, local expert); the experts want (local expert, source): each segment's start in
        # the arrival order, taken in expert-major order, plus the position within the segment
        n = sum(out_splits)
        lengths = received.t().reshape(-1)
        starts = (received.reshape(-1).cumsum(0) - received.reshape(-1)).reshape(received.shape).t().reshape(-1)
        within = torch.arange(n, device=x.device) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths,
                                                                            output_size=n)
        order = torch.repeat_interleave(starts, lengths, output_size=n) + within
        self._state = (order, in_splits, out_splits)
        self.bytes_sent += (sum(in_splits) - in_splits[self.rank]) * x.shape[1] * x.element_size()
        self.calls += 1
        out_kwargs = {**kwargs, "host_counts": local} if getattr(module, "accepts_host_counts", False) else kwargs
        return (_ScaleGrad.apply(tokens[order], float(ep)), received.sum(0)), out_kwargs

    @torch.compiler.disable  # eager under a compiled block (lightning_par/compile.py): see below
    def combine(self, module: nn.Module, args: tuple[Any, ...], out: Tensor) -> Tensor:
        """The experts' outputs, back on the ranks and in the order the tokens came from."""
        assert self._state is not None, "ExpertDispatch.combine without dispatch"
        order, in_splits, out_splits = self._state
        self._state = None
        out = _ScaleGrad.apply(out, 1.0 / self.ep_size)
        arrival = out[torch.argsort(order)] if out.shape[0] else out
        self.bytes_sent += (sum(out_splits) - out_splits[self.rank]) * out.shape[1] * out.element_size()
        return all_to_all(arrival, in_splits, out_splits, self.group)
