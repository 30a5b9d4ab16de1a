"""Predicted memory per device: model state, activations and buffers, per pipeline rank.

* **Parameters per rank** (:func:`rank_params`): the rank's ``L / p`` blocks, their matrices and column-parallel biases
  split over ``tp``, norms and row-parallel biases replicated; the vocab-parallel token embedding (and position table)
  on the first rank, the final norm and vocab-parallel head on the last (Megatron-LM, Shoeybi et al. 2019, §3;
  Narayanan et al. 2021, §2.2). An untied head on one rank is not shared. A MoE block's experts are split over
  ``ep`` (each rank ``E / ep`` of them), not over ``tp`` (:func:`rank_param_groups`).
* **Model state** (:func:`model_state_bytes`): the ZeRO paper's per-stage formulas (Rajbhandari et al. 2020, §5.1 and
  Figure 1) over the ``d`` ranks that shard it, with the precision's bytes per parameter, gradient and optimizer
  state: ddp ``(P+G+K) Psi``, zero1 ``(P+G) Psi + K Psi / d``, zero2 ``P Psi + (G+K) Psi / d``, zero3
  ``(P+G+K) Psi / d``. ``d`` is the size of the runtime's shard mesh (:class:`~lightning_par.parallel_dims.
  ParallelDims`): ``dp_shard_cp`` (``dp_shard_size * cp_size``; HSDP's replicas each hold a whole sharded copy) for
  the dense parameters, ``edp_shard`` (``dp_shard_size * cp_size / ep_size``) for the experts; ddp keeps a whole copy
  on every rank.
* **Activations** (:func:`activation_bytes_per_layer`): Korthikanti et al. 2022, Table 2, per layer and micro-batch,
  generalised to any activation element size (the paper counts 2-byte activations and 1-byte dropout masks) and to
  a sequence split over ``cp`` ranks (each holds ``s / cp`` tokens and their ``s / cp x s`` attention scores), times
  the micro-batches a rank holds at once under its schedule (:func:`microbatches_in_flight`; §4.2.3 for 1F1B and the
  interleaved schedule), plus the last rank's logits (of its ``s / cp`` tokens).
* **Buffers** (:func:`buffer_bytes`): the dp reducer's gradient buckets, ZeRO-3's gathered blocks, pipeline send and
  receive buffers.

All in bytes. Pure Python: no torch import.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from lightning_par.planner.layouts import Layout, sequence_split
from lightning_par.planner.model import ModelSpec
from lightning_par.planner.precision import Precision
from lightning_par.state_cost import model_state_bytes, rank_param_groups, rank_params, stage_layers

__all__ = [
    "MemoryBreakdown",
    "activation_bytes_per_layer",
    "buffer_bytes",
    "microbatches_in_flight",
    "model_state_bytes",
    "predict_memory",
    "rank_param_groups",
    "rank_params",
    "rank_state_bytes",
    "stage_layers",
]

#: Bucket size of the dp reducers (``bucket_cap_mb`` default, 25 MiB).
BUCKET_BYTES = 25 * (1 << 20)


def rank_state_bytes(model: ModelSpec, layout: Layout, precision: Precision, pp_rank: int) -> float:
    """Bytes of parameters, gradients and optimizer state of the fullest rank of pipeline rank ``pp_rank``: the sum of
    every registered axis's ``state_bytes`` (:class:`~lightning_par.axis_registry.PlannerTerms`): the dense parameters
    sharded over the runtime's ``dp_shard_cp`` mesh (the dp axis), the experts over ``edp_shard`` in whole experts
    (the ep axis, :func:`~lightning_par.expert_parallel.planner.expert_shard_ranks`; see :func:`model_state_bytes`).

    Raises:
        ValueError: ``pp_rank`` out of range, an unknown ``dp_mode``, or sizes :class:`~lightning_par.parallel_dims.
            ParallelDims` refuses.
    """
    from lightning_par.planner.context import PlanContext
    from lightning_par.planner.layouts import planner_terms

    if not 0 <= pp_rank < layout.pp_size:
        raise ValueError(f"pp_rank={pp_rank!r} is not valid: expected 0 <= pp_rank < pp_size={layout.pp_size}.")
    ctx = PlanContext(model, layout, None, precision)
    return sum(t.state_bytes(ctx, pp_rank) for _, t in planner_terms() if t.state_bytes is not None)


def activation_bytes_per_layer(
    seq_len: int,
    micro_batch_size: int,
    hidden_size: int,
    num_heads: int,
    tp_size: int = 1,
    sequence_parallel: bool = False,
    checkpointing: str = "none",
    element_bytes: int = 2,
    seq_split: int = 1,
) -> float:
    """Activation bytes one transformer layer keeps for backward, per micro-batch, on one rank.

    Korthikanti et al. 2022, Table 2 (with ``s`` sequence, ``b`` micro-batch, ``h`` hidden, ``a`` heads, ``t`` tp):

    * no recomputation: ``s b h (34 + 5 a s / h)`` at ``t = 1``; with TP ``s b h (10 + 24/t + 5 a s / (h t))``; with
      TP and sequence parallelism ``s b h / t (34 + 5 a s / h)``;
    * selective recomputation (attention scores, softmax and its dropout recomputed): the ``a s`` terms vanish:
      ``s b h (10 + 24/t)``, with sequence parallelism ``34 s b h / t``;
    * full recomputation: only the layer input, ``2 s b h`` (sharded ``/ t`` under sequence parallelism).

    The paper's coefficients count 2-byte elements and 1-byte dropout masks: per layer, ``16 s b h + 2 a s^2 b``
    elements (``12 s b h + 2 a s^2 b`` of them split by TP) and ``2 s b h + a s^2 b`` mask bytes (``a s^2 b`` split).
    Here elements take ``element_bytes``, so ``element_bytes=2`` gives the table exactly.

    A sequence split over ``cp`` ranks (``seq_split``: context parallelism, :func:`~lightning_par.planner.layouts.
    sequence_split`): each rank holds ``s / cp`` tokens, so every ``s b h`` term becomes ``(s / cp) b h``; the
    attention core holds ``s / cp x s`` scores per head with ring attention (its queries against every K/V block; Liu
    et al. 2023, §3) and ``s x s`` for ``a / cp`` heads with Ulysses (Jacobs et al. 2023, §3): ``a s^2 b / cp`` both,
    so the cp method does not change the count. The ring keeps no visiting K/V block for backward (they go around the
    ring again, as in the paper). So the whole layer falls as ``1 / cp``.

    Args:
        seq_len: tokens ``s`` per whole sequence (before the cp split).
        micro_batch_size: sequences ``b`` per micro-batch.
        hidden_size: ``h``.
        num_heads: ``a``.
        tp_size: tensor-parallel ranks ``t``.
        sequence_parallel: norms and dropouts sharded over the sequence inside tensor parallelism.
        checkpointing: ``"none"``, ``"selective"`` or ``"full"``.
        element_bytes: bytes per activation element.
        seq_split: ranks ``cp`` each sequence's tokens are split over (context parallelism's ``cp_size``).

    Returns:
        Bytes.

    Raises:
        ValueError: an unknown ``checkpointing``.
    """
    s, b, h, a, t, e, n = seq_len, micro_batch_size, hidden_size, num_heads, tp_size, element_bytes, seq_split
    s_local = s // n if s % n == 0 else s / n  # tokens per rank (whole when the runtime's split allows it)
    sbh = s_local * b * h
    if checkpointing == "full":
        return sbh * e / (t if sequence_parallel else 1)
    if checkpointing not in ("none", "selective"):
        raise ValueError(f"checkpointing={checkpointing!r} is not valid: expected 'none', 'selective' or 'full'.")
    attn_core = 0.0 if checkpointing == "selective" else a * s_local * s * b * (2 * e + 1)
    split = 12 * sbh * e + attn_core
    replicated = 4 * sbh * e + 2 * sbh  # norm and matmul inputs, two dropout masks
    if sequence_parallel:
        return (split + replicated) / t
    return split / t + replicated


def microbatches_in_flight(layout: Layout, pp_rank: int) -> float:
    """Micro-batches whose activations rank ``pp_rank`` holds at its peak, in units of *its whole share of layers*.

    * ``pp_size == 1`` (gradient accumulation): 1;
    * GPipe: all ``m`` forwards before any backward: ``m``;
    * 1F1B: rank ``r`` runs ``p - r`` warm-up forwards: ``min(m, p - r)`` (rank 0 holds ``p`` micro-batches of
      ``L / p`` layers, i.e. ``L`` layers' worth: Korthikanti et al. 2022, §4.2.3);
    * interleaved 1F1B with ``v`` chunks: rank ``r`` holds ``2 (p - r - 1) + (v - 1) p + 1`` chunk-micro-batches of
      ``L / (p v)`` layers, i.e. ``1 + (p - 1)/(p v)`` times 1F1B's for rank 0 (§4.2.3); at most ``m v`` of them.
    """
    p, m, v = layout.pp_size, layout.num_microbatches, layout.virtual_stages
    if p == 1:
        return 1.0
    if layout.schedule == "gpipe":
        return float(m)
    if layout.schedule == "interleaved_1f1b":
        chunks = min(m * v, 2 * (p - pp_rank - 1) + (v - 1) * p + 1)
        return chunks / v
    return float(min(m, p - pp_rank))


def buffer_bytes(model: ModelSpec, layout: Layout, params: float, precision: Precision) -> float:
    """Communication and working buffers of one rank, in bytes.

    * ddp: the reducer's buckets, a second copy of the gradients (``gradient_as_bucket_view=False``, the default);
      zero1 and zero2: two buckets in flight (``2 x 25 MiB``);
    * zero3: two gathered blocks (current and prefetched) and one block's full gradients;
    * pipelining: a send and a receive buffer of one micro-batch's activations per chunk boundary.

    The dp reducers work over ``dp_size * cp_size`` ranks (the runtime's ``dp_cp`` / ``dp_shard_cp`` meshes), so a
    layout with ``cp_size > 1`` has them even at ``dp_size == 1``.
    """
    out = 0.0
    if layout.dims().size("dp_cp") > 1:
        if layout.dp_mode == "ddp":
            out += params * precision.grad_bytes
        elif layout.dp_mode in ("zero1", "zero2"):
            out += 2 * min(BUCKET_BYTES, params * precision.grad_bytes)
        else:
            split, replicated = model.layer_params()
            block = split / layout.tp_size + replicated
            out += block * (2 * precision.param_bytes + precision.grad_bytes)
    if layout.pp_size > 1:
        sbh = model.seq_len * layout.micro_batch_size * model.hidden_size
        shard = (layout.tp_size if layout.sequence_parallel else 1) * sequence_split(layout)
        out += 2 * sbh * precision.activation_bytes / shard
    return out


@dataclass(frozen=True)
class MemoryBreakdown:
    """Predicted bytes on the fullest rank.

    Attributes:
        pp_rank: the pipeline rank with the largest total.
        params: its parameters (before dp sharding).
        model_state_bytes: parameters + gradients + optimizer state.
        activation_bytes: activations held for backward at the schedule's peak, plus the last rank's logits.
        buffer_bytes: see :func:`buffer_bytes`.
        max_model_state_bytes: the largest model state of any pipeline rank (the fullest rank may hold less state
            and more activations than another).
    """

    pp_rank: int
    params: float
    model_state_bytes: float
    activation_bytes: float
    buffer_bytes: float
    max_model_state_bytes: float = 0.0

    @property
    def total_bytes(self) -> float:
        """``model_state_bytes + activation_bytes + buffer_bytes``."""
        return self.model_state_bytes + self.activation_bytes + self.buffer_bytes


def _activation_bytes(model: ModelSpec, layout: Layout, precision: Precision, pp_rank: int) -> float:
    e = precision.activation_bytes
    args = (model.seq_len, layout.micro_batch_size, model.hidden_size, model.num_heads, layout.tp_size,
            layout.sequence_parallel)
    split = sequence_split(layout)
    per_layer = activation_bytes_per_layer(*args, checkpointing=layout.activation_checkpointing, element_bytes=e,
                                           seq_split=split)
    layers = model.num_layers / layout.pp_size
    held = per_layer * layers * microbatches_in_flight(layout, pp_rank)
    if layout.activation_checkpointing == "full":  # one layer recomputed in full during its backward
        held += activation_bytes_per_layer(*args, checkpointing="none", element_bytes=e, seq_split=split)
    if pp_rank == layout.pp_size - 1:  # one micro-batch's logits (of this rank's tokens) and their fp32 softmax
        logits = model.seq_len * layout.micro_batch_size * math.ceil(model.vocab_size / layout.tp_size) * (e + 4)
        held += logits if split == 1 else logits / split
    return held


def predict_memory(model: ModelSpec, layout: Layout, precision: Precision) -> MemoryBreakdown:
    """The :class:`MemoryBreakdown` of the pipeline rank that needs the most memory.

    For a dense model only the first and the last rank are candidates: a middle rank holds the same blocks without
    the embedding or the head, and no more micro-batches in flight than the first. With experts every rank is (a
    middle rank may hold more MoE blocks).
    """
    best: MemoryBreakdown | None = None
    max_state = 0.0
    ranks = range(layout.pp_size) if model.num_experts else sorted({0, layout.pp_size - 1})
    for r in ranks:
        params = rank_params(model, layout, r)
        mb = MemoryBreakdown(
            pp_rank=r,
            params=params,
            model_state_bytes=rank_state_bytes(model, layout, precision, r),
            activation_bytes=_activation_bytes(model, layout, precision, r),
            buffer_bytes=buffer_bytes(model, layout, params, precision),
        )
        max_state = max(max_state, mb.model_state_bytes)
        if best is None or mb.total_bytes > best.total_bytes:
            best = mb
    assert best is not None
    return dataclasses.replace(best, max_model_state_bytes=max_state)
