"""The Lightning feature matrix (:mod:`tests.support.lightning_matrix`): one test per (feature, column) cell.

A cell passes when every observable the feature returns (losses, logged metrics, predictions, the full trained
parameters, step counts) equals the one-process reference at ``rtol`` 1e-5 (bf16: 2e-2), or, for a declared refusal,
when the declared error comes before the first optimizer step. Cells known to fail today are ``xfail(strict=True)``
with the observed failure (issue 32), so a fix turns them into an XPASS failure until the declaration is removed.

CI runs :func:`~tests.support.lightning_matrix.ci_cells` (every feature once and every column at least once); the other cells
are ``slow``. The cells of one column run in one launch per selection (CI or slow), the reference in one launch per
model and selection.
"""

from __future__ import annotations

import os

import pytest

from tests.support.lightning_matrix import (
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
    tests.support.lightning_matrix --docs``)."""
    with open(PAGE) as f:
        assert page_table(f.read()) == markdown().strip()


#: Every callback Lightning ships (``lightning.pytorch.callbacks.__all__``): the matrix row that runs it under every
#: column, or why it has none. A callback a new Lightning adds fails :func:`test_every_lightning_callback_is_a_row`
#: until it is declared here.
CALLBACK_ROWS = {
    "EarlyStopping": "early_stopping", "ModelCheckpoint": "checkpoint_resume", "LearningRateMonitor": "lr_monitor",
    "ModelSummary": "model_summary", "StochasticWeightAveraging": "swa", "EMAWeightAveraging": "ema",
    "WeightAveraging": "ema", "BaseFinetuning": "finetuning", "BackboneFinetuning": "finetuning",
    "GradientAccumulationScheduler": "accumulation_scheduler", "ModelPruning": "pruning",
    "LearningRateFinder": "lr_find",
}
CALLBACKS_WITHOUT_ROW = {
    "Callback": "the base class of every callback (the Recorder of every row is one)",
    "Checkpoint": "the base class of ModelCheckpoint",
    "ProgressBar": "display only: reads the logged metrics, changes no tensor",
    "TQDMProgressBar": "display only (the default progress bar of every row's fit)",
    "RichProgressBar": "display only, as TQDMProgressBar",
    "RichModelSummary": "ModelSummary's rich display: its count is the model_summary row's",
    "DeviceStatsMonitor": "logs the accelerator's memory statistics, changes no tensor",
    "ThroughputMonitor": "logs samples/s and FLOP/s from the user's counts, changes no tensor",
    "LambdaCallback": "calls the user's own functions at the hooks",
    "BasePredictionWriter": "writes what predict returns (the predict row's outputs)",
    "Timer": "stops fit after a wall time; Lightning broadcasts rank 0's decision",
    "OnExceptionCheckpoint": "saves through the strategy's save_checkpoint, as the checkpoint rows do",
    "SpikeDetection": "raises on a spike of the loss the user passes; no training state",
    "BatchSizeFinder": "Lightning refuses it under every distributed strategy (Tuner.scale_batch_size: 'not supported "
                       "with distributed strategies')",
}


def test_every_lightning_callback_is_a_row() -> None:
    import lightning.pytorch.callbacks as callbacks

    shipped, declared = set(callbacks.__all__), set(CALLBACK_ROWS) | set(CALLBACKS_WITHOUT_ROW)
    assert shipped == declared, (f"declare in CALLBACK_ROWS or CALLBACKS_WITHOUT_ROW: {sorted(shipped - declared)}; "
                                 f"no longer shipped: {sorted(declared - shipped)}")
    assert not set(CALLBACK_ROWS) & set(CALLBACKS_WITHOUT_ROW)
    assert set(CALLBACK_ROWS.values()) <= set(FEATURE_BY_NAME), set(CALLBACK_ROWS.values()) - set(FEATURE_BY_NAME)
