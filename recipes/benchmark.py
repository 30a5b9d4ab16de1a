"""Side-by-side benchmarks: each section measures ours against a baseline in one run and prints ratios.

    python recipes/benchmark.py                 # every section
    python recipes/benchmark.py --only ddp      # one section
    python recipes/benchmark.py --quick         # short runs (CI-sized)

On CPU, absolute times mean little: read the ratios. Sections are added by the strategies as they land.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

#: section name -> module under lightning_par.benchmarks exposing run(quick: bool) -> str (a markdown table).
SECTIONS = {
    "ddp": "lightning_par.benchmarks.ddp",
    "tp": "lightning_par.benchmarks.tensor_parallel",
    "zero": "lightning_par.benchmarks.zero",
    "pp": "lightning_par.benchmarks.pipeline",
    "ac": "lightning_par.benchmarks.activation_checkpointing",
    "gpu": "lightning_par.benchmarks.single_gpu",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {sorted(SECTIONS)}")
    parser.add_argument("--quick", action="store_true", help="short runs")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        parser.error(f"--only={args.only!r}: unknown section(s) {unknown}; expected some of {sorted(SECTIONS)}")
    for name in names:
        start = time.perf_counter()
        table = importlib.import_module(SECTIONS[name]).run(quick=args.quick)
        print(table)
        print(f"\n({name}: {time.perf_counter() - start:.0f} s)\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
