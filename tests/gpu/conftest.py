"""Tests with a CUDA path: skipped without a CUDA device, except under ``LP_REQUIRE_CUDA=1`` (``scripts/gpu_check.sh``),
where a missing device fails them instead, so the GPU check cannot pass by skipping."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(autouse=True)
def cuda_device() -> torch.device:
    if not torch.cuda.is_available():
        if os.environ.get("LP_REQUIRE_CUDA") == "1":
            pytest.fail("LP_REQUIRE_CUDA=1 but torch.cuda.is_available() is False: no CUDA device to test on.")
        pytest.skip("needs a CUDA device (run scripts/gpu_check.sh on a GPU machine)")
    return torch.device("cuda", 0)
