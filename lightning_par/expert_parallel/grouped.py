"""One experts computation for every mixture-of-experts layer: each expert's feed-forward ``act(x W_in[e]) W_out[e]``
on its segment of tokens sorted by expert, in one of three forms chosen by one function (:func:`choose_form`):

* ``"grouped_mm"``: ``torch._grouped_mm`` with the segments' end offsets (on the device, no host read), one kernel
  per matrix for all experts (torchtitan's ``GroupedExperts``, pytorch/torchtitan PR #1084; Megatron-core's
  ``--moe-grouped-gemm``). Chosen where it runs forward *and* backward: CUDA (compute capability >= 8.0), bf16 tokens
  and weights, every inner and outer width a multiple of 8 (16-byte rows). torch 2.13 runs it forward on CPU but has
  no CPU backward (``Invalid strides/sizes``), so it is never chosen on CPU.
* ``"bmm"``: the tokens scattered into a zero-padded ``(experts, max tokens per expert, d)`` batch, two
  ``torch.bmm`` and a gather back. One host read of the counts per call (the padding size), none if the caller
  already has them (``host_counts``, as the ep dispatch does). Chosen on accelerators where ``grouped_mm`` does not
  run, unless the padding would more than quadruple the rows (a badly skewed routing); on CPU only when asked for. On this CPU (``python recipes/benchmark.py --only moe``,
  ``docs/context-expert.md``) it is 2.5x faster at 64 experts than the loop as ``GroupedExperts`` ran it before
  (``w1[e]`` per expert), but 0.75-0.95x of the loop below: on CPU it buys one code path and a bounded host read,
  not speed.
* ``"loop"``: one pair of matmuls per expert over ``x.split(counts)`` with the weights ``unbind``-ed once: chosen on
  CPU (measured faster there, above), the documented fallback for skewed routings, and the reference the other two
  are tested against.

All three give the same result up to float rounding (tested at rel <= 1e-5 in fp32,
``tests/unit/test_moe_grouped.py``).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

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


def _grouped_mm_runs(x: Tensor, weights: Sequence[Tensor]) -> bool:
    """``torch._grouped_mm`` has forward and backward here: CUDA sm >= 8.0, bf16, 16-byte-aligned widths."""
    if not hasattr(torch, "_grouped_mm") or x.device.type != "cuda":
        return False
    if x.dtype != torch.bfloat16 or any(w.dtype != torch.bfloat16 for w in weights):
        return False
    if torch.cuda.get_device_capability(x.device) < (8, 0):
        return False
    return all(s % 8 == 0 for w in weights for s in w.shape[1:])


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
        # Measured on the 2-core CPU (`python recipes/benchmark.py --only moe`, 4,096 tokens, fp32, one thread): the
        # loop over unbind-ed weights takes 0.75-0.95x the padded bmm's time at 8-256 experts, and it keeps
        # transformers' own per-expert arithmetic (a routing near a tie then chooses as in one process).
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
        return torch._grouped_mm(act(torch._grouped_mm(x, w_in, offs=offs)), w_out, offs=offs)
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
