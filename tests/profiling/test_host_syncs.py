"""The register of the training step's host reads (``lightning_par/profiling/host_syncs.py``) on the CPU: the docs
hold exactly its table, every site it names exists, the counts the CUDA test (``tests/profiling/test_host_syncs_gpu.py``)
allows per layout, and the counting of synchronisation warnings on a made-up warning stream."""

from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

import pytest

from lightning_par.benchmarks.gpu_check import LAYOUTS
from lightning_par.profiling.host_syncs import (
    HOST_READS,
    PACKAGE,
    SYNC_MESSAGE,
    StepFacts,
    SyncRecorder,
    check_counts,
    count_syncs,
    expected_syncs,
    markdown_table,
    step_facts,
)

DOCS = PACKAGE.parent / "docs" / "host-syncs.md"


def test_the_docs_hold_the_registers_table():
    text = DOCS.read_text()
    found = re.search(r"-->\n(\| where.*?)\n<!-- end of the generated table -->", text, re.S)
    assert found, "docs/host-syncs.md: the generated table's markers are missing"
    assert found.group(1) == markdown_table(), (
        "docs/host-syncs.md differs from HOST_READS: paste the output of "
        "`python -m lightning_par.profiling.host_syncs` between its markers")


def test_every_site_of_the_register_exists():
    for read in HOST_READS:
        path = PACKAGE / read.file
        assert path.is_file(), read.file
        names = {n.name for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        missing = set(read.functions) - names
        assert not missing, f"{read.file}: no function {sorted(missing)} (renamed? update HOST_READS)"


def _expected(name: str) -> list[dict[str, int]]:
    layout = LAYOUTS[name]
    return [expected_syncs(step_facts(layout, r)) for r in range(layout[0])]


def test_expected_counts_per_layout():
    """The GPU check's step reads nothing to the host in the dp, tp and HSDP layouts; under cp the positions once per
    attention layer; under pp the stages' share on every rank and the logged values on the last stage's rank (rank 0 for the V-shaped schedule); under ep the dispatch's split sizes per MoE layer and the
    MoE figures once."""
    for name in LAYOUTS:
        if not name.startswith(("pp", "ep", "cp")):
            assert _expected(name) == [{}] * LAYOUTS[name][0], name
    share = {"pipeline_parallel/steps.py: _share_step": 2, "pipeline_parallel/user_steps.py: share": 4}
    last = {**share, "pipeline_parallel/user_steps.py: _read_to_host": 1}
    assert _expected("pp2-1f1b") == [share, last]
    assert _expected("pp2-interleaved_1f1b") == [share, last]
    assert _expected("pp2-zbv_zero_bubble") == [last, share]
    ep = {"expert_parallel/dispatch.py: dispatch": 2, "expert_parallel/metrics.py: moe_step_metrics": 1}
    assert _expected("ep2") == [ep, ep]
    assert _expected("cp2-ring") == [{"context_parallel/attention.py: forward": 4}] * 2
    assert _expected("cp2-all_to_all") == [{"context_parallel/attention.py: _strictly_increasing": 4}] * 2
    assert expected_syncs(StepFacts(moe_layers=3)) == {"expert_parallel/grouped.py: expert_ffn": 3,
                                                       "expert_parallel/metrics.py: moe_step_metrics": 1}


def _line(file: str, text: str) -> int:
    lines = (PACKAGE / file).read_text().splitlines()
    return next(i + 1 for i, line in enumerate(lines) if text in line)


def test_counting_attributes_each_sync_to_the_innermost_function_of_the_package():
    steps = str(PACKAGE / "pipeline_parallel/steps.py")
    share_line = _line("pipeline_parallel/steps.py", "stats = torch.stack(parts).tolist()")
    dispatch = str(PACKAGE / "expert_parallel/dispatch.py")
    dispatch_line = _line("expert_parallel/dispatch.py", "host = torch.cat([per_rank.sum(1)")
    torch_file = "/site-packages/torch/distributed/distributed_c10d.py"
    sync = f"{SYNC_MESSAGE} (from c10/cuda)"
    events = [
        (sync, [(steps, share_line)]),  # the .tolist() itself
        (sync, [(torch_file, 10), (steps, share_line), (steps, 1)]),  # inside torch, called from _share_step
        (sync, [(dispatch, dispatch_line)]),
        (sync, [(dispatch, dispatch_line)]),
        (sync, [(torch_file, 10), ("/site-packages/lightning/pytorch/loops/fit_loop.py", 5)]),  # none of ours
        ("some other warning", [(steps, share_line)]),  # not a synchronisation: skipped
    ]
    counts = count_syncs(events)
    assert counts == {"pipeline_parallel/steps.py: _share_step": 2, "expert_parallel/dispatch.py: dispatch": 2,
                      "other": 1}
    pp_rank0 = expected_syncs(step_facts(LAYOUTS["pp2-1f1b"], 0))
    assert check_counts({"pipeline_parallel/steps.py: _share_step": 2, "other": 50}, pp_rank0) == []
    problems = check_counts(counts, pp_rank0)  # dispatch is not read under pp: 2 > 0
    assert problems == ["expert_parallel/dispatch.py: dispatch: 2 synchronisations in the step (not in HOST_READS)"]
    over = check_counts({"pipeline_parallel/steps.py: _share_step": 3}, pp_rank0)
    assert over == ["pipeline_parallel/steps.py: _share_step: 3 synchronisations in the step (HOST_READS allows 2)"]


def test_the_recorder_keeps_each_warnings_stack():
    """The recording half of :class:`SyncRecorder` (CUDA's sync debug mode left alone): every warning, repeated ones
    too, with the stack of the code that raised it; the warning filters are restored after."""
    def read_twice() -> None:
        for _ in range(2):
            warnings.warn(f"{SYNC_MESSAGE} (made up)", UserWarning, stacklevel=1)

    with SyncRecorder(cuda=False) as rec:
        read_twice()
        warnings.warn("unrelated", UserWarning, stacklevel=1)
    assert len(rec.events) == 3
    message, stack = rec.events[0]
    assert SYNC_MESSAGE in message and stack[0][0] == __file__
    assert any(f == __file__ for f, _ in stack[1:])
    assert count_syncs(rec.events, package=Path(__file__).parent) == {"test_host_syncs.py: read_twice": 2}
    with pytest.warns(UserWarning, match="after"):
        warnings.warn("after", UserWarning, stacklevel=1)
