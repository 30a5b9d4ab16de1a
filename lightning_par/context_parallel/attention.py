"""Attention over a sequence split across the ``cp`` (context-parallel) ranks: ring attention and DeepSpeed-Ulysses.

Why not torch's own ``torch.distributed.tensor.experimental.context_parallel``: measured on torch 2.13.0+cpu with
gloo, 2 processes, ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` on (2, 4, 16, 8) float32 inside
``context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2])`` raises on both ranks::

    NotImplementedError: Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding
    strategy registered.

(its ring rewrites only the CUDA flash / efficient / cuDNN SDPA ops). Forcing the math backend
(``sdpa_kernel(SDPBackend.MATH)``) fails too: ``aten.add.Tensor got mixed torch.Tensor and DTensor``. It also needs
its own sequence layout and DTensor buffers; the functions here take plain tensors in this project's layout.

Layout (fixed for lightning_par, "causal load balancing"): a sequence of length ``S`` (divisible by ``2 * cp``) is cut
into ``2 * cp`` equal chunks; cp rank ``i`` holds chunks ``i`` and ``2 * cp - 1 - i``, concatenated in that order, so
each rank holds ``S / cp`` tokens and, under a causal mask, the same amount of attention work. Every rank also holds
``positions``, the global position of each of its tokens (:func:`load_balanced_positions`); the attention below works
from those positions and assumes no order: a query at position ``p`` attends to keys at positions ``<= p`` when causal.

* :func:`ring_attention` (Liu et al. 2023, §3): K/V blocks travel around the cp ring; each rank merges the partial
  attention of its queries against every block with the log-sum-exp (online softmax).
* :func:`ulysses_attention` (Jacobs et al. 2023, §3): an all-to-all trades the sequence split for a head split, full
  attention runs on ``heads / cp`` heads, and a second all-to-all trades back.
* :class:`CPAttentionMode` routes ``F.scaled_dot_product_attention`` calls of an unchanged model to either.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = [
    "COMM_BYTES_SENT",
    "CP_ATTENTION_METHODS",
    "CPAttentionMode",
    "check_ulysses_heads",
    "gather_sequence",
    "load_balanced_positions",
    "ring_attention",
    "split_sequence",
    "ulysses_attention",
]


# --------------------------------------------------------------------------------------------------------------------
# Layout


def _check_seq_len(seq_len: int, cp_size: int) -> None:
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(
            f"seq_len={seq_len} is not divisible by 2 * cp_size = {2 * cp_size}: causal load balancing cuts the "
            "sequence into 2 * cp_size equal chunks"
        )


def _rank_chunks(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunk indices (of ``2 * cp_size``) that cp rank ``cp_rank`` holds, in its local order."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} is outside [0, cp_size={cp_size})")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def split_sequence(t: Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> Tensor:
    """This cp rank's share of a full-sequence tensor: chunks ``cp_rank`` and ``2 * cp_size - 1 - cp_rank``.

    Args:
        t: a tensor holding the whole sequence along ``dim``, e.g. token ids ``(batch, seq)`` or
            ``(batch, heads, seq, head_dim)`` with ``dim=2``.
        cp_rank: this rank's index in the cp group.
        cp_size: the cp group size.
        dim: the sequence dimension.

    Returns:
        ``t`` with ``seq / cp_size`` tokens along ``dim``: the two chunks concatenated in that order.

    Raises:
        ValueError: the sequence length is not divisible by ``2 * cp_size``.
    """
    _check_seq_len(t.size(dim), cp_size)
    chunks = t.chunk(2 * cp_size, dim=dim)
    first, second = _rank_chunks(cp_rank, cp_size)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def load_balanced_positions(seq_len: int, cp_rank: int, cp_size: int) -> Tensor:
    """The global positions of the tokens cp rank ``cp_rank`` holds, in its local order.

    For ``cp_size=2, seq_len=8``: rank 0 holds ``[0, 1, 6, 7]``, rank 1 ``[2, 3, 4, 5]``.

    Returns:
        A LongTensor of shape ``(seq_len / cp_size,)``.

    Raises:
        ValueError: ``seq_len`` is not divisible by ``2 * cp_size``.
    """
    _check_seq_len(seq_len, cp_size)
    return split_sequence(torch.arange(seq_len), cp_rank, cp_size, dim=0)


def gather_sequence(t_local: Tensor, group: dist.ProcessGroup | None, cp_size: int, dim: int = 1) -> Tensor:
    """The inverse of :func:`split_sequence`: all-gather every cp rank's share and put the chunks in global order.

    For tests and for gathering outputs; it does not propagate gradients.

    Args:
        t_local: this rank's share, ``seq / cp_size`` tokens along ``dim`` (the same shape on every rank).
        group: the cp process group (``None``: the default group).
        cp_size: the cp group size (checked against ``group``).
        dim: the sequence dimension.

    Returns:
        The whole sequence along ``dim``, on every rank.
    """
    if dist.get_world_size(group) != cp_size:
        raise ValueError(f"cp_size={cp_size} but the group has {dist.get_world_size(group)} ranks")
    shares = [torch.empty_like(t_local) for _ in range(cp_size)]
    dist.all_gather(shares, t_local.contiguous(), group=group)
    chunks: list[Tensor | None] = [None] * (2 * cp_size)
    for rank, share in enumerate(shares):
        first, second = _rank_chunks(rank, cp_size)
        chunks[first], chunks[second] = share.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------------------------
# Collectives


#: Bytes this process's cp exchanges (every all-to-all below: the ring's K/V shifts, Ulysses' two trades, and their
#: backward) have sent to other ranks, ``"forward"`` and ``"backward"``: the rows addressed to itself are not counted.
#: A plain count (no synchronisation, no tensor work); ``lightning_par.benchmarks.context_parallel`` resets and reads
#: it. The positions' all-gather (integers, no gradient) is not counted.
COMM_BYTES_SENT: dict[str, int] = {"forward": 0, "backward": 0}


def _count_sent(phase: str, x: Tensor, in_splits: list[int] | None, group: dist.ProcessGroup | None) -> None:
    """Add to :data:`COMM_BYTES_SENT` the bytes of ``x`` (split along dim 0 by ``in_splits``, or evenly) that an
    all-to-all sends to the other ranks of ``group``."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    row_bytes = x[0].numel() * x.element_size() if x.size(0) else 0
    rows = x.size(0) - (in_splits[rank] if in_splits is not None else x.size(0) // n)
    COMM_BYTES_SENT[phase] += rows * row_bytes


class _AllToAllSingle(torch.autograd.Function):
    """``dist.all_to_all_single`` along dim 0 whose backward is the same exchange reversed.

    Our own rather than ``torch.distributed.nn.functional.all_to_all_single``, which does the same but is deprecated
    (a ``FutureWarning`` on every call in torch 2.13) in favour of a private module.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x: Tensor, out_splits: list[int] | None, in_splits: list[int] | None, group: dist.ProcessGroup | None
    ) -> Tensor:
        ctx.in_shape, ctx.out_splits, ctx.in_splits, ctx.group = x.shape, out_splits, in_splits, group
        rows = sum(out_splits) if out_splits is not None else x.size(0)
        out = x.new_empty((rows, *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        _count_sent("forward", x, in_splits, group)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        grad_in = grad.new_empty(ctx.in_shape)
        dist.all_to_all_single(grad_in, grad.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        _count_sent("backward", grad, ctx.out_splits, ctx.group)
        return grad_in, None, None, None


def _ring_shift(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Send ``x`` whole to the next cp rank and return the previous rank's; the backward sends gradients back.

    An all-to-all with one non-empty split each way (gloo supports uneven splits), so that autograd carries it.
    """
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    in_splits, out_splits = [0] * n, [0] * n
    in_splits[(rank + 1) % n] = 1
    out_splits[(rank - 1) % n] = 1
    return _AllToAllSingle.apply(x.unsqueeze(0), out_splits, in_splits, group).squeeze(0)


def _all_gather_positions(positions: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Every cp rank's positions, ``(cp, seq_local)`` in rank order. Integers: no gradient to carry."""
    parts = [torch.empty_like(positions) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, positions.contiguous(), group=group)
    return torch.stack(parts)


def _causal_mask(q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """``mask[i, j]``: query ``i`` may attend key ``j`` (``k_pos[j] <= q_pos[i]``); ``(len(q_pos), len(k_pos))``."""
    return k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)


# --------------------------------------------------------------------------------------------------------------------
# Ring attention


def _block_attention(
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, is_causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """Attention of the local queries against one K/V block, normalised within the block, and its log-sum-exp.

    Args:
        q: ``(batch, heads, seq_q, head_dim)``.
        k: ``(batch, heads, seq_k, head_dim)``.
        v: ``(batch, heads, seq_k, head_dim_v)``.
        q_pos: ``(seq_q,)`` global positions of the queries.
        k_pos: ``(seq_k,)`` global positions of the keys.

    Returns:
        ``(out, lse)``: ``out`` of shape ``(batch, heads, seq_q, head_dim_v)`` and ``lse`` of shape
        ``(batch, heads, seq_q)``; ``lse`` is ``-inf`` on rows with no allowed key (their ``out`` is finite but
        meaningless, and the merge gives it weight 0).
    """
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if is_causal:
        allowed = _causal_mask(q_pos, k_pos)
        has_key = allowed.any(dim=-1)
        # A row of only -inf would make logsumexp's backward 0 * nan; fully masked rows keep their finite scores and
        # are dropped through lse = -inf instead.
        scores = scores.masked_fill(~allowed & has_key.unsqueeze(-1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v)
    if is_causal:
        lse = lse.masked_fill(~has_key, float("-inf"))
    return out, lse


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Online-softmax merge of two partial attentions (Milakov & Gimelshein 2018; FlashAttention's rescaling).

    ``lse`` must be finite (the running result always holds the local block, where every query sees itself);
    ``block_lse`` may be ``-inf``, which gives the block weight 0.
    """
    new_lse = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(lse - new_lse).unsqueeze(-1) + block_out * torch.exp(block_lse - new_lse).unsqueeze(-1)
    return out, new_lse


def _default_scale(q: Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.size(-1)) if scale is None else scale


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    positions: Tensor,
    group: dist.ProcessGroup | None,
    *,
    is_causal: bool = True,
    scale: float | None = None,
) -> Tensor:
    """Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers", §3) over the cp group.

    Each rank starts with its own K/V block, then passes the block it holds to the next rank ``(r + 1) % cp`` and
    receives the previous rank's, ``cp - 1`` times, so that its queries meet every block once. The partial attention
    against each block is merged into the running output with the log-sum-exp (online softmax; Milakov & Gimelshein
    2018). The local block comes first, so every query's running log-sum-exp is finite (it sees at least itself),
    and a query that may see no key of a visiting block gives that block weight 0 instead of a NaN. The masks come
    from ``positions`` (all-gathered once: they are small and need no gradient), not from an assumed order.

    Backward: autograd, through the ring exchange's own backward, which sends each visiting block's K/V gradient
    back one hop per step in the reverse direction, so that it arrives, summed, at the rank that owns the block
    (the paper's backward pass, which passes dK/dV around the ring). Memory: autograd keeps, for each of the ``cp``
    steps, the block's scores and probabilities, ``(batch, heads, S_local, S_local)`` each, i.e. ``S_local x S`` per
    rank in total against ``S x S`` for one process, plus every visiting K/V block (the whole sequence's K and V per
    rank). The exchanges are blocking: communication is not overlapped with the block computation as in the paper.

    Args:
        q: ``(batch, heads, S_local, head_dim)``, this rank's queries.
        k: ``(batch, heads, S_local, head_dim)``.
        v: ``(batch, heads, S_local, head_dim_v)``.
        positions: ``(S_local,)`` LongTensor, the global position of each local token (same ``S_local`` on every rank).
        group: the cp process group (``None``: the default group).
        is_causal: a query at position ``p`` attends to keys at positions ``<= p``; otherwise to every key.
        scale: the softmax scale; ``None``: ``1 / sqrt(head_dim)``, as ``F.scaled_dot_product_attention``.

    Returns:
        ``(batch, heads, S_local, head_dim_v)``, the attention output for the local queries, in ``q``'s dtype.
    """
    scale = _default_scale(q, scale)
    # Merge in at least float32: the log-sum-exp rescaling loses too much in half precision.
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    out, lse = _block_attention(q, k, v, positions, positions, is_causal, scale)
    out, lse = out.to(acc_dtype), lse.to(acc_dtype)
    n = dist.get_world_size(group)
    if n > 1:
        all_positions = _all_gather_positions(positions, group)
        rank = dist.get_rank(group)
        # K and V travel as one tensor: one exchange a step instead of two.
        kv = torch.cat([k, v], dim=-1)
        for step in range(1, n):
            kv = _ring_shift(kv, group)
            k_blk, v_blk = kv.split([k.size(-1), v.size(-1)], dim=-1)
            k_pos = all_positions[(rank - step) % n]  # the block that started on rank r - step
            blk_out, blk_lse = _block_attention(q, k_blk, v_blk, positions, k_pos, is_causal, scale)
            out, lse = _merge(out, lse, blk_out.to(acc_dtype), blk_lse.to(acc_dtype))
    return out.to(q.dtype)


# --------------------------------------------------------------------------------------------------------------------
# Ulysses


def check_ulysses_heads(n_head: int, cp_size: int, tp_size: int = 1) -> None:
    """Raise unless Ulysses can split the heads: each cp rank of each tp rank takes ``n_head / (cp * tp)`` heads.

    Args:
        n_head: the model's attention heads (all of them, before tensor parallelism splits them).
        cp_size: the cp group size.
        tp_size: the tp group size (``1``: ``n_head`` are the heads one rank holds).

    Raises:
        ValueError: ``n_head`` is not divisible by ``cp_size * tp_size``.
    """
    if n_head % (cp_size * tp_size) != 0:
        raise ValueError(
            f"Ulysses (all_to_all) context parallelism splits the heads over cp x tp ranks: n_head={n_head} is not "
            f"divisible by cp_size * tp_size = {cp_size} * {tp_size}; use ring attention or change the sizes"
        )


def _seq_to_heads(x: Tensor, group: dist.ProcessGroup | None, n: int) -> Tensor:
    """``(batch, heads, S_local, d)`` -> ``(batch, heads / n, n * S_local, d)``: every rank's tokens, in rank order,
    for this rank's slice of the heads."""
    b, h, s, d = x.shape
    send = x.reshape(b, n, h // n, s, d).transpose(0, 1)  # send[j]: the heads rank j will hold
    recv = _AllToAllSingle.apply(send, None, None, group)  # recv[i]: rank i's tokens for our heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _heads_to_seq(x: Tensor, group: dist.ProcessGroup | None, n: int) -> Tensor:
    """The inverse of :func:`_seq_to_heads`: ``(batch, heads / n, n * S_local, d)`` -> ``(batch, heads, S_local, d)``.
    """
    b, hn, ns, d = x.shape
    send = x.reshape(b, hn, n, ns // n, d).permute(2, 0, 1, 3, 4)  # send[i]: rank i's tokens
    recv = _AllToAllSingle.apply(send, None, None, group)  # recv[j]: our tokens for rank j's heads
    return recv.transpose(0, 1).reshape(b, n * hn, ns // n, d)


def ulysses_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    positions: Tensor,
    group: dist.ProcessGroup | None,
    *,
    is_causal: bool = True,
    scale: float | None = None,
) -> Tensor:
    """DeepSpeed-Ulysses attention (Jacobs et al. 2023, §3) over the cp group.

    An all-to-all gives each rank every token (every cp rank's, in rank order) for ``heads / cp`` of the heads; the
    positions are all-gathered (no gradient) to build the mask, since the gathered sequence is in rank order, not in
    position order; ``F.scaled_dot_product_attention`` runs over the whole sequence for those heads; a second
    all-to-all returns ``(batch, heads, S_local, head_dim)``. Gradients flow through both all-to-alls (their
    backward is the reverse exchange). Memory per rank: the ``(batch, heads / cp, S, S)`` attention of its heads (or
    less, with a fused SDPA kernel).

    Args:
        q: ``(batch, heads, S_local, head_dim)``.
        k: ``(batch, heads, S_local, head_dim)``.
        v: ``(batch, heads, S_local, head_dim_v)``.
        positions: ``(S_local,)`` LongTensor, the global position of each local token (same ``S_local`` on every rank).
        group: the cp process group (``None``: the default group).
        is_causal: a query at position ``p`` attends to keys at positions ``<= p``; otherwise to every key.
        scale: the softmax scale; ``None``: ``1 / sqrt(head_dim)``.

    Returns:
        ``(batch, heads, S_local, head_dim_v)``.

    Raises:
        ValueError: ``heads`` is not divisible by the cp size.
    """
    n = dist.get_world_size(group)
    check_ulysses_heads(q.size(1), n)
    if n == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
    # q, k and v travel as one tensor (one all-to-all instead of three); v's head_dim may differ.
    dims = [q.size(-1), k.size(-1), v.size(-1)]
    q_full, k_full, v_full = _seq_to_heads(torch.cat([q, k, v], dim=-1), group, n).split(dims, dim=-1)
    mask = None
    if is_causal:
        all_positions = _all_gather_positions(positions, group).reshape(-1)
        mask = _causal_mask(all_positions, all_positions)
    out = F.scaled_dot_product_attention(q_full, k_full, v_full, attn_mask=mask, scale=scale)
    return _heads_to_seq(out, group, n)


# --------------------------------------------------------------------------------------------------------------------
# Routing F.scaled_dot_product_attention

#: ``method`` name -> attention function, as :class:`CPAttentionMode` takes it.
CP_ATTENTION_METHODS: dict[str, Callable[..., Tensor]] = {"ring": ring_attention, "all_to_all": ulysses_attention}


class CPAttentionMode(TorchFunctionMode):
    """While active, ``F.scaled_dot_product_attention`` runs as context-parallel attention over ``group``.

    A model written for one process keeps calling ``F.scaled_dot_product_attention(q, k, v, is_causal=...)`` on its
    local tokens; this mode hands the call to :func:`ring_attention` or :func:`ulysses_attention` with the local
    ``positions``. Every other torch function passes through unchanged. Update :attr:`positions` per step when the
    sequence length changes.

    Args:
        method: ``"ring"`` or ``"all_to_all"`` (Ulysses).
        group: the cp process group.
        positions: ``(S_local,)`` LongTensor, the global positions of the local tokens.

    Raises:
        ValueError: an unknown ``method``; on a call, an ``attn_mask`` or ``dropout_p > 0``.
    """

    def __init__(self, method: str, group: dist.ProcessGroup | None, positions: Tensor) -> None:
        super().__init__()
        if method not in CP_ATTENTION_METHODS:
            raise ValueError(f"method={method!r}: expected one of {sorted(CP_ATTENTION_METHODS)}")
        self.method = method
        self.group = group
        self.positions = positions

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self._attention(*args, **kwargs)
        return func(*args, **kwargs)

    def _attention(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Tensor:
        # F.scaled_dot_product_attention's signature, so that positional and keyword calls bind alike.
        if attn_mask is not None:
            raise ValueError(
                "attn_mask is not supported under context parallelism: the mask comes from the token positions "
                "(pass is_causal=True for a causal mask)"
            )
        if dropout_p > 0:
            raise ValueError(f"dropout_p={dropout_p}: set attention dropout to 0 under context parallelism")
        if enable_gqa and key.size(-3) != query.size(-3):
            # Grouped-query attention: each K/V head serves query.size(-3) / key.size(-3) query heads.
            groups = query.size(-3) // key.size(-3)
            key, value = key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)
        attend = CP_ATTENTION_METHODS[self.method]
        return attend(query, key, value, self.positions, self.group, is_causal=is_causal, scale=scale)
