"""The generated Hugging Face matrix (issue 33): every causal-LM architecture of ``transformers``' registry, built tiny,
under the layouts it claims, against one process (see :mod:`tests.support.hf_matrix` for the rows, the tiny config,
the claims and the verdicts).

Not slow (CI): every layout for a few architectures (:data:`FEW`), one launch of 2 ranks per layout. Slow: every
architecture in one of the layouts it claims (rotated over its claims by its place in the registry; building and
stepping 196 architectures once each takes longer than CI's budget), and every claimed cell of every architecture. A cell passes at parity or refused before start (a ``ValueError`` before the first
training batch); a cell that trains and differs, or crashes after start, fails with its measured errors. An
architecture that cannot be built tiny on CPU is skipped with its reason (the table shows it).

Cells failing today in the scope of issue 33's open fixes are :data:`KNOWN` (``xfail(strict=True)``: a fix turns them
into failures to flip).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support import hf_matrix as M

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

MODEL_TYPES = M.registry()

#: (model_type, layout) -> what was measured (2026-11-27, transformers 5.24), for cells that train and differ or crash
#: after start today. "hftp"/"hfpp": in the scope of issue 33's fixes under way; "new": found by this matrix.
KNOWN: dict[tuple[str, str], str] = {
    # new: found by this matrix
}

#: Architectures issue 33 requires to build (the user's attention backend kept, or one that the model allows chosen).
KNOWN_CANNOT: dict[str, str] = {
}

#: Every layout for a few architectures (besides each architecture's rotated CI layout).
FEW: dict[str, list[str]] = {
    "zero3": ["llama", "qwen3_moe"],
    "tp2": ["llama", "qwen3_moe"],
    "tp2sp": ["llama", "qwen3"],
    "pp2": ["llama", "qwen3_moe"],
    "cp2": ["llama", "qwen3", "roberta"],  # roberta: refused before start (its own positions), under the Trainer
    "ep2": ["qwen3_moe", "mixtral"],
}


def _marks(model_type: str, layout: str) -> list[Any]:
    reason = KNOWN.get((model_type, layout))
    return [pytest.mark.xfail(strict=True, reason=reason)] if reason else []


def ci_layout(model_type: str, claims: list[str]) -> str:
    """The layout an architecture runs in under CI: its claims rotated by its place in the registry."""
    return claims[MODEL_TYPES.index(model_type) % len(claims)]


@pytest.fixture(scope="module")
def probes() -> dict[str, dict[str, Any]]:
    """Each architecture built tiny and stepped once in this process: its claims, or why it cannot be built."""
    with M.quiet():
        return {mt: M.probe(mt) for mt in MODEL_TYPES}


def _run_cells(by_layout: dict[str, list[str]]) -> dict[tuple[str, str], dict[str, Any]]:
    verdicts = {}
    with M.quiet():
        for layout, names in by_layout.items():
            results = M.run_layout(layout, names)
            for mt in names:
                verdicts[mt, layout] = M.judge(mt, layout, results[mt])
    return verdicts


@pytest.fixture(scope="module")
def rotated_cells(probes) -> dict[tuple[str, str], dict[str, Any]]:
    """The verdicts of each buildable architecture in its rotated layout; one launch per layout."""
    by_layout: dict[str, list[str]] = {layout: [] for layout in M.LAYOUTS}
    for mt, found in probes.items():
        if "claims" in found:
            by_layout[ci_layout(mt, found["claims"])].append(mt)
    return _run_cells(by_layout)


@pytest.fixture(scope="module")
def few_probes() -> dict[str, dict[str, Any]]:
    with M.quiet():
        return {mt: M.probe(mt) for mt in sorted({mt for names in FEW.values() for mt in names})}


@pytest.fixture(scope="module")
def few_cells() -> dict[tuple[str, str], dict[str, Any]]:
    """The verdicts of :data:`FEW`; one launch per layout."""
    return _run_cells(FEW)


def _check_cell(model_type: str, layout: str, verdict: dict[str, Any]) -> None:
    assert verdict["status"] in ("PASS", "refused"), (
        f"{model_type} under {layout}: {verdict['status']}: {verdict['detail']}"
    )
    if verdict["status"] == "refused":  # a refusal names what is refused
        assert verdict["detail"].startswith("ValueError: ") and len(verdict["detail"]) > 30, verdict["detail"]


def _check_builds(model_type: str, found: dict[str, Any]) -> None:
    if "cannot" in found:
        if model_type in KNOWN_CANNOT:
            pytest.xfail(f"{KNOWN_CANNOT[model_type]}: {found['cannot']}")
        pytest.skip(f"cannot build: {found['cannot']}")
    assert model_type not in KNOWN_CANNOT, f"{model_type} builds now: remove it from KNOWN_CANNOT"


@pytest.mark.slow
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_every_architecture_in_one_layout(probes, rotated_cells, model_type: str) -> None:
    found = probes[model_type]
    _check_builds(model_type, found)
    layout = ci_layout(model_type, found["claims"])
    verdict = rotated_cells[model_type, layout]
    known = KNOWN.get((model_type, layout))
    if known is not None:  # strict: a known failure that passes now must be flipped
        assert verdict["status"] == "FAIL", f"{model_type} under {layout} is {verdict['status']} now: flip KNOWN"
        pytest.xfail(f"{known}; today: {verdict['detail']}")
    _check_cell(model_type, layout, verdict)


@pytest.mark.parametrize(("model_type", "layout"), [pytest.param(mt, layout, marks=_marks(mt, layout))
                                                    for layout, names in FEW.items() for mt in names])
def test_every_layout_for_a_few_architectures(few_probes, few_cells, model_type: str, layout: str) -> None:
    found = few_probes[model_type]
    assert "claims" in found, f"{model_type}: {found}"
    assert layout in found["claims"], f"{model_type} does not claim {layout}: {found['claims']}"
    _check_cell(model_type, layout, few_cells[model_type, layout])


@pytest.fixture(scope="module")
def full_matrix() -> dict[str, dict[str, Any]]:
    with M.quiet():
        return M.run_matrix()


@pytest.mark.slow
@pytest.mark.parametrize(("model_type", "layout"), [pytest.param(mt, layout, marks=_marks(mt, layout))
                                                    for mt in MODEL_TYPES for layout in M.LAYOUTS])
def test_matrix_cell(full_matrix, model_type: str, layout: str) -> None:
    row = full_matrix[model_type]
    _check_builds(model_type, row)
    if row.get(layout) is None:
        pytest.skip(f"{model_type} does not claim {layout} (claims {row['claims']})")
    _check_cell(model_type, layout, row[layout])
