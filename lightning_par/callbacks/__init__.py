"""Lightning callbacks that measure a parallel run and write its summary."""

from lightning_par.callbacks.lr_scaling import LRScalingCallback
from lightning_par.callbacks.metrics import ParallelMetricsCallback, parallel_sizes
from lightning_par.callbacks.summary import RunSummaryCallback, build_summary
from lightning_par.callbacks.timeline import TimelineCallback

__all__ = [
    "LRScalingCallback",
    "ParallelMetricsCallback", "RunSummaryCallback", "TimelineCallback",
    "build_summary",
    "parallel_sizes",
]
