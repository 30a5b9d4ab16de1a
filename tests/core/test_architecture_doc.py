"""docs/architecture.md's table of ``parallelize()``'s order equals :func:`lightning_par.parallelize.parallelize_order`
(the page is the map a contributor reads first; it must not drift from the code)."""

from __future__ import annotations

import re
from pathlib import Path

from lightning_par.parallelize import parallelize_order

PAGE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def order_table() -> str:
    """The Markdown table of the order, as the page holds it."""
    rows = ["| # | phase | axis | step |", "|---:|---|---|---|"]
    for n, (phase, axis, step) in enumerate(parallelize_order(), 1):
        rows.append(f"| {n} | `{phase}` | `{axis}` | `{step.__module__}.{step.__qualname__}` |")
    return "\n".join(rows)


def test_the_page_lists_parallelizes_order_as_the_code_runs_it():
    text = PAGE.read_text()
    found = re.search(r"<!-- parallelize-order:[^\n]*-->\n(.*?)\n<!-- /parallelize-order -->", text, re.S)
    assert found, "docs/architecture.md lost its parallelize-order block"
    assert found.group(1) == order_table(), "regenerate with: python -m tests.core.test_architecture_doc"


def test_the_order_puts_the_pipeline_cut_before_the_splits_and_the_dp_mode_before_the_schedule():
    phases = [phase for phase, _, _ in parallelize_order()]
    assert phases == sorted(phases, key=["read", "cut", "split", "context", "recompute", "compile", "data",
                                         "schedule"].index)
    names = [(phase, axis) for phase, axis, _ in parallelize_order()]
    assert names.index(("cut", "pp")) < names.index(("split", "tp")) < names.index(("data", "dp")) \
        < names.index(("schedule", "pp"))


if __name__ == "__main__":  # rewrite the page's block from the code
    text = PAGE.read_text()
    PAGE.write_text(re.sub(r"(<!-- parallelize-order:[^\n]*-->\n).*?(\n<!-- /parallelize-order -->)",
                           lambda m: m.group(1) + order_table() + m.group(2), text.replace("ORDER_TABLE",
                           "placeholder"), flags=re.S))
