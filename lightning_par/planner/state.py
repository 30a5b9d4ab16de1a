"""The model-state formulas, at their old path: they live in :mod:`lightning_par.state_cost` (below the planner and
the axes, which read them)."""

from lightning_par.state_cost import model_state_bytes, rank_param_groups, rank_params, stage_layers

__all__ = ["model_state_bytes", "rank_param_groups", "rank_params", "stage_layers"]
