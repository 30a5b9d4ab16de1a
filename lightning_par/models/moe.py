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

**Auxiliary-loss-free balancing** (``balance="bias"`` or ``"both"``; DeepSeek-V3 technical report, §2.1.2): a
per-expert bias (a buffer, saved in checkpoints) is added to the scores for the top-k selection only, and after every
optimizer step :func:`update_expert_bias` moves it by ``bias_update_rate * sign(mean load - load)``, the load summed
over the ranks holding other tokens so that every replica keeps the same bias. With ``"bias"`` the load-balancing loss
is computed (logged) but not added.

The experts run in one of the forms of :func:`~lightning_par.expert_parallel.grouped.expert_ffn` (``torch._grouped_mm``
on CUDA bf16 and on CPU, a padded ``bmm`` on other accelerators, the per-expert loop as a fallback). Tokens are
permuted by a stable sort on the expert index (no loop over experts); the only host read of a layer is the experts'
segment sizes (none with ``grouped_mm``; under ep the dispatch's split sizes, handed on to the experts).

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
from lightning_par.expert_parallel.balance import update_selection_biases
from lightning_par.expert_parallel.grouped import FORMS, expert_ffn, sorted_counts

__all__ = ["BALANCES", "GATINGS", "GroupedExperts", "MoE", "Router", "update_expert_bias"]

#: Router score functions: ``softmax`` over experts (Switch, Mixtral) or per-expert ``sigmoid`` (DeepSeek-V3).
GATINGS: tuple[str, ...] = ("softmax", "sigmoid")
#: Load balancing: the auxiliary loss, DeepSeek-V3's selection bias (no loss), or both.
BALANCES: tuple[str, ...] = ("aux_loss", "bias", "both")


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

    #: :func:`~lightning_par.expert_parallel.grouped.expert_ffn` may be handed the counts already on the host.
    accepts_host_counts = True

    def __init__(self, num_experts: int, dim: int, hidden: int, form: str | None = None) -> None:
        super().__init__()
        self.num_experts = num_experts
        #: the experts' form (:data:`~lightning_par.expert_parallel.grouped.FORMS`; ``None``: chosen per call)
        self.form = form
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Every weight ~ N(0, 0.02) (the GPT scales ``w2`` down like its other residual projections)."""
        nn.init.normal_(self.w1, std=0.02)
        nn.init.normal_(self.w2, std=0.02)

    def forward(self, x: Tensor, counts: Tensor, host_counts: list[int] | None = None) -> Tensor:
        """Run each expert on its tokens (:func:`~lightning_par.expert_parallel.grouped.expert_ffn`: grouped matmul,
        padded ``bmm`` or the loop, see :attr:`form`).

        Args:
            x: ``(tokens, d)``, sorted by expert.
            counts: ``(experts held,)`` int64, tokens of each expert, summing to ``tokens``.
            host_counts: ``counts`` already on the host (the ep dispatch read them), or ``None``.

        Returns:
            ``(tokens, d)`` in the order of ``x``.
        """
        return expert_ffn(x, counts, _local(self.w1), _local(self.w2), F.gelu, form=self.form,
                          host_counts=host_counts)


class Router(nn.Module):
    """Scores every token against every expert and picks ``top_k``.

    Args:
        dim: model width.
        num_experts: experts.
        top_k: experts per token.
        gating: ``"softmax"`` (weights: the chosen probabilities, renormalised when ``top_k > 1``, as Mixtral) or
            ``"sigmoid"`` (weights: the chosen scores normalised to sum 1, as DeepSeek-V3).
        expert_bias: keep a per-expert bias ``expert_bias`` ``(E,)`` float32 (a buffer, so checkpoints hold it) added
            to the scores for the top-k *selection* only, never to the gating weights (DeepSeek-V3's auxiliary-loss-free
            balancing, DeepSeek-AI 2024, §2.1.2); :meth:`MoE.update_expert_bias` moves it.
    """

    def __init__(self, dim: int, num_experts: int, top_k: int, gating: str, expert_bias: bool = False) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.top_k, self.gating = top_k, gating
        self.expert_bias: Tensor | None
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Route ``x`` ``(batch, seq, d)``.

        Returns:
            ``(logits, probs, weights, experts)``: router logits and routing probabilities (normalised over experts)
            ``(batch, seq, E)`` in float32, the chosen experts' weights ``(batch, seq, top_k)`` and their indices
            ``(batch, seq, top_k)`` int64.
        """
        logits = self.gate(x).float()
        scores = logits.softmax(-1) if self.gating == "softmax" else logits.sigmoid()
        if self.expert_bias is None:
            top, experts = scores.topk(self.top_k, dim=-1)
        else:  # the bias picks the experts; the weights stay the unbiased scores (DeepSeek-V3, §2.1.2)
            experts = (scores + self.expert_bias).topk(self.top_k, dim=-1).indices
            top = scores.gather(-1, experts)
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
        aux_loss_coeff: weight of the load-balancing loss (>= 0); used with ``balance`` ``"aux_loss"`` or ``"both"``.
        z_loss_coeff: weight of the router z-loss (>= 0).
        balance: how the load is balanced (:data:`BALANCES`): ``"aux_loss"`` (the load-balancing loss), ``"bias"``
            (DeepSeek-V3's auxiliary-loss-free per-expert bias, no loss) or ``"both"`` (the bias and the loss, as
            DeepSeek-V3's complementary sequence-wise loss).
        bias_update_rate: the bias update speed ``gamma`` (> 0; DeepSeek-V3 used 0.001): after each optimizer step
            ``bias += gamma * sign(mean load - load)`` (:meth:`update_expert_bias`).
        experts_form: the experts' form (``None``/``"auto"``, ``"grouped_mm"``, ``"bmm"``, ``"loop"``:
            :func:`~lightning_par.expert_parallel.grouped.choose_form`).

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
        balance: str = "aux_loss",
        bias_update_rate: float = 1e-3,
        experts_form: str | None = None,
    ) -> None:
        super().__init__()
        check_moe_options(num_experts, top_k, gating, capacity_factor, aux_loss_coeff, z_loss_coeff, balance=balance,
                          bias_update_rate=bias_update_rate, experts_form=experts_form)
        self.num_experts, self.top_k = num_experts, top_k
        self.capacity_factor = capacity_factor
        self.aux_loss_coeff, self.z_loss_coeff = aux_loss_coeff, z_loss_coeff
        self.balance, self.bias_update_rate = balance, bias_update_rate
        self.router = Router(dim, num_experts, top_k, gating, expert_bias=balance in ("bias", "both"))
        self.experts = GroupedExperts(num_experts, dim, hidden, form=experts_form)
        # routed copies per expert since the last bias update, this rank's (not a checkpoint's business: the update
        # runs at every optimizer step, so it is zero at every step boundary)
        self.register_buffer("routed_load", torch.zeros(num_experts, dtype=torch.float32), persistent=False)
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
        # copies per expert per sequence: a scatter-add of ones (exact: integers in float32), not a one-hot
        # (batch, seq, top_k, E) int64 summed, which wrote E times more memory
        choices = experts.reshape(batch, -1)
        counts = x.new_zeros(batch, self.num_experts, dtype=torch.float32).scatter_add_(
            1, choices, torch.ones(choices.shape, dtype=torch.float32, device=x.device))  # (batch, E)
        if self.training and self.router.expert_bias is not None:
            # this rank's routed copies (before capacity), for the bias update; a recomputed forward (activation
            # checkpointing) counts every copy twice, which leaves sign(mean - load) unchanged
            with torch.no_grad():
                self.routed_load += counts.sum(0)
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
        expert, weight = experts.reshape(-1), weights.reshape(-1)
        if keep is None:  # copy i of the flat (token, choice) order belongs to token i // top_k
            sorted_expert, order = torch.sort(expert, stable=True)
            token = torch.div(order, self.top_k, rounding_mode="floor")
        else:
            kept = keep.reshape(-1)
            token = torch.arange(batch * seq, device=x.device).repeat_interleave(self.top_k)[kept]
            expert, weight = expert[kept], weight[kept]
            sorted_expert, order = torch.sort(expert, stable=True)
            token = token[order]
        weight = weight.index_select(0, order)
        per_expert = sorted_counts(sorted_expert, self.num_experts)  # no host read (bincount's on CUDA)
        # index_select, not flat_x[token]: one gather, whose backward is one index_add_ (measured on the CPU, one
        # thread: advanced indexing's backward goes through index_put_ with accumulate)
        out = self.experts(flat_x.index_select(0, token), per_expert)
        y = torch.zeros_like(flat_x).index_add_(0, token, out * weight.unsqueeze(-1).to(out.dtype))
        y = y.reshape(batch, seq, dim)
        if self.shared is not None:
            y = y + self.shared(x)
        self.last_stats = {
            "tokens_per_expert": per_expert.detach(),
            "dropped": torch.zeros((), dtype=torch.int64, device=x.device) if keep is None else (~keep).sum(),
            "aux_loss": aux.detach(),
            "z_loss": z.detach(),
        }
        aux_coeff = self.aux_loss_coeff if self.balance in ("aux_loss", "both") else 0.0
        return attach_aux_loss(y, aux_coeff * aux + self.z_loss_coeff * z)

    @torch.no_grad()
    def update_expert_bias(self, group: Any = None) -> None:
        """One step of DeepSeek-V3's auxiliary-loss-free balancing (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report",
        §2.1.2): ``expert_bias += bias_update_rate * sign(mean load - load)``, the load being the routed copies per
        expert since the last update summed over ``group``. Call it after every optimizer step on every rank of
        ``group`` (the ranks holding other tokens: dp x cp; the ep axis does, :mod:`lightning_par.expert_parallel.axis`);
        a call without new tokens leaves the bias as it is. No-op unless ``balance`` is ``"bias"`` or ``"both"``.

        Args:
            group: process group to sum the load over (an all-reduce of ``(E,)`` float32 on the load's device), or
                ``None`` for this rank's alone.
        """
        update_expert_bias([self], group)

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


