"""The cp axis's exchanges per attention layer: ring attention and DeepSpeed-Ulysses, in bytes one rank sends.

Written with the collective formulas of :mod:`lightning_par.comm_cost` (a point-to-point send, an all-to-all); the
planner (:mod:`lightning_par.context_parallel.planner`) and the cp benchmark (``lightning_par.benchmarks.
context_parallel``) both use these. Pure Python: no torch import.
"""

from __future__ import annotations

from lightning_par.comm_cost import all_to_all_bytes, send_bytes

__all__ = ["ring_attention_forward_bytes", "ring_attention_layer_bytes", "ulysses_layer_bytes"]


def ring_attention_layer_bytes(micro_batch_size: int, seq_len: int, hidden_size: int, cp_size: int, tp_size: int,
                               element_bytes: int, recompute_forward: bool = False) -> float:
    """Bytes one rank sends per attention layer per micro-batch under ring attention over ``cp_size`` ranks.

    Ring Attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers", §3): each rank holds ``S / cp`` of
    the sequence's ``S`` tokens and passes the K/V block it holds to the next rank ``cp - 1`` times, so that its
    queries meet every block; a block is K and V of those tokens for the rank's ``h / t`` hidden units (its heads
    under tensor parallelism), ``2 b (S/cp) (h/t)`` elements. The backward keeps no visiting block (as the paper's):
    the K/V blocks go around the ring again and each block's dK/dV travels with it back home, twice the forward's
    bytes. So ``3 (cp-1) * 2 b (S/cp) (h/t)`` elements, with a recomputed forward (activation checkpointing of the
    attention) ``4 (cp-1) * 2 b (S/cp) (h/t)``. (:func:`ring_attention_forward_bytes` is the forward's share.)

    Args:
        micro_batch_size: sequences ``b`` per micro-batch.
        seq_len: tokens ``S`` per whole sequence (before the cp split).
        hidden_size: ``h``.
        cp_size: ranks ``cp`` the sequence is split over.
        tp_size: tensor-parallel ranks ``t`` the heads are split over.
        element_bytes: bytes per K/V element.
        recompute_forward: the forward ring runs twice (checkpointed attention).

    Returns:
        Bytes sent by one rank (0 for ``cp_size == 1``).
    """
    passes = 4 if recompute_forward else 3
    return passes * ring_attention_forward_bytes(micro_batch_size, seq_len, hidden_size, cp_size, tp_size, element_bytes)


def ring_attention_forward_bytes(micro_batch_size: int, seq_len: int, hidden_size: int, cp_size: int, tp_size: int,
                                 element_bytes: int) -> float:
    """Bytes one rank sends in one attention layer's forward under ring attention: ``cp - 1`` K/V blocks of
    ``2 b (S/cp) (h/t)`` elements (see :func:`ring_attention_layer_bytes`; the backward sends twice as much)."""
    block = 2 * micro_batch_size * seq_len * hidden_size * element_bytes / (cp_size * tp_size)
    return (cp_size - 1) * send_bytes(block)


def ulysses_layer_bytes(micro_batch_size: int, seq_len: int, hidden_size: int, cp_size: int, tp_size: int,
                        element_bytes: int, recompute_forward: bool = False) -> float:
    """Bytes one rank sends per attention layer per micro-batch under DeepSpeed-Ulysses over ``cp_size`` ranks.

    DeepSpeed-Ulysses (Jacobs et al. 2023, §3): all-to-alls of q, k and v trade the sequence split for a head split
    before attention and one of the output trades back: four all-to-alls forward of ``b (S/cp) (h/t)`` elements of
    input per rank (``4 N h / P`` per link per layer in the paper's terms, ``N = b S``, ``P = cp``, at ``t = 1``),
    and their four reverse exchanges backward. Each all-to-all sends all but the rank's own ``1/cp``
    (:func:`all_to_all_bytes`): ``8 b (S/cp) (h/t) (cp-1)/cp`` elements, with a recomputed forward ``12 ...``.
    (lightning_par sends q, k and v as one tensor: fewer messages, the same bytes.)

    Args and returns: as :func:`ring_attention_layer_bytes` (``recompute_forward``: the forward all-to-alls run
    twice).
    """
    count = 12 if recompute_forward else 8
    local = micro_batch_size * seq_len * hidden_size * element_bytes / (cp_size * tp_size)
    return count * all_to_all_bytes(local, cp_size)
