"""The planner against a published table of large-scale layouts: Megatron-LM PTD-P (Narayanan et al. 2021, Table 1).

Rows: GPT models of 1.7B to 1T parameters on A100-80GB, sequence 2048, vocabulary 51200, micro-batch 1, activation
recomputation on, each with the tensor- and pipeline-parallel sizes (t, p), GPU count n and batch the paper used,
and the achieved teraFLOP/s per GPU and percentage of the 312 TFLOP/s peak it measured (FLOPs counted with
recomputation, F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)), §5.1: a hardware-FLOPs utilisation).

SOURCE CAVEAT: the table could not be read from the paper here (no access to arxiv.org/abs/2104.04473; it is an
image in the Megatron-LM README). These rows are the lead engineer's recollection, UNVERIFIED, except the 1T row,
whose shape (h=25600, 160 heads, 128 layers) matches calculon-ai/calculon's models/megatron-1T.json and whose
163 TFLOP/s (52%) on 3072 GPUs matches the paper's abstract (502 petaFLOP/s on 3072 GPUs, 52% of peak). Each row's
shapes also reproduce its parameter count through the paper's formula (checked below).

The planner is given the shapes, n, the batch and the A100-80GB preset, and the paper's fixed choices (plain data
parallelism, micro-batch 1, full recomputation, no sequence parallelism; 1F1B or interleaved 1F1B); it chooses
(t, p), the schedule and the virtual stages. The rank of the published (t, p) is its position among the distinct
(t, p) pairs ordered by their best predicted step time, over the layouts predicted to fit.
"""

from __future__ import annotations

from functools import lru_cache

import pytest

from lightning_par.planner import ModelSpec, plan

#: (params B, heads, hidden, layers, t, p, n GPUs, batch, TFLOP/s per GPU, % of peak) -- unverified, see above.
MEGATRON_TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52),
]
SEQ, VOCAB = 2048, 51200

#: Rows whose published (t, p) the planner ranks below 3rd (see the module docstring of the test and the README):
#: its top layouts use smaller t with interleaved pipelining; the published (t, p) is predicted within 7% of the best.
BELOW_TOP_3 = {7.5: "rank 4, 1.8% slower than (2,4)", 18.4: "rank 5, 6.9% slower than (4,2)",
               39.1: "rank 4, 4.6% slower than (4,4)"}


def _spec(row) -> ModelSpec:
    size, heads, hidden, layers = row[:4]
    return ModelSpec(num_layers=layers, hidden_size=hidden, num_heads=heads, vocab_size=VOCAB, seq_len=SEQ,
                     tied_embeddings=True, name=f"{size}B")


@lru_cache(maxsize=None)
def _ranked_pairs(row):
    """Best prediction per distinct (t, p), in the planner's order."""
    *_, n, batch, _tflops, _pct = row
    predictions = plan(
        _spec(row), num_devices=n, devices_per_node=8, device="a100-80gb", global_batch_size=batch, seq_len=SEQ,
        dp_modes=("ddp",), checkpointing=("full",), micro_batch_sizes=(1,), schedules=("1f1b", "interleaved_1f1b"),
        sequence_parallel=(False,), include_unfit=False,
    )
    best: dict[tuple[int, int], object] = {}
    for pred in predictions:
        best.setdefault((pred.tp_size, pred.pp_size), pred)
    return best


def megatron_report() -> list[dict]:
    """Per row: published (t, p), its rank, its predicted step time, MFU and HFU, and the planner's best (t, p)."""
    out = []
    for row in MEGATRON_TABLE_1:
        size, *_, t, p, n, batch, tflops, pct = row
        best = _ranked_pairs(row)
        order = list(best)
        pub = best.get((t, p))
        out.append({
            "params_b": size, "published": (t, p), "n": n, "batch": batch, "published_pct": pct,
            "rank": order.index((t, p)) + 1 if pub else None, "pairs": len(order), "planner_best": order[0],
            "predicted_mfu": pub.mfu if pub else None, "predicted_hfu": pub.hfu if pub else None,
            "gap": pub.step_time_s / best[order[0]].step_time_s - 1 if pub else None,
            "schedule": pub.layout.describe() if pub else None,
        })
    return out


@pytest.mark.parametrize("row", MEGATRON_TABLE_1, ids=lambda r: f"{r[0]}B")
def test_row_shapes_reproduce_the_parameter_count(row):
    # P = 12 l h^2 (1 + 13/(12 h) + (V + s)/(12 l h)), Narayanan et al. 2021, §5.1
    assert _spec(row).total_params() / 1e9 == pytest.approx(row[0], abs=0.06)


@pytest.mark.parametrize(
    "row",
    [pytest.param(r, marks=pytest.mark.xfail(strict=True, reason=BELOW_TOP_3[r[0]])) if r[0] in BELOW_TOP_3 else r
     for r in MEGATRON_TABLE_1],
    ids=lambda r: f"{r[0]}B",
)
def test_published_layout_is_in_the_planners_top_3(row):
    t, p = row[4], row[5]
    order = list(_ranked_pairs(row))
    assert (t, p) in order[:3], f"published {(t, p)} ranks {order.index((t, p)) + 1 if (t, p) in order else None}"


@pytest.mark.parametrize("row", MEGATRON_TABLE_1, ids=lambda r: f"{r[0]}B")
def test_published_layout_fits_and_is_predicted_near_the_best_and_the_measured_utilisation(row):
    t, p, pct = row[4], row[5], row[9]
    best = _ranked_pairs(row)
    assert (t, p) in best, "the published layout is predicted not to fit in 80 GB"
    pub, top = best[(t, p)], next(iter(best.values()))
    assert pub.step_time_s <= 1.10 * top.step_time_s
    # the paper's % of peak counts recomputation FLOPs: compare with the planner's hardware-FLOPs utilisation
    assert abs(100 * pub.hfu - pct) <= 10
