"""Side-by-side benchmarks: each section measures ours against its baselines in one run and prints ratios.

    python recipes/benchmark.py                          # every section
    python recipes/benchmark.py --only zero --quick      # one section, short runs
    python recipes/benchmark.py --only ddp --runs 2      # twice, and how far the two runs' ratios are apart

On CPU, absolute times mean little: read the ratios, each measured against a baseline in the same launch (the
contenders take turns step by step). With ``--runs 2`` every ratio column ("x / y") of the two runs is compared
cell by cell and the largest relative difference is printed: the figure to check before trusting a ratio on a shared
machine (the goal for ``--quick``: within 10%).
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import time

_RATIO_HEADER = re.compile(r"(^|\s)/\s")


def _sections() -> dict[str, str]:
    """Section name -> module: every module of ``lightning_par.benchmarks`` that declares ``SECTION`` (read from its
    source, so that ``--only`` imports one), in the order of their ``ORDER``; each exposes ``run(quick: bool) -> str``
    (markdown tables)."""
    import ast
    from pathlib import Path

    import lightning_par.benchmarks as package

    found = []
    for path in sorted(Path(package.__file__).parent.glob("*.py")):
        constants = {target.id: node.value.value for node in ast.parse(path.read_text()).body
                     if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                     for target in node.targets if isinstance(target, ast.Name)}
        if "SECTION" in constants:
            found.append((constants.get("ORDER", 0), constants["SECTION"], f"{package.__name__}.{path.stem}"))
    return {name: module for _, name, module in sorted(found)}


SECTIONS = _sections()


def _ratio_cells(markdown: str) -> list[tuple[str, float]]:
    """``(label, value)`` of every numeric cell under a ratio header (``"x / y"`` or ``"/ y"``) of every table."""
    cells: list[tuple[str, float]] = []
    header: list[str] = []
    for line in markdown.splitlines():
        if not line.startswith("|"):
            header = []
            continue
        row = [c.strip() for c in line.strip().strip("|").split("|")]
        if not header:
            header = row
            continue
        if all(set(c) <= set("-: ") for c in row):
            continue
        for name, cell in zip(header, row):
            if not _RATIO_HEADER.search(name):
                continue
            try:
                cells.append((f"{row[0]} {row[1]} | {name}", float(cell)))
            except ValueError:
                continue
    return cells


def compare_runs(first: str, second: str) -> str:
    """The largest relative difference between the ratio cells of two runs' tables (a line of text)."""
    a, b = _ratio_cells(first), _ratio_cells(second)
    worst, where = 0.0, "-"
    for (label, x), (_, y) in zip(a, b):
        if max(abs(x), abs(y)) == 0:
            continue
        diff = abs(x - y) / max(abs(x), abs(y))
        if diff > worst:
            worst, where = diff, f"{label}: {x} vs {y}"
    return f"run to run: largest difference between ratio cells {worst:.1%} ({len(a)} cells; at {where})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {sorted(SECTIONS)}")
    parser.add_argument("--quick", action="store_true", help="short runs")
    parser.add_argument("--runs", type=int, default=1, help="run each section this many times and compare ratios")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        parser.error(f"--only={args.only!r}: unknown section(s) {unknown}; expected some of {sorted(SECTIONS)}")
    if args.runs < 1:
        parser.error(f"--runs={args.runs}: expected an integer >= 1")
    for name in names:
        tables = []
        for i in range(args.runs):
            start = time.perf_counter()
            tables.append(importlib.import_module(SECTIONS[name]).run(quick=args.quick))
            print(tables[-1])
            print(f"\n({name}, run {i + 1}/{args.runs}: {time.perf_counter() - start:.0f} s)\n", flush=True)
        if len(tables) > 1:
            print(f"{name}: {compare_runs(tables[0], tables[1])}\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
