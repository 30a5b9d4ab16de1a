"""Repeat the preemption and stall tests (issue 25: "each 5 times") and print pass counts per case.

Not part of CI (CI runs each case once). Every torchrun target is included (``LP_FAULT_ALL=1``).

    .venv/bin/python .ci/repeat_faults.py --repeat 5
    .venv/bin/python .ci/repeat_faults.py --repeat 5 -k "stuck or torchrun"
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = [
    "tests/fault/test_preemption.py",
    "tests/fault/test_faults.py::test_a_rank_stuck_in_its_forward_is_named_not_the_peer_waiting_for_it",
    "tests/fault/test_faults.py::test_a_stopped_rank_ends_the_recipe_in_seconds",
    "tests/fault/test_faults.py::test_a_killed_rank_is_named_with_its_signal",
]
RESULT = re.compile(r"^(PASSED|FAILED|ERROR) (\S+)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5, help="times to run every case (default 5)")
    parser.add_argument("-k", default=None, help="pytest -k expression to select cases")
    parser.add_argument("--log-dir", default=None, help="where each round's pytest output goes (default: a new "
                        "temporary directory, printed)")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error(f"--repeat={args.repeat} is not valid: expected an integer >= 1")
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="repeat-faults-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"pytest output of each round: {log_dir}/round-<n>.log", flush=True)
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    env = {**os.environ, "LP_FAULT_ALL": "1"}
    started = time.monotonic()
    for i in range(args.repeat):
        cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *TESTS]
        if args.k:
            cmd += ["-k", args.k]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        (log_dir / f"round-{i + 1}.log").write_text(proc.stdout + proc.stderr)
        for line in proc.stdout.splitlines():
            match = RESULT.match(line)
            if match:
                counts[match.group(2)][match.group(1)] += 1
        failed_now = [line for line in proc.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
        print(f"round {i + 1}/{args.repeat}: pytest exit {proc.returncode} ({time.monotonic() - started:.0f} s so far)"
              + "".join(f"\n  {line}" for line in failed_now), flush=True)
    print(f"\n{'case':<110} passed/runs")
    failed = False
    for case in sorted(counts):
        c = counts[case]
        runs = sum(c.values())
        failed = failed or c["PASSED"] != runs
        print(f"{case:<110} {c['PASSED']}/{runs}")
    return 1 if failed or not counts else 0


if __name__ == "__main__":
    sys.exit(main())
