"""One PNG of a profiled run: a lane per rank, compute above, communication below, idle time hatched.

Each lane has two rows. The upper row shows what the rank computed (forward, backward, for split backwards the input-
and weight-gradient halves, the loss, the optimizer step); everything else inside a profiled step is *idle* (hatched
grey): waiting for a peer, a pipeline receive (the bubble), or for communication that compute did not hide. The lower
row shows every collective the backend ran, coloured per collective; a bar under a backward bar is communication
hidden behind compute. Drawn with matplotlib (Agg, no display needed).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from lightning_par.profiling.trace import COLLECTIVES, COMPUTE_KINDS, RankTimeline

__all__ = ["COLORS", "draw_timeline"]

#: Colour of each compute kind and collective.
COLORS: dict[str, str] = {
    "forward": "#4C72B0",
    "loss": "#64B5CD",
    "backward": "#DD8452",
    "backward_input": "#C44E52",
    "backward_weight": "#8172B3",
    "optimizer": "#55A868",
    "all_reduce": "#D62728",
    "all_gather": "#9467BD",
    "reduce_scatter": "#8C564B",
    "broadcast": "#E377C2",
    "all_to_all": "#17BECF",
    "send": "#7F7F7F",
    "recv": "#BCBD22",
    "barrier": "#000000",
    "other": "#AAAAAA",
}
_IDLE = "#EEEEEE"


def draw_timeline(
    timelines: Sequence[RankTimeline],
    path: str | Path,
    title: str = "",
    lane_labels: Sequence[str] | None = None,
) -> Path:
    """Draw ``timelines`` (one per rank, in rank order) into a PNG at ``path``.

    Args:
        timelines: the ranks' timelines (:func:`lightning_par.profiling.trace.read_trace`).
        path: the PNG to write (parent directories are created).
        title: a title line (strategy, layout, steps).
        lane_labels: the label of each lane (default ``"rank r"``), e.g. with the rank's mesh coordinates.

    Returns:
        ``path``.

    Raises:
        ValueError: no timeline.
    """
    if not timelines:
        raise ValueError("draw_timeline needs at least one rank's timeline.")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    labels = list(lane_labels) if lane_labels is not None else [f"rank {t.rank}" for t in timelines]
    n = len(timelines)
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.95 * n))
    start = min(s for t in timelines for s, _ in t.steps)
    end = max(e for t in timelines for _, e in t.steps)
    span_ms = max((end - start) * 1e3, 1e-9)
    used: set[str] = set()
    for lane, timeline in enumerate(timelines):
        y = n - 1 - lane  # rank 0 on top
        for s, e in timeline.steps:
            ax.broken_barh([((s - start) * 1e3, (e - s) * 1e3)], (y + 0.42, 0.5), facecolors=_IDLE, edgecolor="#BBBBBB",
                           hatch="///", linewidth=0.3)
        for seg in timeline.segments:
            x, w = (seg.start - start) * 1e3, max(seg.duration * 1e3, span_ms * 1e-4)
            band = (y + 0.42, 0.5) if seg.row == "compute" else (y + 0.08, 0.28)
            ax.broken_barh([(x, w)], band, facecolors=COLORS.get(seg.kind, COLORS["other"]), edgecolor="white",
                           linewidth=0.2)
            used.add(seg.kind)
            if seg.label and w > span_ms * 0.025:
                ax.text(x + w / 2, y + 0.67, seg.label, ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks([n - 1 - i + 0.5 for i in range(n)])
    ax.set_yticklabels(labels)
    ax.set_ylim(0, n)
    ax.set_xlim(0, span_ms)
    ax.set_xlabel("time (ms) from the first profiled step; upper row: compute, lower row: communication")
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    order = [k for k in COMPUTE_KINDS + COLLECTIVES if k in used]
    handles = [Patch(facecolor=COLORS[k], label=k.replace("_", " ")) for k in order]
    handles.append(Patch(facecolor=_IDLE, edgecolor="#BBBBBB", hatch="///", label="idle / bubble"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.55 / max(1.0, n / 2)),
              ncol=min(8, len(handles)), fontsize=8, frameon=False)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return out
