"""Model-state cost: which parameters a rank holds and the bytes of their state under each dp mode.

The one home of these formulas, beside :mod:`lightning_par.comm_cost`: the axes' planner terms
(``<axis>/planner.py``) and the layout planner (:mod:`lightning_par.planner.memory`, which re-exports them) read them.
They sit below both, so this module imports nothing of the planner, the registry or the axes at run time: ``model`` is
a :class:`~lightning_par.planner.model.ModelSpec` (or any object with its methods), ``layout`` any object with the
:class:`~lightning_par.planner.layouts.Layout` fields named, ``precision`` a
:class:`~lightning_par.planner.precision.Precision` (tests/core/test_import_layers.py: no axis folder imports the
planner, ``import lightning_par`` does not load it). Pure Python: no torch import.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_par.planner.model import ModelSpec
    from lightning_par.planner.precision import Precision

__all__ = ["model_state_bytes", "rank_param_groups", "rank_params", "stage_layers"]


def stage_layers(num_layers: int, layout: Any, pp_rank: int) -> list[int] | None:
    """The blocks pipeline rank ``pp_rank`` holds under the even split (its ``virtual_stages`` chunks ``pp_rank``,
    ``pp_rank + pp_size``, ... of ``L / (pp_size v)`` blocks each), or ``None`` when the layers do not split evenly."""
    p, v = layout.pp_size, layout.virtual_stages
    if num_layers % (p * v):
        return None
    n = num_layers // (p * v)
    return [c * n + i for c in range(pp_rank, p * v, p) for i in range(n)]


def rank_param_groups(model: ModelSpec, layout: Any, pp_rank: int) -> tuple[float, float]:
    """Parameters held by one rank of pipeline rank ``pp_rank`` (any of its tp and ep ranks; before dp sharding), as
    ``(dense, experts)``: the experts are the rank's ``E / ep`` experts of each of its MoE blocks (their own gradient
    and shard group, ``edp``); everything else is dense.

    Args:
        model: the model.
        layout: gives ``tp_size``, ``pp_size``, ``virtual_stages`` (the even split) and ``ep_size``.
        pp_rank: ``0 <= pp_rank < pp_size``.

    Returns:
        Parameter counts (floats: vocab padding rounds ``V / t`` up).

    Raises:
        ValueError: ``pp_rank`` out of range.
    """
    p, t = layout.pp_size, layout.tp_size
    if not 0 <= pp_rank < p:
        raise ValueError(f"pp_rank={pp_rank!r} is not valid: expected 0 <= pp_rank < pp_size={p}.")
    layers = stage_layers(model.num_layers, layout, pp_rank) if model.num_experts else None
    experts = 0.0
    if layers is None:  # a dense model (or an uneven split: the average block)
        split, replicated = model.layer_params()
        n = model.num_layers / p * (split / t + replicated)
    else:
        n = 0.0
        for layer in layers:
            split, replicated, expert = model.block_params(layer)
            n += split / t + replicated
            experts += expert / layout.ep_size
    vocab_shard = math.ceil(model.vocab_size / t) * model.hidden_size
    if pp_rank == 0:
        n += model.embedding_params() - model.vocab_size * model.hidden_size + vocab_shard  # position table whole
    if pp_rank == p - 1:
        n += model.head_params() - model.vocab_size * model.hidden_size
        if not (model.tied_embeddings and p == 1):  # a tied head on the embedding's rank is the same tensor
            n += vocab_shard
    return n, experts


def rank_params(model: ModelSpec, layout: Any, pp_rank: int) -> float:
    """Parameters held by one rank of pipeline rank ``pp_rank`` (any of its tp and ep ranks; before dp sharding): the
    sum of :func:`rank_param_groups`.

    Raises:
        ValueError: ``pp_rank`` out of range.
    """
    return sum(rank_param_groups(model, layout, pp_rank))


def model_state_bytes(params: float, dp_mode: str, dp_size: float, precision: Precision) -> float:
    """Bytes of parameters, gradients and optimizer state per rank (Rajbhandari et al. 2020, §5.1).

    Args:
        params: parameters ``Psi`` of the rank before dp sharding (:func:`rank_params`).
        dp_mode: ``"ddp"``, ``"zero1"``, ``"zero2"`` or ``"zero3"``.
        dp_size: ``d``, the ranks the ZeRO modes shard over (the runtime's ``dp_shard_cp`` mesh for dense
            parameters, ``edp_shard`` for experts).
        precision: bytes per parameter ``P``, gradient ``G`` and optimizer state ``K``.

    Returns:
        ddp ``(P+G+K) Psi``; zero1 ``(P+G) Psi + K Psi/d``; zero2 ``P Psi + (G+K) Psi/d``; zero3 ``(P+G+K) Psi/d``.

    Raises:
        ValueError: an unknown ``dp_mode``.
    """
    pb, gb, ob, d = precision.param_bytes, precision.grad_bytes, precision.optimizer_bytes, dp_size
    per_param = {
        "ddp": pb + gb + ob,
        "zero1": pb + gb + ob / d,
        "zero2": pb + (gb + ob) / d,
        "zero3": (pb + gb + ob) / d,
    }
    if dp_mode not in per_param:
        raise ValueError(f"dp_mode={dp_mode!r} is not valid: expected one of {sorted(per_param)}.")
    return params * per_param[dp_mode]
