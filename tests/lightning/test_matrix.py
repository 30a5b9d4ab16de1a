"""The Lightning feature matrix (:mod:`tests.lightning.matrix`): one test per (feature, column) cell.

A cell passes when every observable the feature returns (losses, logged metrics, predictions, the full trained
parameters, step counts) equals the one-process reference at ``rtol`` 1e-5 (bf16: 2e-2), or, for a declared refusal,
when the declared error comes before the first optimizer step. Cells known to fail today are ``xfail(strict=True)``
with the observed failure (issue 32), so a fix turns them into an XPASS failure until the declaration is removed.

CI runs :func:`~tests.lightning.matrix.ci_cells` (every feature once and every column at least once); the other cells
are ``slow``. The cells of one column run in one launch per selection (CI or slow), the reference in one launch per
model and selection.
"""

from __future__ import annotations

import os

import pytest

from tests.lightning.matrix import (
    COLUMN_BY_NAME,
    COLUMNS,
    FEATURE_BY_NAME,
    FEATURES,
    KNOWN_FAILURES,
    REFERENCE,
    PAGE,
    ci_cells,
    check_refusal,
    compare,
    expected,
    markdown,
    page_table,
    rank_outcome,
    run_column,
)

pytestmark = pytest.mark.distributed

CI = ci_cells()


def _selection(feature: str, column: str) -> str:
    return "ci" if (feature, column) in CI else "slow"


def _features(selection: str, columns: list[str]) -> list[str]:
    """The features of ``selection`` under any of ``columns``, in :data:`FEATURES` order."""
    chosen = {(f, c) for f in FEATURE_BY_NAME for c in columns if _selection(f, c) == selection}
    return [f.name for f in FEATURES if any((f.name, c) in chosen for c in columns)]


class Launches:
    """Each (selection, column) launched once, on first use; the references per (selection, model)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.runs: dict[tuple[str, str], list[dict]] = {}

    def column(self, selection: str, column: str) -> list[dict]:
        key = (selection, column)
        if key not in self.runs:
            self.runs[key] = run_column(COLUMN_BY_NAME[column], _features(selection, [column]),
                                        os.path.join(self.root, f"{selection}-{column}"))
        return self.runs[key]

    def reference(self, selection: str, model: str) -> list[dict]:
        key = (selection, f"reference-{model}")
        if key not in self.runs:
            columns = [c.name for c in COLUMNS if c.model == model]
            self.runs[key] = run_column(REFERENCE[model], _features(selection, columns),
                                        os.path.join(self.root, f"{selection}-reference-{model}"))
        return self.runs[key]


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> Launches:
    return Launches(str(tmp_path_factory.mktemp("lightning_matrix")))


def _cells() -> list:
    params = []
    for c in COLUMNS:
        for f in FEATURES:
            marks = [] if (f.name, c.name) in CI else [pytest.mark.slow]
            if expected(f.name, c.name) == "xfail":
                marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[(f.name, c.name)]))
            params.append(pytest.param(f.name, c.name, marks=marks, id=f"{f.name}-{c.name}"))
    return params


@pytest.mark.parametrize(("feature", "column"), _cells())
def test_cell(launches: Launches, feature: str, column: str) -> None:
    selection = _selection(feature, column)
    runs = launches.column(selection, column)
    if expected(feature, column) == "refused":
        check_refusal(feature, column, runs)
        return
    status, reference = rank_outcome(launches.reference(selection, COLUMN_BY_NAME[column].model), feature)
    assert status == "ok", f"the one-process reference raised: {reference['error']}"
    compare(FEATURE_BY_NAME[feature], runs, reference[0])


def test_ci_covers_every_feature_and_column() -> None:
    """The CI selection reaches every feature and every lightning_par column (the rest of the matrix is slow)."""
    assert {f for f, _ in CI} == set(FEATURE_BY_NAME)
    assert {c for _, c in CI} == {c.name for c in COLUMNS if not c.builtin}


def test_columns_are_the_registry() -> None:
    """Every name a lightning_par strategy registers with Lightning is a column (none forgotten, none invented)."""
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_par.strategies import STRATEGIES

    ours = {n for n in StrategyRegistry.available_strategies() if StrategyRegistry[n]["strategy"] in STRATEGIES}
    assert ours == {c.name for c in COLUMNS if not c.builtin and c.name == c.strategy}


def test_docs_show_the_declared_table() -> None:
    """docs/lightning-features.md's table is the one the tests assert (regenerate: ``python -m
    tests.lightning.matrix --docs``)."""
    with open(PAGE) as f:
        assert page_table(f.read()) == markdown().strip()
