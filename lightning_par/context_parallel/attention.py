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

Memory: in the load-balanced layout neither builds an ``S x S`` (or ``S_local x S_local``) tensor on CPU: the ring
runs each block in torch's fused kernel and recomputes in backward, Ulysses runs the fused kernel with
``is_causal=True`` on the gathered tokens put in position order. Each rank then keeps for backward about ``1 / cp``
of what one process keeps (``lightning_par.benchmarks.context_parallel`` measures it).
"""

from __future__ import annotations

import functools

import math
from collections.abc import Callable, Generator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_par.compat import current_function_mode_stack, flash_attention_cpu, flash_attention_cpu_backward
from lightning_par.context_parallel import sequence
from lightning_par.step_context import StepToken, StepVar

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


#: Bytes this process's cp exchanges (every all-to-all below: the ring's K/V and dK/dV shifts, Ulysses' two trades,
#: and their backward) have sent to other ranks, ``"forward"`` and ``"backward"``: the rows addressed to itself are
#: not counted. A plain count (no synchronisation, no tensor work); ``lightning_par.benchmarks.context_parallel``
#: resets and reads it. The positions' all-gather (integers, no gradient) is not counted.
COMM_BYTES_SENT: dict[str, int] = {"forward": 0, "backward": 0}


def _count_sent(phase: str, x: Tensor, in_splits: list[int] | None, group: dist.ProcessGroup | None) -> None:
    """Add to :data:`COMM_BYTES_SENT` the bytes of ``x`` (split along dim 0 by ``in_splits``, or evenly) that an
    all-to-all sends to the other ranks of ``group``."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    row_bytes = x[0].numel() * x.element_size() if x.size(0) else 0
    rows = x.size(0) - (in_splits[rank] if in_splits is not None else x.size(0) // n)
    COMM_BYTES_SENT[phase] += rows * row_bytes


def _all_to_all(
    x: Tensor, out_splits: list[int] | None, in_splits: list[int] | None, group: dist.ProcessGroup | None, phase: str
) -> Tensor:
    """``dist.all_to_all_single`` along dim 0 into a new tensor, counted in :data:`COMM_BYTES_SENT` under ``phase``."""
    rows = sum(out_splits) if out_splits is not None else x.size(0)
    out = x.new_empty((rows, *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    _count_sent(phase, x, in_splits, group)
    return out


class _AllToAllSingle(torch.autograd.Function):
    """``dist.all_to_all_single`` along dim 0 whose backward is the same exchange reversed.

    Our own rather than ``torch.distributed.nn.functional.all_to_all_single``, which does the same but is deprecated
    (a ``FutureWarning`` on every call in torch 2.13) in favour of a private module.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x: Tensor, out_splits: list[int] | None, in_splits: list[int] | None, group: dist.ProcessGroup | None
    ) -> Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _all_to_all(x, out_splits, in_splits, group, "forward")

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        return _all_to_all(grad, ctx.in_splits, ctx.out_splits, ctx.group, "backward"), None, None, None


def _ring_shift(x: Tensor, group: dist.ProcessGroup | None, phase: str) -> Tensor:
    """Send ``x`` whole to the next cp rank and return the previous rank's (no autograd: the ring attention's own
    backward sends what it needs).

    An all-to-all with one non-empty split each way (gloo supports uneven splits).
    """
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    in_splits, out_splits = [0] * n, [0] * n
    in_splits[(rank + 1) % n] = 1
    out_splits[(rank - 1) % n] = 1
    return _all_to_all(x.unsqueeze(0), out_splits, in_splits, group, phase).squeeze(0)


def _all_gather_positions(positions: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Every cp rank's positions, ``(cp, seq_local)`` in rank order. Integers: no gradient to carry."""
    parts = [torch.empty_like(positions) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, positions.contiguous(), group=group)
    return torch.stack(parts)


def _causal_mask(q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """``mask[i, j]``: query ``i`` may attend key ``j`` (``k_pos[j] <= q_pos[i]``); ``(len(q_pos), len(k_pos))``."""
    return k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)


def _strictly_increasing(pos: Tensor) -> bool:
    return bool((pos[1:] > pos[:-1]).all())


# --------------------------------------------------------------------------------------------------------------------
# Ring attention

#: A piece of a (local queries x one K/V block) attention: query rows, key rows, and its mask: ``"full"`` (every
#: query sees every key), ``"causal"`` (the same strictly increasing positions on both sides: the lower triangle) or
#: ``"mask"`` (anything else: an explicit mask from the positions).
_Piece = tuple[slice, slice, str]


def _pieces(q_pos: Sequence[int] | Tensor, k_pos: Sequence[int] | Tensor, is_causal: bool) -> list[_Piece]:
    """The pieces that cover every (query, key) pair a query may attend in one block, none of the others.

    Without a causal mask: the whole block, ``"full"``. With it, from the positions (no order assumed): the block
    whole if its mask is all true (``"full"``), empty (no piece) or the lower triangle (``"causal"``); else the
    queries are cut in two halves, then the keys, and each part tried again; what is still mixed is a ``"mask"``
    piece. Under the load-balanced layout (each rank holds chunks ``i`` and ``2 cp - 1 - i``) the own block is one
    ``"causal"`` piece and every other block one or two ``"full"`` pieces: no mask is ever built.

    The positions are host lists (the ring's forward reads them in one ``.tolist()``): deciding on device tensors
    read each block's minima and maxima to the host, 14 to 28 reads per layer at cp 2 (measured with the CPU stand-in
    of ``tests/profiling/test_host_reads.py``).
    """
    q_pos, k_pos = (p.tolist() if isinstance(p, Tensor) else p for p in (q_pos, k_pos))
    sq, sk = len(q_pos), len(k_pos)
    if not is_causal:
        return [(slice(0, sq), slice(0, sk), "full")]

    def cover(qs: slice, ks: slice, cut_q: bool, cut_k: bool) -> list[_Piece]:
        qp, kp = q_pos[qs], k_pos[ks]
        if max(kp) <= min(qp):
            return [(qs, ks, "full")]
        if min(kp) > max(qp):
            return []
        if len(qp) == len(kp) and list(qp) == list(kp) and all(a < b for a, b in zip(qp, qp[1:])):
            return [(qs, ks, "causal")]
        if cut_q and len(qp) > 1:
            mid = qs.start + len(qp) // 2
            return cover(slice(qs.start, mid), ks, False, cut_k) + cover(slice(mid, qs.stop), ks, False, cut_k)
        if cut_k and len(kp) > 1:
            mid = ks.start + len(kp) // 2
            return cover(qs, slice(ks.start, mid), False, False) + cover(qs, slice(mid, ks.stop), False, False)
        return [(qs, ks, "mask")]

    return cover(slice(0, sq), slice(0, sk), True, True)


def _finite(lse: Tensor) -> Tensor:
    """``lse`` with ``-inf`` (a row that sees no key) as 0, to subtract without NaNs."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def _scores(q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, kind: str, scale: float, acc: torch.dtype,
            mask: Tensor | None = None) -> Tensor:
    """Scaled scores of a piece, ``-inf`` where its mask is false: ``mask`` (a document mask ``(batch, 1, sq, sk)``)
    when given, else the causal mask of the positions."""
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-2, -1)) * scale
    if kind != "full":
        scores = scores.masked_fill(~(_causal_mask(q_pos, k_pos) if mask is None else mask), float("-inf"))
    return scores


def _piece_forward(
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, kind: str, scale: float, acc: torch.dtype,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of one piece, in ``acc``; ``lse`` is ``-inf`` on rows that see no key of the piece.

    On CPU, ``"full"`` and ``"causal"`` pieces run in torch's fused kernel (no ``seq_q x seq_k`` tensor); a
    ``"mask"`` piece, or another device, in plain operators that hold the piece's scores while they run.
    """
    if kind != "mask" and q.device.type == "cpu":
        out, lse = flash_attention_cpu(q, k, v, kind == "causal", scale)
        return out.to(acc), lse.to(acc)
    scores = _scores(q, k, q_pos, k_pos, kind, scale, acc, mask)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - _finite(lse).unsqueeze(-1)), v.to(acc))
    return out, lse


