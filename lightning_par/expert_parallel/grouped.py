"""One experts computation for every mixture-of-experts layer: each expert's feed-forward ``act(x W_in[e]) W_out[e]``
on its segment of tokens sorted by expert, in one of three forms chosen by one function (:func:`choose_form`):

* ``"grouped_mm"``: ``torch._grouped_mm`` with the segments' end offsets (on the device, no host read), one call per
  matrix for all experts (torchtitan's ``GroupedExperts``, pytorch/torchtitan PR #1084; Megatron-core's
  ``--moe-grouped-gemm``). On CUDA (compute capability >= 8.0, bf16) with torch's own backward. On CPU (fp32, bf16 or
  fp16) torch 2.13 has the forward but no backward (``Invalid strides/sizes``): :class:`_GroupedMatmul` computes the
  backward with ``grouped_mm`` calls too (``dx = grouped_mm(dy, w^T)``, ``dw = grouped_mm(x^T, dy)`` with the offsets
  along the reduced dimension), so the whole step runs one autograd node per matrix instead of a few per expert;
  ATen's CPU kernel (``_grouped_mm_fallback``, ``aten/src/ATen/native/GroupedMMUtils.h``) loops over the groups in
  C++. Every width must be a multiple of 16 bytes (the kernels refuse other strides). Chosen wherever it runs, but
  not on CPU inside ``torch.compile`` (its fake-tensor rule takes bf16 only there: the loop is traced instead).
* ``"bmm"``: the tokens scattered into a zero-padded ``(experts, max tokens per expert, d)`` batch, two
  ``torch.bmm`` and a gather back. One host read of the counts per call (the padding size), none if the caller
  already has them (``host_counts``, as the ep dispatch does). Chosen on accelerators where ``grouped_mm`` does not
  run, unless the padding would more than quadruple the rows (a badly skewed routing); on CPU only when asked for
  (measured there: slower than the ``grouped_mm`` form everywhere but at 4 copies per expert, where they tie).
* ``"loop"``: one pair of matmuls per expert over ``x.split(counts)`` with the weights ``unbind``-ed once: chosen on
  CPU where ``grouped_mm`` does not run (float64, widths not a multiple of 16 bytes), the documented fallback for
  skewed routings, and the reference the other two are tested against.

Measured on this 2-core CPU (shared with other jobs), ``python -m lightning_par.benchmarks.moe --curve`` (one MoE
block, width 128, expert width 256, top-2, fp32, one thread, forward + backward, thread CPU time, the forms in turns
in one run; tables and the breakdown in ``docs/context-expert.md``): at 64 experts the loop takes 1.6-2.5x the CPU
``grouped_mm`` form's time at 2-16 routed copies per expert and 1.2-1.5x at 64-256, where both run the same MKL
matmuls (the grouped form's step is its matmuls, GELU and the shared dispatch: at its floor). Issue 49's aim, 2x over
the loop at 64 experts, is reached here at 2 and 4 copies per expert (2.16 and 2.04 on the idle machine).

All three give the same result up to float rounding (tested at rel <= 1e-5 in fp32 against the loop, forward and
gradients, ``tests/expert_parallel/test_moe_grouped.py``; the CPU ``grouped_mm`` runs each group's product as the same ``mm`` as
the loop and matches it bitwise there).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from lightning_par.compat import grouped_mm, grouped_mm_runs_on_cpu, has_grouped_mm

__all__ = ["FORMS", "choose_form", "expert_ffn", "sorted_counts"]

#: The forms :func:`expert_ffn` computes in.
FORMS: tuple[str, ...] = ("grouped_mm", "bmm", "loop")
#: ``bmm`` pads to ``experts * max count`` rows; above this many times the tokens, ``loop`` is chosen instead.
MAX_PADDING = 4.0


def sorted_counts(sorted_ids: Tensor, num_experts: int) -> Tensor:
    """Tokens per expert of expert indices sorted ascending: ``(num_experts,)`` int64 on ``sorted_ids``'s device.

    ``torch.bincount(ids, minlength=E)`` gives the same, but on CUDA it reads ``ids.max()`` to the host to size its
    output (a device synchronisation per MoE layer); two ``searchsorted`` over the sorted indices read nothing and are
    deterministic.

    Args:
        sorted_ids: ``(n,)`` integer expert indices in ``[0, num_experts)``, sorted ascending.
        num_experts: ``E``.
    """
    bounds = torch.arange(num_experts + 1, device=sorted_ids.device, dtype=sorted_ids.dtype)
    edges = torch.searchsorted(sorted_ids, bounds)  # (E + 1,): where each expert's segment starts
    return (edges[1:] - edges[:-1]).to(torch.int64)


#: Dtypes ``torch._grouped_mm`` takes on CPU (torch 2.13: fp32, bf16, fp16; float64 is refused).
_CPU_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _grouped_mm_runs(x: Tensor, weights: Sequence[Tensor]) -> bool:
    """``torch._grouped_mm`` (forward and backward) runs here: CUDA sm >= 8.0 in bf16, or the CPU (through
    :class:`_GroupedMatmul`) in fp32/bf16/fp16; every width a multiple of 16 bytes on both."""
    if not has_grouped_mm():
        return False
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16 or any(w.dtype != torch.bfloat16 for w in weights):
            return False
        if torch.cuda.get_device_capability(x.device) < (8, 0):
            return False
    elif x.device.type == "cpu":
        if x.dtype not in _CPU_GROUPED_DTYPES or any(w.dtype != x.dtype for w in weights):
            return False
        # under torch.compile the fake-tensor rule of _grouped_mm (torch 2.13) takes bf16 only: the traced CPU
        # forward in fp32 fails ("Expected inputs of BF16 type"), so a compiled graph keeps the loop
        if torch.compiler.is_compiling() or not grouped_mm_runs_on_cpu():
            return False
    else:
        return False
    # rows of 16 bytes: both kernels refuse other strides ("strides should be multiple of 16 bytes")
    per_row = 16 // x.element_size()
    return x.shape[-1] % per_row == 0 and all(s % per_row == 0 for w in weights for s in w.shape[1:])


def _is_transposed(w: Tensor) -> bool:
    """``w`` ``(groups, in, out)`` is the transpose of a contiguous ``(groups, out, in)`` tensor."""
    return w.shape[1] > 1 and w.shape[2] > 1 and w.transpose(1, 2).is_contiguous()


class _GroupedMatmul(torch.autograd.Function):
    """``y[s:e] = x[s:e] @ w[g]`` for every group ``g`` of rows ``s:e`` (``offs``: the groups' end offsets, int32),
    forward *and* backward as ``torch._grouped_mm`` calls, for the CPU, where torch 2.13 has the forward but no
    backward (``Invalid strides/sizes``): ``dx = grouped_mm(dy, w^T)`` with the same row offsets, and
    ``dw[g] = x[s:e]^T dy[s:e]``, the 2-d x 2-d form of ``grouped_mm`` with the offsets along the reduced dimension
    (a group without rows gets a zero gradient). Each group's product is one ``mm`` of ATen's C++ fallback, so it
    matches the per-expert loop bitwise (``tests/expert_parallel/test_moe_grouped.py``) at the cost of one autograd node per
    matrix instead of a few per expert. Where ``w`` is a transposed view of ``(groups, out, in)`` weights
    (transformers' experts layout, ``gate_up_proj`` and ``down_proj``), ``dw`` is computed in that layout,
    ``grouped_mm(dy^T, x)``, and handed back transposed: the parameter's gradient then needs no copy (in ``w``'s own
    layout autograd copied the non-contiguous ``(groups, in, out)`` gradient into the parameter's strides; measured on
    this CPU, one thread, 64 experts, width 128, SwiGLU expert width 128: the grouped step 40% faster at 4 rows per
    group, 15% at 128, the gradients equal bitwise)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
        ctx.save_for_backward(x, w, offs)
        if x.shape[0] == 0:  # no rows (an ep rank that received no token): an empty tensor may have zero strides
            return x.new_zeros(0, w.shape[-1])
        return grouped_mm(x, w, offs)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, w, offs = ctx.saved_tensors
        if x.shape[0] == 0:  # every expert without rows: zero gradients (see expert_ffn)
            return x.new_zeros(x.shape), w.new_zeros(w.shape), None
        dy = dy.contiguous()  # an expanded gradient (a sum's) has zero strides, which grouped_mm refuses
        dx = grouped_mm(dy, w.transpose(1, 2), offs) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1] and _is_transposed(w):
            # w is a transposed view of (groups, out, in) weights (transformers' experts layout): the gradient
            # computed in that layout, dw[g]^T = dy[s:e]^T x[s:e], and handed back transposed reaches the parameter
            # without a copy; in w's own layout it would be a non-contiguous (groups, in, out) tensor, which autograd
            # copies into the parameter's strides
            dw = grouped_mm(dy.t(), x, offs).transpose(1, 2)
        elif ctx.needs_input_grad[1]:
            dw = grouped_mm(x.t(), dy, offs)
        return dx, dw, None


