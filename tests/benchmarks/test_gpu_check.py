"""The GPU check (``scripts/gpu_check.sh``) runs its every piece on the CPU in ``--dry-run``, and fails loudly on a
machine without a CUDA device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_par.benchmarks import gpu_check

ROOT = Path(__file__).resolve().parents[2]


def test_rows_and_shapes():
    assert gpu_check.ROWS == (
        ("plain", "eager"), ("plain", "compiled"), ("plain", "compiled+float8"),
        ("zero3", "eager"), ("zero3", "compiled"), ("zero3", "compiled+float8"),
    )
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        net = LlamaForCausalLM(LlamaConfig(**gpu_check.LLAMA_1B))
    params = sum(p.numel() for p in net.parameters())
    assert 1.0e9 < params < 1.2e9  # "~1B"
    # the MFU numerator: 6 N (without the input embedding) + the attention term, about 7.0 GFLOP per token at seq 2048
    fpt = gpu_check.flops_per_token(gpu_check.LLAMA_1B, 2048, params - 32000 * 2048)
    assert 6.8e9 < fpt < 7.2e9


@pytest.mark.e2e  # the script's dry run end to end (compiles and converts a model: 50 s), so not in `make test-fast`
def test_dry_run_rows_compile_and_convert(tmp_path):
    """Two rows of the dry run (the zero3 row with compile and float8, and the plain eager row) through ``main``:
    the table is written, the compiled row compiled one graph shared by both decoder layers, float8 converted the
    7 linear layers of each of the 2 layers."""
    out = tmp_path / "table.md"
    status = gpu_check.main(["--dry-run", "--out", str(out), "--rows", "plain:eager,zero3:compiled+float8"])
    assert status == 0
    table = out.read_text()
    rows = [line for line in table.splitlines() if line.startswith("| plain") or line.startswith("| zero3")]
    assert len(rows) == 2, table
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert cells[0][:2] == ["plain", "eager"] and cells[0][-2:] == ["0", "0"]
    assert cells[1][:2] == ["zero3", "compiled+float8"]
    assert int(cells[1][-2]) >= 1 and int(cells[1][-1]) == 14, table
    assert float(cells[1][3]) > 0  # tokens/s
    assert "CPU (dry run" in table


@pytest.mark.slow
def test_dry_run_every_row(tmp_path):
    out = tmp_path / "table.md"
    assert gpu_check.main(["--dry-run", "--out", str(out)]) == 0
    assert sum(line.startswith(("| plain", "| zero3")) for line in out.read_text().splitlines()) == 6


@pytest.mark.e2e  # the script starts interpreters (tests/README.md: a new interpreter is not the fast stage)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_the_script_fails_loudly_without_a_gpu(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "t.md")}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "gpu_check: FAILED: no CUDA device" in proc.stderr and "--dry-run" in proc.stderr
    assert not (tmp_path / "t.md").exists()
    # the Python entry point refuses the same way
    assert gpu_check.main(["--out", str(tmp_path / "u.md")]) == 2


def test_layouts_part_names_every_layout_and_refuses_an_unknown_one():
    assert {"ddp_overlap", "zero1", "zero2", "zero3", "hsdp2x2-zero3", "tp2-sp", "cp2-ring", "cp2-all_to_all",
            "ep2"} <= set(gpu_check.LAYOUTS)
    assert {n for n in gpu_check.LAYOUTS if n.startswith("pp2-")} == {
        "pp2-1f1b", "pp2-interleaved_1f1b", "pp2-zbv_zero_bubble"}  # one schedule per family
    with pytest.raises(ValueError, match="layouts: 'zero4' is not valid"):
        gpu_check.run_layouts(True, ["zero4"])


@pytest.mark.distributed
def test_layouts_dry_run_trains_two_ranks(tmp_path):
    """Two layouts of the two-rank part on the CPU (gloo): a row each, ``ok``, with the ranks and the backend."""
    table = gpu_check.run_layouts(True, ["zero3", "pp2-1f1b"], timeout_s=120)
    rows = [line for line in table.splitlines() if line.startswith("| zero3 ") or line.startswith("| pp2-1f1b ")]
    assert len(rows) == 2, table
    assert all("| 2 | cpu | gloo | ok |" in row for row in rows), table


def test_moe_row_dry_run_states_grouped_and_loop():
    """The MoE row of the throughput part (64 experts, grouped_mm vs the per-expert loop), here on the CPU."""
    table = gpu_check.moe_table(dry_run=True)
    (row,) = [line for line in table.splitlines() if line.startswith("| 64 |")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[4] == "grouped_mm" and float(cells[5]) > 0 and float(cells[7]) > 0, table  # grouped, loop (ms)
    assert float(cells[8]) == pytest.approx(float(cells[7]) / float(cells[5]), rel=0.1)  # loop / grouped
    assert "dry run" in table and gpu_check.MOE_GPU["num_experts"] == 64
