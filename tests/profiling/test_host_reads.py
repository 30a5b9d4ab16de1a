"""The register of host reads (``lightning_par/profiling/host_syncs.py``, the table of ``docs/host-syncs.md``) against
what the code reads, on the CPU: one step of every layout of the GPU check, as its two-rank part runs them but on gloo,
under :class:`tests.support.device_rule.HostReads`, the CPU stand-in of CUDA's sync debug mode (a warning at every read to the
host of a tensor that would live on the GPU, and at every upload of Python data to a device). No function of the
package may read more often than its row allows, nor at all without one. The CUDA test
(``tests/profiling/test_host_syncs_gpu.py``) checks the same on a GPU, where it also sees the synchronisations inside kernels.

Before the register listed them, this found (and the package then fixed) ring attention's 14-28 reads per layer
(now one), the MoE figures' five reads per layer (now one per step), Lightning's upload of every step figure logged
as a Python float (now logged as CPU tensors), the pipeline's micro-batch index read once per micro-batch (now a
host tensor), and the pipeline's logged values read one by one per micro-batch (now one read per step).
"""

from __future__ import annotations

from typing import Any

import pytest

from lightning_par.benchmarks.gpu_check import LAYOUTS, sync_worker
from lightning_par.profiling.host_syncs import check_counts, expected_syncs, step_facts
from tests.support.device_rule import HostReads

pytestmark = pytest.mark.distributed


def stand_in_worker(names: list[str]) -> list[dict[str, Any]]:
    """One rank: :func:`~lightning_par.benchmarks.gpu_check.sync_worker` on the CPU under :class:`HostReads` (the
    recorder of the last step then counts the stand-in's warnings)."""
    with HostReads():
        return sync_worker(names, "cpu", "gloo", 2)


@pytest.fixture(scope="module")
def measured() -> dict[str, list[dict[str, Any]]]:
    from lightning_par.launcher import run_distributed

    out: dict[str, list[dict[str, Any]]] = {}
    for world in sorted({layout[0] for layout in LAYOUTS.values()}):
        names = [n for n, layout in LAYOUTS.items() if layout[0] == world]
        per_rank = run_distributed(stand_in_worker, world, (names,), timeout_s=300)
        for i, name in enumerate(names):
            out[name] = [per_rank[r][i] for r in range(world)]
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_host_read_of_the_step_is_in_the_register(measured, name):
    for rank, res in enumerate(measured[name]):
        assert res["error"] is None, f"{name} rank {rank}: {res['error']}"
        problems = check_counts(res["syncs"], expected_syncs(step_facts(LAYOUTS[name], rank)))
        assert not problems, (f"{name} rank {rank} reads where docs/host-syncs.md does not say (measured: "
                              f"{res['syncs']}):\n" + "\n".join(problems))


def test_the_stand_in_sees_the_reads_it_should(measured):
    """It cannot pass by seeing nothing: the layouts with documented reads show them (ep's split sizes, the
    pipeline's share, ring attention's positions)."""
    assert measured["ep2"][0]["syncs"].get("expert_parallel/dispatch.py: dispatch") == 2
    assert measured["pp2-1f1b"][1]["syncs"].get("pipeline_parallel/steps.py: _share_step") == 2
    assert measured["cp2-ring"][0]["syncs"].get("context_parallel/attention.py: forward") == 4
