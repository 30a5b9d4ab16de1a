"""A mixture-of-experts feed-forward layer: a top-k router, grouped experts, an optional shared expert.

The layer (:class:`MoE`) routes each token to ``top_k`` of ``num_experts`` feed-forward experts (Shazeer et al. 2017;
GShard, Lepikhin et al. 2020; Switch Transformer, Fedus et al. 2021), sorts the routed copies by expert, runs the
experts on them (:class:`GroupedExperts`: ``experts(tokens sorted by expert, tokens per expert)``), and adds the
experts' outputs back weighted by the router. That call is the seam expert parallelism works at
(:mod:`lightning_par.expert_parallel`): it moves the sorted tokens to the ranks holding their experts and back, and the
layer does not change.

Everything that depends on which tokens belong together is computed per sequence, so that it does not depend on how a
batch is split over data-parallel ranks, micro-batches or context-parallel ranks (a one-process run gives the same
numbers):

* **load-balancing loss** (Switch/GShard form, per sequence as DeepSeek-V3's sequence-wise loss, §2.1.2):
  ``E * sum_i f_i P_i`` with ``f_i`` the share of the sequence's ``seq * top_k`` routed copies sent to expert ``i`` and
  ``P_i`` its mean routing probability over the sequence, averaged over sequences;
* **router z-loss** (ST-MoE, Zoph et al. 2022, §3.2): the mean over tokens of ``logsumexp(logits)^2``;
* **capacity** (``capacity_factor``; ``None``: dropless): each expert takes at most
  ``ceil(capacity_factor * seq * top_k / num_experts)`` copies per sequence, first choices before second choices,
  earlier positions first (GShard's priority); a dropped copy contributes nothing (the residual carries the token).

Under context parallelism the per-sequence sums are summed over the cp ranks
(:func:`~lightning_par.context_parallel.sequence.active_sequence_shard`). Both losses reach backward through
:func:`~lightning_par.aux_loss.attach_aux_loss`, so they count under pipelining too, and each is weighted by a
coefficient. :attr:`MoE.last_stats` keeps the last forward's figures (tokens per expert, dropped copies, losses).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_par.aux_loss import attach_aux_loss
from lightning_par.context_parallel.sequence import active_sequence_shard

__all__ = ["GATINGS", "GroupedExperts", "MoE", "Router"]

#: Router score functions: ``softmax`` over experts (Switch, Mixtral) or per-expert ``sigmoid`` (DeepSeek-V3).
GATINGS: tuple[str, ...] = ("softmax", "sigmoid")


def _local(w: Tensor) -> Tensor:
    """This rank's experts of an expert weight (a DTensor split over the ep ranks), differentiably."""
    return w.to_local() if isinstance(w, DTensor) else w


