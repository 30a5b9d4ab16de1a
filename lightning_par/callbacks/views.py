"""What callbacks read from a lightning_par strategy, whatever the layout: the whole model's gradients and gradient
norms (from :class:`~lightning_par.parallelize.ParallelModel`) and the run's figures for ``summary.json``.

:class:`StrategyViews` is a mixin of :class:`~lightning_par.strategies.base.MeshStrategy`; it reads the strategy's
``parallel`` (the :class:`~lightning_par.parallelize.ParallelModel`), ``optimizers``, ``parallel_dims``, ``options``,
``precision``, ``precision_options()`` and ``fault_tolerance``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["StrategyViews"]


class StrategyViews:
    """Gradients and figures of the whole model for callbacks (collective where they say so)."""

    parallel: Any
    parallel_dims: Any
    options: Any

    def grad_norm(self, norm_type: float | str = 2.0) -> Tensor:
        """The global gradient norm the optimizer step will see: over every dp shard, tp shard and pipeline stage
        (what norm clipping computes; one process's ``torch.nn.utils.get_total_norm`` of all gradients). Call it from
        ``on_before_optimizer_step`` (gradients reduced, before clipping) on every rank: it is collective.

        Returns:
            A float32 scalar tensor (CPU), the same on every rank.
        """
        assert self.parallel is not None
        params = [p for opt in self.optimizers for g in opt.param_groups for p in g["params"]]  # type: ignore[attr-defined]
        return self.parallel.grad_norm(params, float(norm_type))

    def full_grads(self) -> dict[str, Tensor]:
        """Every parameter's gradient in full, keyed by its one-process name (``{"model.0.weight": (out, in)}``),
        on every rank (CPU; gathered over dp shards, tp shards and pipeline stages: collective, and the whole gradient
        on each rank). Call it from ``on_before_optimizer_step``."""
        assert self.parallel is not None
        return self.parallel.full_grads()

    def grad_norms(self, norm_type: float | str = 2.0) -> dict[str, float]:
        """Lightning's ``lightning.pytorch.utilities.grad_norm(module, norm_type)`` for the whole model, whatever the
        layout: ``{"grad_{q}_norm/{name}": norm of each parameter's gradient, "grad_{q}_norm_total": the global
        norm}`` (from :meth:`full_grads`: collective, for small models; :meth:`grad_norm` is the cheap total)."""
        q = float(norm_type)
        norms = {f"grad_{q}_norm/{n}": g.float().norm(q) for n, g in self.full_grads().items()}
        if norms:
            norms[f"grad_{q}_norm_total"] = torch.stack(list(norms.values())).norm(q)
        return {k: float(v) for k, v in norms.items()}

    def summary_extras(self) -> dict[str, Any]:
        """Strategy figures for ``summary.json``: layout (every size), dp mode, precision, every axis's figures and
        fault tolerance's."""
        dims = self.parallel_dims
        if dims is None:
            return {}
        extras: dict[str, Any] = {
            "dp_size": dims.dp_size,
            "tp_size": dims.tp_size,
            "pp_size": dims.pp_size,
            **dims.sizes(),
            "dp_mode": self.options.dp_mode,
            "sequence_parallel": self.options.tensor_parallel.sequence_parallel,
            "activation_checkpointing": self.options.activation_checkpointing,
            "precision": self.precision,  # type: ignore[attr-defined]
        }
        zero = self.precision_options().zero  # type: ignore[attr-defined]
        if zero is not None and (zero.param_dtype or zero.reduce_dtype):
            extras["zero_param_dtype"] = str(zero.param_dtype) if zero.param_dtype else None
            extras["zero_reduce_dtype"] = str(zero.reduce_dtype) if zero.reduce_dtype else None
        if self.parallel is not None:
            extras.update(self.parallel.summary())
        extras.update(self.fault_tolerance.summary())  # type: ignore[attr-defined]
        return extras
