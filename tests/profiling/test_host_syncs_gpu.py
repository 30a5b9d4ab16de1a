"""One step of every layout of the GPU check (``lightning_par.benchmarks.gpu_check.LAYOUTS``: two ranks on the one
GPU, four for HSDP, under the backend map ``cuda:gloo``, as the check's two-rank part runs them) under
``torch.cuda.set_sync_debug_mode("warn")``: each synchronisation of the last (second) step is attributed to the
innermost function of the package on the stack, and no function may synchronise more often than the register of
host reads allows (``lightning_par/profiling/host_syncs.py``, the table of ``docs/host-syncs.md``), nor at all
without a row there. Lightning's and torch's own synchronisations (``other``) are printed, not bounded.

One launch per world size (the layouts one after the other in the same processes), spawned (the parent may have
touched CUDA). Skipped without CUDA; fails instead under ``LP_REQUIRE_CUDA=1`` (``scripts/gpu_check.sh``, which also
sets ``LP_HOST_SYNCS_OUT``: the measured table is written there).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lightning_par.benchmarks.gpu_check import LAYOUTS
from lightning_par.profiling.host_syncs import check_counts, expected_syncs, step_facts

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def measured() -> dict[str, list[dict]]:
    """``{layout: [result of rank 0, rank 1, ...]}``; ``{}`` without CUDA (the autouse fixture then skips)."""
    if not torch.cuda.is_available():
        return {}
    from lightning_par.benchmarks.gpu_check import measure_syncs, sync_table

    out = measure_syncs()
    table = sync_table(out)[0]
    print("\nsynchronisations in the second step:\n" + table)
    if os.environ.get("LP_HOST_SYNCS_OUT"):  # scripts/gpu_check.sh keeps the table next to its others
        header = f"Synchronisations in one training step, every layout on {torch.cuda.get_device_name(0)} (cuda:gloo):"
        Path(os.environ["LP_HOST_SYNCS_OUT"]).write_text(f"{header}\n\n{table}\n")
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_one_step_synchronises_only_where_the_docs_say(measured, name):
    results = measured[name]
    for rank, res in enumerate(results):
        assert res["error"] is None, f"{name} rank {rank}: {res['error']}"
        assert res["device"].startswith("cuda") and res["backend"] == "cuda:gloo", res
        problems = check_counts(res["syncs"], expected_syncs(step_facts(LAYOUTS[name], rank)))
        assert not problems, (f"{name} rank {rank} synchronised where docs/host-syncs.md does not allow it (measured: "
                              f"{res['syncs']}):\n" + "\n".join(problems))