class GroupedExperts(nn.Module):
    """``num_experts`` two-layer GELU feed-forward networks ``d -> hidden -> d`` with their weights stacked on dim 0.

    The expert contract of :mod:`lightning_par.contract`: ``forward(x, counts)`` takes tokens sorted by expert and the
    number of tokens of each expert this module holds, and every parameter has the expert index on dim 0. Under expert
    parallelism the weights are DTensors ``Shard(0)`` over the ep ranks and ``counts`` counts this rank's experts.

    Args:
        num_experts: experts.
        dim: model width ``d``.
        hidden: hidden width of each expert.
    """

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Every weight ~ N(0, 0.02) (the GPT scales ``w2`` down like its other residual projections)."""
        nn.init.normal_(self.w1, std=0.02)
        nn.init.normal_(self.w2, std=0.02)

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """Run each expert on its tokens.

        Args:
            x: ``(tokens, d)``, sorted by expert.
            counts: ``(experts held,)`` int64, tokens of each expert, summing to ``tokens``.

        Returns:
            ``(tokens, d)`` in the order of ``x``.
        """
        w1, w2 = _local(self.w1), _local(self.w2)
        chunks = x.split(counts.tolist())
        out = [F.gelu(chunk @ w1[e]) @ w2[e] for e, chunk in enumerate(chunks)]
        return torch.cat(out) if out else x[:0]


class Router(nn.Module):
    """Scores every token against every expert and picks ``top_k``.

    Args:
        dim: model width.
        num_experts: experts.
        top_k: experts per token.
        gating: ``"softmax"`` (weights: the chosen probabilities, renormalised when ``top_k > 1``, as Mixtral) or
            ``"sigmoid"`` (weights: the chosen scores normalised to sum 1, as DeepSeek-V3).
    """

    def __init__(self, dim: int, num_experts: int, top_k: int, gating: str) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.top_k, self.gating = top_k, gating

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Route ``x`` ``(batch, seq, d)``.

        Returns:
            ``(logits, probs, weights, experts)``: router logits and routing probabilities (normalised over experts)
            ``(batch, seq, E)`` in float32, the chosen experts' weights ``(batch, seq, top_k)`` and their indices
            ``(batch, seq, top_k)`` int64.
        """
        logits = self.gate(x).float()
        scores = logits.softmax(-1) if self.gating == "softmax" else logits.sigmoid()
        top, experts = scores.topk(self.top_k, dim=-1)
        weights = top / top.sum(-1, keepdim=True) if (self.top_k > 1 or self.gating == "sigmoid") else top
        probs = scores if self.gating == "softmax" else scores / scores.sum(-1, keepdim=True)
        return logits, probs, weights, experts


