"""Lightning callbacks that measure a parallel run and write its summary."""

from lightning_par.callbacks.metrics import ParallelMetricsCallback, parallel_sizes
from lightning_par.callbacks.summary import RunSummaryCallback, build_summary

__all__ = ["ParallelMetricsCallback", "RunSummaryCallback", "build_summary", "parallel_sizes"]
