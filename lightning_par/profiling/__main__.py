"""``python -m lightning_par.profiling DIR [--out PNG]``: redraw a timeline from the per-rank Chrome traces
``DIR/rank<r>.json`` that :class:`lightning_par.callbacks.TimelineCallback` wrote."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from lightning_par.profiling import align_timelines, draw_timeline, read_trace, timeline_figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_par.profiling", description=__doc__)
    parser.add_argument("dir", type=Path, help="directory holding rank<r>.json traces")
    parser.add_argument("--out", type=Path, default=None, help="PNG to write (default DIR/timeline.png)")
    args = parser.parse_args(argv)
    traces = sorted(args.dir.glob("rank*.json"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0))
    if not traces:
        parser.error(f"no rank<r>.json trace in {args.dir}")
    timelines = align_timelines([read_trace(p, int(re.sub(r"\D", "", p.stem))) for p in traces])
    out = draw_timeline(timelines, args.out or args.dir / "timeline.png", title=str(args.dir))
    print(out)
    for key, value in timeline_figures(timelines).items():
        print(key, [round(v, 4) for v in value])


if __name__ == "__main__":
    main()
