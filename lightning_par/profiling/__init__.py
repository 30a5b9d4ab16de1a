"""Per-rank timelines of profiled steps: read ``torch.profiler`` Chrome traces into lanes, draw them.

The callback that records them is :class:`lightning_par.callbacks.TimelineCallback`; ``python -m
lightning_par.profiling DIR`` redraws ``DIR/timeline.png`` from the ``rank<r>.json`` traces in ``DIR``.
"""

from lightning_par.profiling.draw import draw_timeline
from lightning_par.profiling.trace import RankTimeline, Segment, align_timelines, read_trace, timeline_figures

__all__ = ["RankTimeline", "Segment", "align_timelines", "draw_timeline", "read_trace", "timeline_figures"]
