"""Lightning callbacks a layout cannot train with, refused before the first step; each axis of the registry says which
kinds it refuses under which sizes or modes (:attr:`lightning_par.axis_registry.Axis.refused_callbacks`)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_par.axes import AXES

__all__ = ["check_callbacks", "refused_callbacks"]

#: ``(kind, what goes wrong, the layouts where it runs)``, for the error message.
_WHY: tuple[tuple[str, str, str], ...] = (
    ("weight_averaging",
        "its averaged copy of the model holds whole tensors, and here each rank holds shards or one pipeline stage of "
        "the parameters.",
        "ddp_overlap, zero1, zero2 and context parallelism (whole parameters on every rank)",
    ),
    ("finetuning",
        "the gradient reducer is built for the parameters that train at the start, so modules it unfreezes later "
        "would not be averaged across replicas (each would drift on its own gradient).",
        "dp_mode='zero3' (FSDP2, with tp too) and tp without dp replicas",
    ),
    ("pruning",
        "pruning re-registers each pruned weight as '<name>_orig' with a mask, which the sharded optimizer state and "
        "DTensor shards do not follow.",
        "dp_mode='ddp' without tp or pp (with context or expert parallelism too)",
    ),
)


def refused_callbacks(dims: Any, options: Any) -> dict[str, list[str]]:
    """``{kind: [what rules it out, one entry per axis]}`` under this layout, from every registered axis."""
    out: dict[str, list[str]] = {}
    for axis in AXES:
        if axis.refused_callbacks is not None:
            for kind, why in axis.refused_callbacks(dims, options).items():
                out.setdefault(kind, []).append(why)
    return out


def _kind(callback: Any) -> str | None:
    from lightning.pytorch.callbacks import (
        BaseFinetuning,
        ModelPruning,
        StochasticWeightAveraging,
        WeightAveraging,
    )

    if isinstance(callback, (StochasticWeightAveraging, WeightAveraging)):
        return "weight_averaging"
    if isinstance(callback, BaseFinetuning):
        return "finetuning"
    if isinstance(callback, ModelPruning):
        return "pruning"
    return None


def check_callbacks(callbacks: list[Any], module: torch.nn.Module, dims: Any, options: Any) -> None:
    """Refuse, before the first step, Lightning callbacks that would crash or train wrongly under this layout.

    Each was run under every registered strategy and layout by the Lightning feature matrix (``tests/strategies/test_lightning_matrix.py``,
    2026-11-28) against one process:

    - ``StochasticWeightAveraging`` and ``WeightAveraging`` (``EMAWeightAveraging``) keep a deep copy of the module and
      copy whole tensors in and out of it. Where parameters are DTensor shards (``tp_size``/``ep_size`` > 1,
      ``dp_mode="zero3"``) the first average raised ``aten.copy_.default got mixed torch.Tensor and DTensor``; under
      pipelining the stages' optimizer steps fell out of step and the run hung until the collective timeout.
      Lightning refuses SWA for its own FSDP the same way.
    - ``BaseFinetuning`` (``BackboneFinetuning``) freezes modules before training and adds them to the optimizer
      later. The dp gradient reducer (``ddp``, ``zero1``, ``zero2``, over dp and cp ranks) is built for the parameters
      that train at the start, so the unfrozen ones were never averaged: each replica stepped on its own gradient and
      the replicas drifted apart silently (Lightning's own DDP does the same); ZeRO-1/2 raised ``KeyError`` on the new
      param group; pipelining hung. FSDP2 (``zero3``) and tensor parallelism without dp replicas match one process.
    - ``ModelPruning`` re-registers each pruned weight as ``<name>_orig`` and a mask. ZeRO-1/2 then trained wrongly
      from the first step after pruning (loss rel 8.5e-3), and DTensor shards refused the masked in-place update.
      Plain ``dp_mode="ddp"`` (with cp or ep) matches one process.

    Args:
        callbacks: the Trainer's callbacks.
        module: the parallelised module (a DTensor parameter rules weight averaging out under any layout).
        dims: the run's :class:`~lightning_par.parallel_dims.ParallelDims`.
        options: the run's :class:`~lightning_par.parallelize.ParallelOptions`.

    Raises:
        ValueError: naming the callback, the sizes or dp mode that rule it out, and the layouts where it runs.
    """
    refused = refused_callbacks(dims, options)
    for callback in callbacks:
        kind = _kind(callback)
        if kind is None:
            continue
        why = refused.get(kind, [])
        if not why and kind == "weight_averaging" and any(isinstance(p, DTensor) for p in module.parameters()):
            why = ["DTensor parameters"]
        if why:
            detail, runs = next((d, r) for k, d, r in _WHY if k == kind)
            raise ValueError(f"{type(callback).__name__} is not supported with {', '.join(why)}: {detail} It runs "
                             f"under {runs}; remove the callback or train under one of those.")