def _piece_backward(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, q_pos: Tensor, k_pos: Tensor,
    kind: str, scale: float, mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """One piece's share of the gradients of ``q``, ``k`` and ``v``, from the whole rows' ``out`` and ``lse`` (all
    blocks merged): FlashAttention's backward per block, ``dS = P (dP - rowsum(dO * O))`` with
    ``P = exp(S - lse)`` (Dao et al. 2022, Algorithm 4)."""
    if kind != "mask" and q.device.type == "cpu":
        return flash_attention_cpu_backward(grad_out, q, k, v, out, lse, kind == "causal", scale)
    acc = lse.dtype
    p = torch.exp(_scores(q, k, q_pos, k_pos, kind, scale, acc, mask) - _finite(lse).unsqueeze(-1))
    do = grad_out.to(acc)
    grad_v = torch.matmul(p.transpose(-2, -1), do)
    dp = torch.matmul(do, v.to(acc).transpose(-2, -1))
    ds = p * (dp - (do * out.to(acc)).sum(dim=-1, keepdim=True))
    return torch.matmul(ds, k.to(acc)) * scale, torch.matmul(ds.transpose(-2, -1), q.to(acc)) * scale, grad_v


def _merge(out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Online-softmax merge of two partial attentions (Milakov & Gimelshein 2018; FlashAttention's rescaling).

    Either ``lse`` may be ``-inf`` (rows that have seen no key yet, or see none in the block): such a side gets
    weight 0, and a row with both ``-inf`` stays ``(0, -inf)``.
    """
    new_lse = torch.logaddexp(lse, block_lse)
    ref = _finite(new_lse).unsqueeze(-1)
    out = out * torch.exp(lse.unsqueeze(-1) - ref) + block_out * torch.exp(block_lse.unsqueeze(-1) - ref)
    return out, new_lse


def _default_scale(q: Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.size(-1)) if scale is None else scale


class _RingAttention(torch.autograd.Function):
    """Ring attention with its own backward: it keeps ``q``, ``k``, ``v``, the output and the log-sum-exp of the
    local queries (what one process's fused attention keeps), and passes the K/V blocks around the ring again in
    backward, each with the sum of its dK/dV so far (Liu et al. 2023, §3)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, q: Tensor, k: Tensor, v: Tensor, positions: Tensor, group: dist.ProcessGroup | None, is_causal: bool,
        scale: float, documents: Tensor | None = None,
    ) -> Tensor:
        n, rank = dist.get_world_size(group), dist.get_rank(group)
        all_positions = _all_gather_positions(positions, group) if is_causal and n > 1 else None
        # The block a rank holds at step s started on rank r - s; its keys' positions decide the pieces (without a
        # causal mask only their number does, the same on every rank).
        k_positions = [positions if s == 0 or all_positions is None else all_positions[(rank - s) % n]
                       for s in range(n)]
        # the pieces are decided on the host: every block's positions in one read (none without a causal mask)
        host = ([p.tolist() for p in k_positions] if all_positions is None else all_positions.tolist()) if is_causal \
            else [range(positions.numel())] * n
        own = host[0] if all_positions is None else host[rank]
        plans = [_pieces(own, host[s] if all_positions is None else host[(rank - s) % n], is_causal) for s in range(n)]
        masks: list[Tensor | None] = [None] * n
        if documents is not None:  # packed documents: one masked piece per block that any query may see, or none
            all_documents = _all_gather_positions(documents, group) if n > 1 else documents.unsqueeze(0)
            for s in range(n):
                block_docs = documents if s == 0 else all_documents[(rank - s) % n]
                masks[s] = _document_block_mask(documents, block_docs, positions, k_positions[s], is_causal)
                plans[s] = [(slice(0, q.size(2)), slice(0, k.size(2)), "mask")] if bool(masks[s].any()) else []
        # Merge in at least float32: the log-sum-exp rescaling loses too much in half precision.
        acc = torch.promote_types(q.dtype, torch.float32)
        # (batch, seq, heads, head_dim) in memory, as the fused kernel lays its output out: a model's usual
        # out.transpose(1, 2).reshape(batch, seq, -1) is then a view, and the next layer keeps no second copy.
        b, h, sq = q.shape[:3]
        out = q.new_zeros((b, sq, h, v.size(-1)), dtype=acc).transpose(1, 2)
        lse = q.new_full(q.shape[:-1], float("-inf"), dtype=acc)
        kv = torch.cat([k, v], dim=-1)  # K and V travel as one tensor: one exchange a step instead of two
        for s in range(n):
            if s:
                kv = _ring_shift(kv, group, "forward")
            k_blk, v_blk = kv.split([k.size(-1), v.size(-1)], dim=-1)
            for qs, ks, kind in plans[s]:
                part = _piece_forward(q[:, :, qs], k_blk[:, :, ks], v_blk[:, :, ks], positions[qs],
                                      k_positions[s][ks], kind, scale, acc, masks[s])
                out[:, :, qs], lse[:, :, qs] = _merge(out[:, :, qs], lse[:, :, qs], *part)
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.plans, ctx.positions, ctx.k_positions, ctx.masks = plans, positions, k_positions, masks
        ctx.group, ctx.scale = group, scale
        return result

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        group, n = ctx.group, dist.get_world_size(ctx.group)
        dk_width = k.size(-1)
        grad_q = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)

        def block_grads(s: int, kv: Tensor) -> Tensor:
            """Add the local queries' gradient against the block held at step ``s``; return the block's dK/dV."""
            k_blk, v_blk = kv.split([dk_width, kv.size(-1) - dk_width], dim=-1)
            grad_kv = torch.zeros(kv.shape, dtype=lse.dtype, device=kv.device)
            for qs, ks, kind in ctx.plans[s]:
                gq, gk, gv = _piece_backward(grad_out[:, :, qs], q[:, :, qs], k_blk[:, :, ks], v_blk[:, :, ks],
                                             out[:, :, qs], lse[:, :, qs], ctx.positions[qs], ctx.k_positions[s][ks],
                                             kind, ctx.scale, ctx.masks[s])
                grad_q[:, :, qs] += gq
                grad_kv[:, :, ks, :dk_width] += gk
                grad_kv[:, :, ks, dk_width:] += gv
            return grad_kv

        # The visiting blocks first, then the own block. The dK/dV of block j starts on rank j + 1 and travels with
        # the block (one exchange a step carries both), summing each rank's share; after the last step, rank j - 1
        # sends it home: 2 (cp - 1) K/V-sized sends in all.
        kv = torch.cat([k, v], dim=-1)
        carried: Tensor | None = None
        for s in range(1, n):
            if carried is None:
                kv = _ring_shift(kv, group, "backward")
            else:
                kv, carried = _ring_shift(torch.cat([kv, carried], dim=-1), group, "backward").chunk(2, dim=-1)
            share = block_grads(s, kv)
            carried = (share if carried is None else carried + share).to(kv.dtype)
        grad_kv = block_grads(0, torch.cat([k, v], dim=-1))
        if carried is not None:
            grad_kv = grad_kv + _ring_shift(carried, group, "backward")
        grad_k, grad_v = grad_kv.split([dk_width, grad_kv.size(-1) - dk_width], dim=-1)
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None, None, None


def _document_block_mask(documents: Tensor, block_documents: Tensor, q_pos: Tensor, k_pos: Tensor,
                         is_causal: bool) -> Tensor:
    """``(batch, 1, sq, sk)``: query may attend key (same document, and not later when causal)."""
    same = (documents.unsqueeze(-1) == block_documents.unsqueeze(-2)).unsqueeze(1)
    return same & _causal_mask(q_pos, k_pos) if is_causal else same


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    positions: Tensor,
    group: dist.ProcessGroup | None,
    *,
    is_causal: bool = True,
    scale: float | None = None,
    documents: Tensor | None = None,
) -> Tensor:
    """Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers", §3) over the cp group.

    Each rank starts with its own K/V block, then passes the block it holds to the next rank ``(r + 1) % cp`` and
    receives the previous rank's, ``cp - 1`` times, so that its queries meet every block once. The partial attention
    against each block is merged into the running output with the log-sum-exp (online softmax; Milakov & Gimelshein
    2018). The masks come from ``positions`` (all-gathered once: they are small and need no gradient), not from an
    assumed order: each block is cut into pieces whose mask is all true or the lower triangle (:func:`_pieces`;
    under the load-balanced layout that is every piece), which run in torch's fused CPU kernel; any other piece
    runs in plain operators with an explicit mask.

    Backward (a custom autograd function, as in the paper): the K/V blocks go around the ring again, and each
    block's dK/dV travels with it, summing every rank's share, until it is sent home; each rank recomputes its
    queries' attention against the block it holds from the saved output and log-sum-exp (FlashAttention's
    backward). Memory: per rank, what one process's fused attention keeps for its tokens (``q``, ``k``, ``v``, the
    output and the log-sum-exp, ``S / cp`` tokens each), no ``S x S`` tensor on CPU and no visiting block kept.
    Communication per rank: ``cp - 1`` K/V blocks forward, ``2 (cp - 1)`` backward (K/V again, and dK/dV). The
    exchanges are blocking: communication is not overlapped with the block computation as in the paper.

    Args:
        q: ``(batch, heads, S_local, head_dim)``, this rank's queries.
        k: ``(batch, heads, S_local, head_dim)``.
        v: ``(batch, heads, S_local, head_dim_v)``.
        positions: ``(S_local,)`` LongTensor, the global position of each local token (same ``S_local`` on every rank).
        group: the cp process group (``None``: the default group).
        is_causal: a query at position ``p`` attends to keys at positions ``<= p``; otherwise to every key.
        scale: the softmax scale; ``None``: ``1 / sqrt(head_dim)``, as ``F.scaled_dot_product_attention``.
        documents: ``(batch, S_local)`` document ids of the local tokens (packed documents,
            :mod:`lightning_par.data.doc_mask`): a query attends only keys of its own document. Each block then runs
            as one masked piece in plain operators (its ``(batch, 1, S_local, S_local)`` mask kept for backward), and a
            block no local query may see is skipped. ``None``: no document boundaries.

    Returns:
        ``(batch, heads, S_local, head_dim_v)``, the attention output for the local queries, in ``q``'s dtype.
    """
    return _RingAttention.apply(q, k, v, positions, group, is_causal, _default_scale(q, scale), documents)


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
    documents: Tensor | None = None,
) -> Tensor:
    """DeepSpeed-Ulysses attention (Jacobs et al. 2023, §3) over the cp group.

    An all-to-all gives each rank every token (every cp rank's, in rank order) for ``heads / cp`` of the heads; the
    positions are all-gathered (no gradient). The gathered tokens are put in position order, so that
    ``F.scaled_dot_product_attention`` runs with ``is_causal=True`` and no mask over the whole sequence for those
    heads, then back in rank order, and a second all-to-all returns ``(batch, heads, S_local, head_dim)``. Positions
    that are not all distinct (no such order) fall back to an explicit ``S x S`` mask. Gradients flow through both
    all-to-alls (their backward is the reverse exchange). Memory per rank: what one process's fused attention keeps
    for ``S`` tokens and ``heads / cp`` heads.

    Args:
        q: ``(batch, heads, S_local, head_dim)``.
        k: ``(batch, heads, S_local, head_dim)``.
        v: ``(batch, heads, S_local, head_dim_v)``.
        positions: ``(S_local,)`` LongTensor, the global position of each local token (same ``S_local`` on every rank).
        group: the cp process group (``None``: the default group).
        is_causal: a query at position ``p`` attends to keys at positions ``<= p``; otherwise to every key.
        scale: the softmax scale; ``None``: ``1 / sqrt(head_dim)``.
        documents: ``(batch, S_local)`` document ids of the local tokens (packed documents): they are all-gathered
            too and the whole sequence's attention runs with the mask ``causal & same document``
            ``(batch, 1, S, S)``. ``None``: no document boundaries.

    Returns:
        ``(batch, heads, S_local, head_dim_v)``.

    Raises:
        ValueError: ``heads`` is not divisible by the cp size.
    """
    n = dist.get_world_size(group)
    check_ulysses_heads(q.size(1), n)
    if n == 1 and documents is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
    if documents is not None:
        return _ulysses_documents(q, k, v, positions, group, n, is_causal, scale, documents)
    # q, k and v travel as one tensor (one all-to-all instead of three); v's head_dim may differ.
    dims = [q.size(-1), k.size(-1), v.size(-1)]
    qkv = _seq_to_heads(torch.cat([q, k, v], dim=-1), group, n)
    mask, order = None, None
    if is_causal:
        all_positions = _all_gather_positions(positions, group).reshape(-1)
        order = torch.argsort(all_positions)
        if _strictly_increasing(all_positions[order]):
            qkv = qkv.index_select(2, order)  # in position order the causal mask is the lower triangle
        else:
            order, mask = None, _causal_mask(all_positions, all_positions)
    q_full, k_full, v_full = qkv.split(dims, dim=-1)
    out = F.scaled_dot_product_attention(q_full, k_full, v_full, attn_mask=mask, is_causal=order is not None,
                                         scale=scale)
    if order is not None:
        out = out.index_select(2, torch.argsort(order))  # back to rank order
    return _heads_to_seq(out, group, n)

