"""The order ``make test``'s workers hand out the units in (``staged_order``, tests/conftest.py): by stage, each unit's
tests together, the longest units of a stage first, by the seconds ``tests/support/unit_seconds.json`` recorded."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests.conftest import STAGES, UNIT_SECONDS_FILE, UNKNOWN_TEST_S, _unit_of, stage_of, staged_order


class _Item:
    """What the order reads of a collected test: its node id, its marker and whether it shares a module fixture."""

    def __init__(self, nodeid: str, marker: str | None = None, shared: bool = False) -> None:
        self.nodeid, self.marker = nodeid, marker
        fixture = SimpleNamespace(scope="module" if shared else "function")
        self._fixtureinfo = SimpleNamespace(name2fixturedefs={"f": [fixture]})

    def get_closest_marker(self, name: str):
        return object() if name == self.marker else None


def _ids(items) -> list[str]:
    return [item.nodeid for item in items]


def test_stages_first_then_the_longest_units_each_unit_together():
    items = [
        _Item("tests/e/test_run.py::test_recipe", "e2e"),
        _Item("tests/a/test_world.py::test_cell[1]", "distributed", shared=True),
        _Item("tests/b/test_long.py::test_one", "distributed"),
        _Item("tests/c/test_new.py::test_unknown", "distributed"),
        _Item("tests/a/test_world.py::test_cell[2]", "distributed", shared=True),
        _Item("tests/f/test_fast.py::test_quick"),
        _Item("tests/core/test_every_module_imports.py::test_module_imports[x]"),
    ]
    seconds = {"tests/a/test_world.py": 3.0, "tests/b/test_long.py::test_one": 17.0}
    assert _ids(staged_order(items, seconds)) == [
        "tests/core/test_every_module_imports.py::test_module_imports[x]",
        "tests/f/test_fast.py::test_quick",
        "tests/b/test_long.py::test_one",  # 17 s, one test, its own unit: first, not left for the barrier
        "tests/a/test_world.py::test_cell[1]",  # the module's shared world: one unit, 3 s, in file order
        "tests/a/test_world.py::test_cell[2]",
        "tests/c/test_new.py::test_unknown",  # not recorded: UNKNOWN_TEST_S
        "tests/e/test_run.py::test_recipe",
    ]
    assert [stage_of(item) for item in staged_order(items, seconds)] == sorted(
        (stage_of(item) for item in items), key=STAGES.index)


def test_units_not_recorded_are_estimated_by_their_test_count():
    small = [_Item(f"tests/s/test_small.py::test_{i}", "distributed", shared=True) for i in range(2)]
    large = [_Item(f"tests/l/test_large.py::test_{i}", "distributed", shared=True) for i in range(10)]
    recorded = _Item("tests/r/test_recorded.py::test_one", "distributed")
    # 10 unknown tests are 5 s, the recorded test 4 s, 2 unknown tests 1 s
    order = _ids(staged_order([*small, recorded, *large], {recorded.nodeid: 4.0}))
    assert order == _ids(large) + [recorded.nodeid] + _ids(small)
    assert UNKNOWN_TEST_S * 10 > 4.0 > UNKNOWN_TEST_S * 2


def test_without_a_record_the_order_is_by_stage_then_file():
    items = [_Item("tests/x/test_a.py::test_1", "e2e"), _Item("tests/x/test_b.py::test_1", "distributed"),
             _Item("tests/x/test_c.py::test_1", "distributed")]
    assert _ids(staged_order(items, {})) == [items[1].nodeid, items[2].nodeid, items[0].nodeid]


def test_the_recorded_file_names_units_and_seconds():
    recorded = json.loads(UNIT_SECONDS_FILE.read_text())
    assert recorded and all(isinstance(s, (int, float)) and s >= 1.0 for s in recorded.values())
    for unit in recorded:
        path = unit.split("::", 1)[0]
        assert path.startswith("tests/") and path.endswith(".py"), unit


@pytest.mark.parametrize("shared", [True, False])
def test_a_unit_is_its_module_when_it_shares_a_module_fixture(shared: bool):
    item = _Item("tests/a/test_world.py::test_cell[1]", "distributed", shared=shared)
    assert _unit_of(item) == ("tests/a/test_world.py" if shared else item.nodeid)