def choose_form(x: Tensor, weights: Sequence[Tensor], rows: Sequence[int] | None = None,
                requested: str | None = None) -> str:
    """The form :func:`expert_ffn` runs in (see the module docstring).

    Args:
        x: ``(tokens, d)`` tokens sorted by expert.
        weights: the experts' weights, each ``(experts, in, out)``.
        rows: tokens per expert on the host, if known (``None``: the skew check is skipped).
        requested: ``None`` or ``"auto"`` to choose; a name of :data:`FORMS` to force it (``"grouped_mm"`` only where
            it runs, else ``"bmm"``).

    Returns:
        one of :data:`FORMS`.

    Raises:
        ValueError: ``requested`` not ``None``, ``"auto"`` or one of :data:`FORMS`.
    """
    if requested not in (None, "auto", *FORMS):
        raise ValueError(f"experts form={requested!r} is not valid: expected one of {['auto', *FORMS]}.")
    if requested == "loop":
        return "loop"
    if requested in (None, "auto", "grouped_mm") and _grouped_mm_runs(x, weights):
        return "grouped_mm"
    if requested in ("bmm", "grouped_mm"):
        return "bmm"
    if x.device.type == "cpu":
        # grouped_mm does not run here (float64, unaligned widths). Measured on the 2-core CPU (`python
        # recipes/benchmark.py --only moe`, fp32, one thread): the loop over unbind-ed weights takes 0.7-0.85x the
        # padded bmm's time at 32-1,024 copies per expert (the bmm wins only at fewer), and it keeps transformers'
        # own per-expert arithmetic (a routing near a tie then chooses as in one process).
        return "loop"
    if rows is None or not rows:
        return "bmm"
    return "bmm" if len(rows) * max(rows) <= MAX_PADDING * max(x.shape[0], 1) else "loop"


