"""The context-parallel benchmark without processes: its communication formulas on small numbers worked by hand, and
its table from a made-up result of two launches."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from lightning_par.benchmarks.context_parallel import BASELINE, _collect, formula_bytes, render

SMALL = dict(batch=1, n_head=4, seq=8, head_dim=2, n_layer=1)  # one (1, 4, 8 / cp, 2) fp32 tensor: 256 / cp bytes


def test_ring_sends_cp_minus_1_kv_blocks_forward_and_twice_that_backward():
    # cp 2: a K/V block is 2 x 1 x 4 x 4 x 2 x 4 = 256 bytes, passed once; backward K/V again and dK/dV
    assert formula_bytes("ring", 2, **SMALL) == (256, 512)
    # cp 4: blocks of 128 bytes, passed 3 times
    assert formula_bytes("ring", 4, **SMALL) == (384, 768)
    assert formula_bytes("ring", 4, **{**SMALL, "n_layer": 3}) == (3 * 384, 3 * 768)
    assert formula_bytes("ring", 1, **SMALL) == (0, 0)


def test_ulysses_sends_cp_minus_1_over_cp_of_four_tensors_each_way():
    # cp 2: q, k, v and the output, 128 bytes each, half of each sent
    assert formula_bytes("all_to_all", 2, **SMALL) == (256, 256)
    # cp 4: 64 bytes each, three quarters sent
    assert formula_bytes("all_to_all", 4, **SMALL) == (192, 192)
    assert formula_bytes("all_to_all", 2, **{**SMALL, "elem_bytes": 2}) == (128, 128)  # bf16


def test_the_benchmarks_own_sizes():
    """seq 1024, 4 heads of 16, 2 layers: what the quick table's formula column reads."""
    sizes = dict(batch=1, n_head=4, seq=1024, head_dim=16, n_layer=2)
    assert formula_bytes("ring", 2, **sizes) == (524288, 1048576)
    assert formula_bytes("all_to_all", 4, **sizes) == (393216, 393216)


def test_sizes_that_do_not_split_and_unknown_methods_are_refused():
    with pytest.raises(ValueError, match="seq=9 does not split over cp=2"):
        formula_bytes("ring", 2, **{**SMALL, "seq": 9})
    with pytest.raises(ValueError, match="n_head=4 does not split over cp=8"):
        formula_bytes("all_to_all", 8, **{**SMALL, "seq": 16})
    with pytest.raises(ValueError, match="method='tree'"):
        formula_bytes("tree", 2, **SMALL)


def _rank(peak: int, wall: list[float], sent: tuple[int, int] = (0, 0)) -> dict:
    return {"peak": peak, "wall": wall, "cpu": [w / 2 for w in wall], "sent": {"forward": sent[0], "backward": sent[1]}}


def test_the_table_renders_from_two_launches():
    cfg = dict(n_layer=1, n_head=4, n_embd=8, block_size=8, vocab_size=16)
    rows = []
    for cp, scale in ((2, 1.0), (4, 2.0)):  # the second launch's cp1 ran twice as slow: its rows' ratios use it
        ring, ulysses = formula_bytes("ring", cp, **SMALL), formula_bytes("all_to_all", cp, **SMALL)
        per_rank = [
            {BASELINE: _rank(1000, [0.1 * scale, 0.3 * scale, 0.2 * scale]), "ring": _rank(520, [0.1, 0.4, 0.2], ring),
             "all_to_all": _rank(500, [0.2, 0.2, 0.2], ulysses)},
            *({"ring": _rank(540 if r == 1 else 510, [0.3, 0.1, 0.1], ring),
               "all_to_all": _rank(500, [0.1, 0.1, 0.1], (ulysses[0], ulysses[1] + 64))} for r in range(1, cp)),
        ]
        rows.extend(_collect(cp, ("ring", "all_to_all"), per_rank))
    table = render(rows, cfg, batch=1)
    lines = [line for line in table.splitlines() if line.startswith("| cp")]
    assert [line.split("|")[1].strip() + " " + line.split("|")[2].strip() for line in lines] == [
        "cp1 -", "cp2 ring", "cp2 all_to_all", "cp4 ring", "cp4 all_to_all"]  # one cp1 row
    cells = {line.split("|")[1].strip() + " " + line.split("|")[2].strip(): [c.strip() for c in line.split("|")[3:-1]]
             for line in lines}
    # peak: the largest over ranks; time: per step the slowest rank, then the median; both against cp1
    # (slowest per step 0.3, 0.4, 0.2 s: median 0.3 s; cp1's median 0.2 s)
    assert cells["cp2 ring"][:7] == ["540", "0.540", "<= 0.55", "300.0", "1.50", "1.50", "256 + 512"]
    assert cells["cp4 ring"][4] == "0.75"  # 0.3 s against the second launch's cp1, 0.4 s
    assert cells["cp2 ring"][-1] == "1.000"
    assert cells["cp2 all_to_all"][-1] == f"{(256 + 256 + 64) / 512:.3f}"
    # recipes/benchmark.py --runs 2 compares these columns
    spec = importlib.util.spec_from_file_location("benchmark_recipe", Path(__file__).parents[2] / "recipes" /
                                                  "benchmark.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    headers = {label.split(" | ")[1] for label, _ in recipe._ratio_cells(table)}
    assert headers == {"peak / cp1", "wall / cp1", "CPU / cp1", "measured / formula"}