def _ulysses_documents(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, group: dist.ProcessGroup | None, n: int,
                       is_causal: bool, scale: float | None, documents: Tensor) -> Tensor:
    """:func:`ulysses_attention` over packed documents: the gathered sequence (rank order) attends with the mask
    ``same document (& causal by global position)``, ``(batch, 1, S, S)``."""
    dims = [q.size(-1), k.size(-1), v.size(-1)]
    qkv = _seq_to_heads(torch.cat([q, k, v], dim=-1), group, n) if n > 1 else torch.cat([q, k, v], dim=-1)
    all_positions = _all_gather_positions(positions, group).reshape(-1) if n > 1 else positions
    if n > 1:  # (cp, batch, S_local) -> (batch, cp * S_local), rank order as the all-to-all lays the tokens out
        all_documents = _all_gather_positions(documents, group).permute(1, 0, 2).reshape(documents.size(0), -1)
    else:
        all_documents = documents
    mask = _document_block_mask(all_documents, all_documents, all_positions, all_positions, is_causal)
    q_full, k_full, v_full = qkv.split(dims, dim=-1)
    out = F.scaled_dot_product_attention(q_full, k_full, v_full, attn_mask=mask, scale=scale)
    return _heads_to_seq(out, group, n) if n > 1 else out


# --------------------------------------------------------------------------------------------------------------------
# Routing F.scaled_dot_product_attention

