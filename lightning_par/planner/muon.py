"""The planner's terms for Muon (:class:`lightning_par.optim.MuonAdamW`): optimizer-state bytes and the step's extra
communication and compute. Pure Python: no torch import.

Memory. Muon keeps one momentum buffer per matrix (``4`` bytes per element in fp32) where AdamW keeps two moments
(``8``), and its buffers are sharded exactly like the parameters (docs/muon.md). So for a model whose Muon matrices
hold the fraction ``f`` of the parameters, the ZeRO paper's ``K`` (optimizer bytes per parameter, Rajbhandari et al.
2020, §3.1) becomes ``K - 4 f``: :func:`muon_precision` gives the planner's :class:`Precision` with that ``K``, so
every memory term of :func:`lightning_par.planner.plan` (and the optimizer's read/write traffic in the step time)
follows. :func:`muon_state_bytes` is the same count for one rank from the numbers of elements it holds, with AdamW's
4-byte ``step`` per tensor.

Time. At the step, each Muon matrix of ``m x k`` elements held in ``n`` pieces is gathered to its owner (which
receives ``4 m k (n-1)/n`` bytes, fp32), orthogonalised there (``ns_steps`` Newton-Schulz iterations of
``2 (2 p^2 q + p^3)`` flops with ``p = min(m, k)``, ``q = max(m, k)``: the Gram matrix, its square, the product with
the matrix; bf16), and its pieces scattered back (each other rank receives ``2 m k / n`` bytes, bf16). Owners are
assigned greedily by flops, so each rank runs about ``1/n`` of the iterations (:func:`muon_step_cost`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lightning_par.planner.precision import Precision, get_precision

__all__ = [
    "MuonStepCost", "gpt_muon_matrices", "muon_fraction", "muon_precision", "muon_state_bytes", "muon_step_cost",
]

#: bytes of Muon's momentum per element (fp32) and of AdamW's two moments.
MUON_STATE_BYTES, ADAMW_STATE_BYTES = 4, 8
#: AdamW's ``step`` counter per tensor (a 0-dim fp32 tensor).
ADAMW_STEP_BYTES = 4


def muon_precision(precision: str | Precision, muon_fraction: float) -> Precision:
    """``precision`` with ``K`` lowered by ``4 f``: ``muon_fraction = f`` of the parameters take Muon (one 4-byte
    momentum instead of AdamW's two moments).

    Raises:
        ValueError: ``muon_fraction`` outside ``[0, 1]``; an unknown precision name.
    """
    if not 0.0 <= muon_fraction <= 1.0:
        raise ValueError(f"muon_fraction={muon_fraction!r} is not valid: expected a float in [0, 1].")
    prec = get_precision(precision)
    k = prec.optimizer_bytes - (ADAMW_STATE_BYTES - MUON_STATE_BYTES) * muon_fraction
    return dataclasses.replace(prec, name=f"{prec.name}+muon", optimizer_bytes=k)  # type: ignore[arg-type]


def muon_fraction(model: Any) -> float:
    """The fraction of a :class:`~lightning_par.planner.model.ModelSpec`'s parameters on Muon under the default split
    rule: each block's ``4 h^2`` attention matrices, a dense block's ``2 h f`` MLP matrices, a MoE block's experts
    ``E 2 h f_e`` and shared expert ``2 h f_e`` (embeddings, head, norms, biases, routers are AdamW's)."""
    h, f, fe = model.hidden_size, model.ffn, model.expert_hidden
    matrices = 0
    for layer in range(model.num_layers):
        matrices += 4 * h * h
        if model.is_moe(layer):
            matrices += model.num_experts * 2 * h * fe + (2 * h * fe if model.moe_shared_expert else 0)
        else:
            matrices += 2 * h * f
    return min(1.0, matrices / model.total_params())


def muon_state_bytes(muon_numel: int, adamw_numel: int, adamw_tensors: int) -> int:
    """Optimizer-state bytes of one rank holding ``muon_numel`` elements of Muon matrices and ``adamw_numel``
    elements of ``adamw_tensors`` AdamW tensors (fp32): ``4 M_muon + 8 M_adamw + 4 T_adamw``."""
    return MUON_STATE_BYTES * muon_numel + ADAMW_STATE_BYTES * adamw_numel + ADAMW_STEP_BYTES * adamw_tensors


def gpt_muon_matrices(n_layer: int, n_embd: int, ffn: int | None = None) -> list[tuple[int, int]]:
    """The Muon matrices ``(out, in)`` of the reference dense GPT: per block q, k, v, the attention projection and
    the two MLP matrices (embeddings, head, norms and biases are AdamW's)."""
    f = 4 * n_embd if ffn is None else ffn
    return [(n_embd, n_embd)] * 4 * n_layer + [(f, n_embd), (n_embd, f)] * n_layer


@dataclass(frozen=True)
class MuonStepCost:
    """What Muon adds to one optimizer step, for the busiest rank of a group.

    Args:
        received_bytes: bytes the rank receives: as owner, the other pieces of its matrices (fp32); as a non-owner,
            its piece of each result (bf16).
        ns_flops: flops of the Newton-Schulz iterations the rank runs (its owned matrices).
        time_s: ``received_bytes / bandwidth + ns_flops / flops_per_s``.
    """

    received_bytes: float
    ns_flops: float
    time_s: float


def muon_step_cost(
    matrices: Sequence[tuple[int, ...]],
    pieces: int,
    *,
    ns_steps: int = 5,
    result_bytes: int = 2,
    bandwidth_bytes_per_s: float = 1e10,
    flops_per_s: float = 1e12,
) -> MuonStepCost:
    """Muon's extra cost per step for the busiest rank, for ``matrices`` (whole shapes; a 3-D shape is a stack of
    matrices) each split along one dim into ``pieces`` pieces over one group (the dp shard size under ZeRO/FSDP, the
    tp size under tensor parallelism; 1: held whole), with the owner scheme of
    :class:`lightning_par.optim.MuonAdamW` (the same greedy assignment, :func:`lightning_par.optim.muon.assign_owners`).

    Raises:
        ValueError: ``pieces < 1`` or ``ns_steps < 1``.
    """
    if pieces < 1 or ns_steps < 1:
        raise ValueError(f"pieces={pieces!r} and ns_steps={ns_steps!r} must be integers >= 1.")
    from lightning_par.optim.muon import assign_owners  # torch only when called

    mats = [tuple(m[-2:]) for m in matrices]
    batch = [math.prod(m[:-2]) if len(m) > 2 else 1 for m in matrices]
    owners = assign_owners(mats, pieces, batch) if pieces > 1 else [0] * len(mats)
    recv = [0.0] * pieces
    flops = [0.0] * pieces
    for (m, k), b, owner in zip(mats, batch, owners):
        numel = m * k * b
        flops[owner] += b * ns_steps * 2.0 * (2 * min(m, k) ** 2 * max(m, k) + min(m, k) ** 3)
        if pieces > 1:
            for r in range(pieces):
                recv[r] += 4.0 * numel * (pieces - 1) / pieces if r == owner else result_bytes * numel / pieces
    busiest = max(range(pieces), key=lambda r: recv[r] / bandwidth_bytes_per_s + flops[r] / flops_per_s)
    return MuonStepCost(max(recv), flops[busiest],
                        recv[busiest] / bandwidth_bytes_per_s + flops[busiest] / flops_per_s)
