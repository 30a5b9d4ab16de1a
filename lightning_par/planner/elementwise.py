"""Bytes that the memory-bound kernels of one transformer layer move: norms, dropouts, residual adds, bias-GeLU and
the attention core's softmax.

The matmuls of a layer do ``O(h^2)`` FLOPs per token and run near the device's peak; the other kernels do ``O(h)``
(and ``O(a s)`` in the attention core) work per token and are bound by memory bandwidth. Their share of a step
therefore shrinks as the hidden size grows: why Megatron-LM's utilisation rises with model size (Narayanan et al.
2021, §5.1: "GPU utilization improves as the models get larger (larger matrix multiplications)"), and why it fuses
them (§4.2: bias + GeLU, bias + dropout + add, scale + mask + softmax; +11-19% throughput, §5.8). Under tensor
parallelism without sequence parallelism the norms, dropouts and residual adds run on the whole ``b s h`` activation
on every tp rank: this work does not shrink with ``t`` (Korthikanti et al. 2022, §4.2.2).

Counted per layer and micro-batch on one rank, forward, as each fused kernel reads its inputs and writes its output
once (elements of ``element_bytes``, dropout masks of one byte; the same tensors Korthikanti et al. 2022, Table 2
count as stored activations):

* replicated over tp (``/ t`` with sequence parallelism): two layer norms (read + write ``b s h``: ``4 b s h``
  elements) and two bias + dropout + residual adds (read branch and residual, write the sum: ``6 b s h`` elements,
  ``2 b s h`` mask bytes);
* split over tp: bias + GeLU on the MLP's ``f``-wide activation (read + write: ``2 b s f`` elements); the attention
  core's scale + mask + softmax (read + write the ``a s^2 b`` scores) and its dropout (read + write, a mask byte):
  ``4 a s^2 b`` elements and ``a s^2 b`` bytes. A fused attention kernel (FlashAttention, torch's SDPA) keeps the
  scores on chip and moves none of these; the planner counts them as its activation model does.

The backward of each kernel reads its saved input and the incoming gradient and writes the outgoing gradient: 3/2 of
the forward's traffic. Full recomputation runs the forward again; selective recomputation the attention core's.

All in bytes. Pure Python: no torch import.
"""

from __future__ import annotations

__all__ = ["BACKWARD_TRAFFIC", "elementwise_bytes_per_layer"]

#: Backward traffic of a memory-bound kernel over its forward's: reads input and output gradient, writes one (3 vs 2).
BACKWARD_TRAFFIC = 1.5


def elementwise_bytes_per_layer(
    seq_len: int,
    micro_batch_size: int,
    hidden_size: int,
    num_heads: int,
    tp_size: int = 1,
    sequence_parallel: bool = False,
    checkpointing: str = "none",
    element_bytes: int = 2,
    ffn_hidden_size: int | None = None,
) -> float:
    """Bytes the memory-bound kernels of one layer read and write for one micro-batch (forward, recomputation and
    backward) on one tensor-parallel rank (see the module docstring for what is counted).

    Args:
        seq_len: ``s``.
        micro_batch_size: ``b``.
        hidden_size: ``h``.
        num_heads: ``a``.
        tp_size: ``t``.
        sequence_parallel: norms, dropouts and residual adds sharded over the sequence (``/ t``).
        checkpointing: ``"none"``, ``"selective"`` (the attention core's forward again) or ``"full"`` (the whole
            forward again).
        element_bytes: bytes per activation element.
        ffn_hidden_size: MLP width ``f`` (None: ``4 h``).

    Returns:
        Bytes.

    Raises:
        ValueError: an unknown ``checkpointing``.
    """
    s, b, h, a, t, e = seq_len, micro_batch_size, hidden_size, num_heads, tp_size, element_bytes
    f = ffn_hidden_size or 4 * h
    sbh = s * b * h
    replicated = 10 * sbh * e + 2 * sbh
    attention_core = a * s * s * b * (4 * e + 1)
    split = 2 * s * b * f * e + attention_core
    forward = replicated / (t if sequence_parallel else 1) + split / t
    recompute = {"none": 0.0, "selective": attention_core / t, "full": forward}
    if checkpointing not in recompute:
        raise ValueError(f"checkpointing={checkpointing!r} is not valid: expected 'none', 'selective' or 'full'.")
    return forward * (1 + BACKWARD_TRAFFIC) + recompute[checkpointing]