def expert_ffn(x: Tensor, counts: Tensor, w_in: Tensor, w_out: Tensor, act: Callable[[Tensor], Tensor], *,
               form: str | None = None, host_counts: Sequence[int] | None = None) -> Tensor:
    """Every expert's ``act(x_e @ w_in[e]) @ w_out[e]`` on its segment ``x_e`` of ``x``.

    Args:
        x: ``(tokens, d)``, sorted by expert.
        counts: ``(experts,)`` int64 on ``x``'s device, tokens of each expert, summing to ``tokens``.
        w_in: ``(experts, d, h_in)`` (a transposed view of an ``(experts, h_in, d)`` weight is fine).
        w_out: ``(experts, h, d_out)``.
        act: ``(..., h_in) -> (..., h)`` elementwise or gating function, with ``act(0) == 0`` not required (padded
            rows are dropped).
        form: ``None``/``"auto"`` (:func:`choose_form`) or one of :data:`FORMS`.
        host_counts: ``counts`` already read to the host (skips this call's host read).

    Returns:
        ``(tokens, d_out)`` in the order of ``x``.
    """
    n = x.shape[0]
    kind = choose_form(x, (w_in, w_out), host_counts, form)
    if kind == "grouped_mm":  # no host read: the offsets stay on the device
        offs = counts.cumsum(0).to(torch.int32)
        if x.device.type == "cuda":  # torch's own backward
            return grouped_mm(act(grouped_mm(x, w_in, offs)), w_out, offs)
        hidden = act(_GroupedMatmul.apply(x.contiguous(), w_in, offs))
        return _GroupedMatmul.apply(hidden.contiguous(), w_out, offs)
    # deliberate host sync (once per MoE layer, none when the ep dispatch passed host_counts): the segment sizes
    rows = list(host_counts) if host_counts is not None else counts.tolist()
    if kind == "bmm" and host_counts is None and choose_form(x, (w_in, w_out), rows, form) == "loop":
        kind = "loop"
    # Every expert's matmuls run, an expert without tokens on an empty segment, and so do they on a rank that received
    # no token at all (under ep): the weights then get a zero gradient, not none. With none, an optimizer skips them
    # (AdamW's moments and weight decay would not move them this step, as they do in one process, where the whole
    # experts weight always has a gradient), and the output still depends on x (the combine's backward all-to-all
    # runs on every rank).
    if kind == "loop":
        # unbind, not w_in[e]: indexing's backward would write a zero-filled (experts, ...) gradient per expert
        pairs = zip(x.split(rows), w_in.unbind(0), w_out.unbind(0))
        return torch.cat([act(chunk @ a) @ b for chunk, a, b in pairs])
    experts, most = len(rows), max(rows)
    # each token's slot in the padded batch: expert * most + its position within the expert's segment
    expert_of = torch.repeat_interleave(torch.arange(experts, device=x.device), counts, output_size=n)
    starts = counts.cumsum(0) - counts
    slot = expert_of * most + torch.arange(n, device=x.device) - starts[expert_of]
    padded = x.new_zeros(experts * most, x.shape[1]).index_copy(0, slot, x).view(experts, most, x.shape[1])
    hidden = act(torch.bmm(padded, w_in))  # (experts, most, h)
    return torch.bmm(hidden, w_out).view(experts * most, w_out.shape[-1])[slot]  # (tokens, d_out)
