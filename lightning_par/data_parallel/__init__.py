"""Data parallelism on the dp axis: the bucketed, overlapped gradient reducer and its compression hooks."""

from lightning_par.data_parallel.compression import COMM_HOOKS, PowerSGDState
from lightning_par.data_parallel.reducer import CommStats, GradientReducer

__all__ = ["COMM_HOOKS", "CommStats", "GradientReducer", "PowerSGDState"]