@torch.no_grad()
def update_expert_bias(layers: list[MoE], group: Any = None) -> None:
    """:meth:`MoE.update_expert_bias` for several layers with one all-reduce (their loads concatenated, float32 on the
    loads' device; :func:`~lightning_par.expert_parallel.balance.update_selection_biases`). Layers without an expert
    bias are skipped; every rank of ``group`` must pass the same layers (the same pipeline stage)."""
    # sign(0) = 0: a layer that routed nothing since the last call keeps its bias
    update_selection_biases([(m.routed_load, m.router.expert_bias, m.bias_update_rate) for m in layers
                             if m.router.expert_bias is not None], group)


def check_moe_options(
    num_experts: int, top_k: int, gating: str, capacity_factor: float | None, aux_loss_coeff: float,
    z_loss_coeff: float, prefix: str = "", balance: str = "aux_loss", bias_update_rate: float = 1e-3,
    experts_form: str | None = None,
) -> None:
    """Raise ``ValueError`` naming the field, the value and the valid values for a mixture-of-experts option out of
    range."""
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
    if balance not in BALANCES:
        raise bad("balance", balance, f"one of {list(BALANCES)}")
    if (isinstance(bias_update_rate, bool) or not isinstance(bias_update_rate, (int, float))
            or not bias_update_rate > 0 or math.isinf(bias_update_rate)):
        raise bad("bias_update_rate", bias_update_rate, "a finite number > 0")
    if experts_form not in (None, "auto", *FORMS):
        raise bad("experts_form", experts_form, f"one of {['auto', *FORMS]}")