class _SumOverSequence(torch.autograd.Function):
    """All-reduce (sum) over the cp group, whose backward all-reduces the gradient (every cp rank uses the sum)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class MoE(nn.Module):
    """A mixture-of-experts feed-forward layer (see the module docstring).

    Args:
        dim: model width ``d``.
        hidden: hidden width of each expert.
        num_experts: experts ``E`` (>= 2).
        top_k: experts per token, 1 or 2.
        gating: ``"softmax"`` or ``"sigmoid"`` (:data:`GATINGS`).
        shared_expert: also run one dense expert of width ``hidden`` on every token (DeepSeekMoE).
        capacity_factor: ``None`` for dropless routing, else the capacity multiplier (> 0).
        aux_loss_coeff: weight of the load-balancing loss (>= 0).
        z_loss_coeff: weight of the router z-loss (>= 0).

    Raises:
        ValueError: a value out of range, naming the argument.
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        num_experts: int,
        top_k: int = 2,
        gating: str = "softmax",
        shared_expert: bool = False,
        capacity_factor: float | None = None,
        aux_loss_coeff: float = 0.01,
        z_loss_coeff: float = 0.001,
    ) -> None:
        super().__init__()
        check_moe_options(num_experts, top_k, gating, capacity_factor, aux_loss_coeff, z_loss_coeff)
        self.num_experts, self.top_k = num_experts, top_k
        self.capacity_factor = capacity_factor
        self.aux_loss_coeff, self.z_loss_coeff = aux_loss_coeff, z_loss_coeff
        self.router = Router(dim, num_experts, top_k, gating)
        self.experts = GroupedExperts(num_experts, dim, hidden)
        self.shared = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)) if shared_expert else None
        #: figures of the last forward: ``tokens_per_expert`` ``(E,)``, ``dropped``, ``aux_loss``, ``z_loss``.
        self.last_stats: dict[str, Any] = {}

    def forward(self, x: Tensor) -> Tensor:
        """``(batch, seq, d) -> (batch, seq, d)``; ``seq`` is this rank's piece of each sequence under cp."""
        batch, seq, dim = x.shape
        logits, probs, weights, experts = self.router(x)
        shard = active_sequence_shard()
        group = shard.group if shard is not None and shard.size > 1 else None
        full_seq = seq * (shard.size if group is not None else 1)
        # load balance, per sequence (sums over the cp ranks' pieces)
        counts = F.one_hot(experts, self.num_experts).sum((1, 2)).float()  # (batch, E)
        prob_sums = probs.sum(1)  # (batch, E)
        if group is not None:
            dist.all_reduce(counts, group=group)
            prob_sums = _SumOverSequence.apply(prob_sums, group)
        f = counts / (full_seq * self.top_k)
        aux = self.num_experts * (f * prob_sums / full_seq).sum(-1).mean()
        z = torch.logsumexp(logits, -1).pow(2).mean()
        keep = self._within_capacity(experts, shard if group is not None else None, full_seq)
        # dispatch: every kept (token, choice), sorted by expert
        flat_x = x.reshape(-1, dim)
        token = torch.arange(batch * seq, device=x.device).repeat_interleave(self.top_k)
        expert, weight = experts.reshape(-1), weights.reshape(-1)
        if keep is not None:
            kept = keep.reshape(-1)
            token, expert, weight = token[kept], expert[kept], weight[kept]
        order = torch.argsort(expert, stable=True)
        token, weight = token[order], weight[order]
        per_expert = torch.bincount(expert, minlength=self.num_experts)
        out = self.experts(flat_x[token], per_expert)
        y = torch.zeros_like(flat_x).index_add_(0, token, out * weight.unsqueeze(-1).to(out.dtype))
        y = y.reshape(batch, seq, dim)
        if self.shared is not None:
            y = y + self.shared(x)
        self.last_stats = {
            "tokens_per_expert": per_expert.detach(),
            "dropped": 0 if keep is None else int((~keep).sum()),
            "aux_loss": aux.detach(),
            "z_loss": z.detach(),
        }
        return attach_aux_loss(y, self.aux_loss_coeff * aux + self.z_loss_coeff * z)

    def _within_capacity(self, experts: Tensor, shard: Any, full_seq: int) -> Tensor | None:
        """``(batch, seq, top_k)`` bool: the routed copies each expert's capacity takes (``None``: dropless)."""
        if self.capacity_factor is None:
            return None
        capacity = math.ceil(self.capacity_factor * full_seq * self.top_k / self.num_experts)
        batch, seq, k = experts.shape
        if shard is None:
            full, positions = experts, None
        else:  # the whole sequences, by global position
            pieces = [torch.empty_like(experts) for _ in range(shard.size)]
            dist.all_gather(pieces, experts.contiguous(), group=shard.group)
            places = [torch.empty_like(shard.positions) for _ in range(shard.size)]
            dist.all_gather(places, shard.positions.contiguous(), group=shard.group)
            full = experts.new_empty(batch, full_seq, k)
            for piece, place in zip(pieces, places):
                full[:, place] = piece
            positions = shard.positions
        # priority: choice-major (all first choices, then second), then position
        ordered = full.transpose(1, 2).reshape(batch, k * full_seq)
        onehot = F.one_hot(ordered, self.num_experts)
        rank_in_expert = (onehot.cumsum(1) * onehot).sum(-1) - 1
        keep = (rank_in_expert < capacity).reshape(batch, k, full_seq).transpose(1, 2)
        return keep if positions is None else keep[:, positions]


def check_moe_options(
    num_experts: int, top_k: int, gating: str, capacity_factor: float | None, aux_loss_coeff: float,
    z_loss_coeff: float, prefix: str = "",
) -> None:
    """Raise ``ValueError`` naming the field for a mixture-of-experts option out of range."""
    def bad(name: str, value: object, valid: str) -> ValueError:
        return ValueError(f"{prefix}{name}={value!r} is not valid: expected {valid}.")

    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 2:
        raise bad("num_experts", num_experts, "an integer >= 2")
    if top_k not in (1, 2) or isinstance(top_k, bool) or top_k > num_experts:
        raise bad("top_k", top_k, "1 or 2 (at most num_experts)")
    if gating not in GATINGS:
        raise bad("gating", gating, f"one of {list(GATINGS)}")
    if capacity_factor is not None and not (isinstance(capacity_factor, (int, float)) and capacity_factor > 0):
        raise bad("capacity_factor", capacity_factor, "null (dropless) or a number > 0")
    for name, value in (("aux_loss_coeff", aux_loss_coeff), ("z_loss_coeff", z_loss_coeff)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
            raise bad(name, value, "a finite number >= 0")
