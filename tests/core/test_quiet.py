"""Quiet by default: the third-party lines lightning_par filters (and only those), the progress bar of a step-based
run, and packaging metadata setuptools takes without a warning."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import lightning as L

import lightning_par  # noqa: F401  (installs the filters)
from lightning_par import quiet
from lightning_par.callbacks.progress import StepProgressBar

ROOT = Path(__file__).resolve().parents[2]


def test_the_leafspec_deprecation_is_filtered_and_nothing_else():
    from torch.utils._pytree import LeafSpec

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet.install()  # inside the test's own filter state (pytest resets filters per test)
        LeafSpec()  # what Lightning's _pytree does on every run
        warnings.warn("a FutureWarning of the user's", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["a FutureWarning of the user's"]


def test_the_litlogger_tip_is_dropped_and_other_info_kept():
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        quiet.install()
        quiet.install()  # idempotent
        rank_zero_info("💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger](...)")
        rank_zero_info("GPU available: False, used: False")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert seen == ["GPU available: False, used: False"]
    assert logger.filters.count(quiet._not_a_tip) == 1


def test_a_step_based_run_is_not_labelled_epoch_0_of_minus_2():
    for kwargs, label in (({"max_steps": 5}, "Epoch 0"), ({"max_epochs": 3}, "Epoch 0/2")):
        bar = StepProgressBar()
        trainer = L.Trainer(accelerator="cpu", logger=False, callbacks=[bar], **kwargs)
        bar._trainer = trainer  # set by Lightning's setup(); enough for the description
        assert bar._get_train_description(0).strip() == label, kwargs


def test_packaging_metadata_is_the_current_form():
    lines = (ROOT / "pyproject.toml").read_text().splitlines()  # (tomllib is Python >= 3.11 only)
    assert 'license = "Apache-2.0"' in lines  # an SPDX string: a TOML table is deprecated
    assert any(line.startswith('requires = ["setuptools>=77"]') for line in lines)
    assert '    "mkdocs>=1.6,<2",' in lines  # the dev extra builds the docs in CI
    assert '"lightning_par.planner.data"' in (ROOT / "setup.py").read_text()  # the data folder is a declared package