#: ``method`` name -> attention function, as :class:`CPAttentionMode` takes it.
CP_ATTENTION_METHODS: dict[str, Callable[..., Tensor]] = {"ring": ring_attention, "all_to_all": ulysses_attention}


#: The :class:`CPAttentionMode` instances entered on this thread and not yet left, innermost last.
_ACTIVE_MODES: StepVar[tuple[CPAttentionMode, ...]] = StepVar("cp_attention_modes", ())


@contextmanager
def _reentered(method: str, group: dist.ProcessGroup | None, positions: Tensor) -> Generator[None, None, None]:
    if any(isinstance(m, CPAttentionMode) for m in current_function_mode_stack()):
        # the mode is on (a pipeline's backward inside the schedule's step): only its shard, for a recomputation on a
        # thread of autograd's, which does not see the step's values (lightning_par/step_context.py)
        size = dist.get_world_size(group) if group is not None else 1
        with sequence.sequence_shard(sequence.SequenceShard(group, positions, size)):
            yield
        return
    with CPAttentionMode(method, group, positions):
        yield


def recompute_context() -> Callable[[], AbstractContextManager[None]]:
    """Called at a checkpointed forward (``torch.utils.checkpoint``'s ``context_fn``): what makes the context its
    recomputation in backward must run in, the context-parallel attention active now (a no-op context when none is);
    a fresh context for each recomputation (a zero-bubble schedule recomputes a block twice). Measured: torch
    function modes are not active while autograd recomputes a checkpointed block, so without it the block's attention
    is recomputed as one process's ``scaled_dot_product_attention`` on the local tokens, saves other tensors than the
    forward did, and torch stops the backward (``CheckpointError``: recomputed values have different metadata)."""
    modes = _ACTIVE_MODES.get()
    if not modes:
        return nullcontext
    mode = modes[-1]
    return functools.partial(_reentered, mode.method, mode.group, mode.positions)


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
        self._tokens: list[tuple[StepToken, StepToken]] = []  # one pair per entry not yet left (re-entrant)

    def __enter__(self) -> CPAttentionMode:
        size = dist.get_world_size(self.group) if self.group is not None else 1
        shard = sequence.SequenceShard(self.group, self.positions, size)
        self._tokens.append((sequence.push(shard), _ACTIVE_MODES.set((*_ACTIVE_MODES.get(), self))))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        shard_token, mode_token = self._tokens.pop()
        _ACTIVE_MODES.reset(mode_token)
        sequence.pop(shard_token)
        super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self._attention(*args, **kwargs)
        return func(*args, **kwargs)

    # Run eagerly under a compiled block (strategy.compile, lightning_par/compile.py): the ring's K/V sends and the
    # all-to-all are process-group calls dynamo does not trace, and their byte counters are Python globals a graph
    # would guard on (measured: a recompilation every step until dynamo's recompile limit). One graph break per call.
    @torch.compiler.disable
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
        from lightning_par.data.doc_mask import active_documents

        documents = active_documents()  # packed documents: this rank's (batch, S_local) document ids
        if documents is not None and (documents.dim() != 2 or documents.shape != (query.size(0), query.size(-2))):
            raise ValueError(
                f"document_ids of shape {tuple(documents.shape)} are not valid under context parallelism for queries "
                f"{tuple(query.shape)}: expected this rank's (batch, seq_local) = ({query.size(0)}, {query.size(-2)})."
            )
        return attend(query, key, value, self.positions, self.group, is_causal=is_causal, scale=scale,
                      documents=documents)
