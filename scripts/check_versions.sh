#!/usr/bin/env bash
# Run the test suite (without the slow matrix cells and the end-to-end tests) against given torch and lightning versions, in a fresh
# virtual environment, from this checkout:
#   bash scripts/check_versions.sh 2.10.0 2.5.0      # the lower bounds of pyproject.toml
#   bash scripts/check_versions.sh 2.15.0 2.6.6      # the upper bounds
# Versions other than .ci/constraints.txt's pin come from the package index as CUDA builds (several GB).
set -euo pipefail
torch_version="${1:?torch version}"
lightning_version="${2:?lightning version}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="$(mktemp -d /tmp/lp-versions-XXXXXX)/venv"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q "torch==$torch_version" "lightning==$lightning_version" "hydra-core>=1.3.2,<1.4" \
    "omegaconf>=2.3,<2.4" "fairscale>=0.4.13" matplotlib pytest pytest-timeout
cd "$repo"
PYTHONPATH="$repo" "$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not slow and not e2e" tests
