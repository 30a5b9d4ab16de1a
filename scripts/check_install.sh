#!/usr/bin/env bash
# A non-editable install in a fresh virtual environment runs the recipe from a directory outside the repository:
# conf/ ships in the wheel (lightning_par.conf) and the Hydra plugins are found.
#   bash scripts/check_install.sh [VENV_DIR]
# Needs the package index for the dependencies (torch comes from .ci/constraints.txt's pin).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$(mktemp -d /tmp/lp-install-XXXXXX)/venv}"
work="$(mktemp -d /tmp/lp-run-XXXXXX)"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q -c "$repo/.ci/constraints.txt" "$repo"
cd "$work"
"$venv/bin/python" -m lightning_par.train --info searchpath | grep -q "pkg://lightning_par.conf"
"$venv/bin/python" -m lightning_par.train model=tiny data=synthetic trainer=smoke hydra.run.dir="$work/run"
test -s "$work/run/summary.json" && test -s "$work/run/train.log"
echo "OK: non-editable install in $venv trained from $work"
