"""The planner against a published table of large-scale layouts: Megatron-LM PTD-P (Narayanan et al. 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC21, Table 1).

Rows: GPT models of 1.7B to 1T parameters on A100-80GB, sequence 2048, vocabulary 51200, micro-batch 1, activation
recomputation on, each with the tensor- and pipeline-parallel sizes (t, p), GPU count n and batch the paper used,
and the achieved teraFLOP/s per GPU, percentage of the 312 TFLOP/s peak and aggregate petaFLOP/s it measured (FLOPs
counted with recomputation, F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)), §5.1: a hardware-FLOPs utilisation).

SOURCE: the rows were first written from recollection (the table is an image in the Megatron-LM README); every value
was then checked against a text transcription of the paper (arXiv 2104.04473, §5.1) and matches. Two consistency
checks below: each row's shapes reproduce its parameter count through the paper's eq. (2), and its aggregate
petaFLOP/s is its per-GPU teraFLOP/s times n.

The planner is given the shapes, n, the batch and the A100-80GB preset, and the paper's fixed choices (plain data
parallelism, micro-batch 1, full recomputation, no sequence parallelism; 1F1B or interleaved 1F1B; the scatter/gather
pipeline sends of §4.1, "enabled" in these runs, §5.1); it chooses (t, p), the schedule and the virtual stages. The
rank of the published (t, p) is its position among the distinct (t, p) pairs ordered by their best predicted step
time, over the layouts predicted to fit.

The A100-80GB preset's time model is calibrated from published measurements (``planner/data/calibration.json``:
the best measured bf16 matmul rate, per-shape wave quantization and memory bound, nccl-tests bus bandwidth per
operation and payload), none taken from this paper. Three rows rank below 3rd (``BELOW_TOP_3``), as they did with
the earlier assumed constants. The paper did not search for its layouts: it "suggest[s] heuristics (in §3)" (§1)
and picks "degrees ... using heuristics described in §3" (§5.1): Takeaway #2, a model-parallel size t p that makes
the model fit, data parallelism beyond, and Takeaway #1, t up to the 8 GPUs of a node before p. The planner's best
has the same t p as the paper's in all three rows (4, 8, 16) but splits it otherwise: from the paper's own costs
(§3.2: ``8 b s h (t-1)/t`` all-reduced per layer, not overlapped; ``b s h`` per pipeline send, ``/ t`` with
scatter/gather, ``x v`` interleaved; bubble ``(p-1)/(v m)``), plus the memory-bound kernels that tensor parallelism
does not split (norms, dropouts, residual adds; §4.2 fuses them), it prefers a smaller t with an interleaved pipeline
where m is large enough (16-48 micro-batches per pipeline) for the bubble to stay small. Calibration moved them
further down, not up: an all-reduce of one micro-batch's ``b s h`` activation (16-32 MiB for these widths) runs at
106-138 GB/s bus bandwidth on 8 A100s as nccl-tests measures it, not at the 235 GB/s of large payloads, so each
tensor-parallel all-reduce costs about twice the earlier estimate. The paper measures no such alternative for these
models; its lowest utilisation is the 18.4B row at (8, 1), 43%.
"""

from __future__ import annotations

from functools import lru_cache

import pytest

from lightning_par.planner import ModelSpec, plan

#: (params B, heads, hidden, layers, t, p, n GPUs, batch, TFLOP/s per GPU, % of peak, aggregate PFLOP/s): Table 1.
MEGATRON_TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44, 4.4),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44, 8.8),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46, 18.2),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43, 34.6),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44, 70.8),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45, 143.8),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47, 227.1),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50, 297.4),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52, 410.2),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52, 502.0),
]
SEQ, VOCAB = 2048, 51200

#: Rows whose published (t, p) the planner ranks below 3rd, with the predicted shares of the step that decide it (see
#: the module docstring): in each, t = 4 or 8 pays more in exposed NVLink all-reduces (at the bus bandwidth measured
#: for their payload) and unsplit memory-bound kernels than the smaller-t interleaved pipelines pay in bubble and sends.
BELOW_TOP_3 = {
    7.5: "rank 7 of 11, 21.8% slower than (1,4) interleaved v=3 (same t*p = 4): tp all-reduces 19.2% (16 MiB "
         "payloads at the 106 GB/s busbw measured for them on 8x A100) and memory-bound kernels 12.1% of the (4,1) "
         "step vs none and 10.8% at t=1, against a 5.6% bubble and 1.9% sends",
    18.4: "rank 8 of 10, 32.9% slower than (2,4) interleaved v=2 (same t*p = 8): tp all-reduces 25.9% (24 MiB at "
          "125 GB/s measured) and memory-bound kernels 11.1% of the (8,1) step vs 4.9% and 9.0% at t=2, against a "
          "4.3% bubble and 1.0% sends",
    39.1: "rank 8 of 10, 24.1% slower than (2,8) interleaved v=3 (same t*p = 16): tp all-reduces 20.8% (32 MiB at "
          "138 GB/s measured) and memory-bound kernels 9.9% of the (8,2) step vs 3.7% and 7.4% at t=2, against a "
          "4.5% bubble (0.7% at (8,2)) and 2.1% sends (0.8%)",
}
#: Rows whose published (t, p) is predicted more than 10% slower than the planner's best (same cause as above; 7.5B
#: joined 18.4B and 39.1B when the all-reduces took their measured per-payload rate: 8.5% -> 21.8%).
BEYOND_10_PERCENT = {7.5: BELOW_TOP_3[7.5], 18.4: BELOW_TOP_3[18.4], 39.1: BELOW_TOP_3[39.1]}


def _spec(row) -> ModelSpec:
    size, heads, hidden, layers = row[:4]
    return ModelSpec(num_layers=layers, hidden_size=hidden, num_heads=heads, vocab_size=VOCAB, seq_len=SEQ,
                     tied_embeddings=True, name=f"{size}B")


@lru_cache(maxsize=None)
def _ranked_pairs(row):
    """Best prediction per distinct (t, p), in the planner's order."""
    *_, n, batch, _tflops, _pct, _agg = row
    predictions = plan(
        _spec(row), num_devices=n, devices_per_node=8, device="a100-80gb", global_batch_size=batch, seq_len=SEQ,
        dp_modes=("ddp",), checkpointing=("full",), micro_batch_sizes=(1,), schedules=("1f1b", "interleaved_1f1b"),
        sequence_parallel=(False,), include_unfit=False, pp_scatter_gather=True,
    )
    best: dict[tuple[int, int], object] = {}
    for pred in predictions:
        best.setdefault((pred.tp_size, pred.pp_size), pred)
    return best


def megatron_report() -> list[dict]:
    """Per row: published (t, p), its rank, its predicted step time, MFU and HFU, and the planner's best (t, p)."""
    out = []
    for row in MEGATRON_TABLE_1:
        size, *_, t, p, n, batch, tflops, pct, _agg = row
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


def _marked(rows: dict[float, str]) -> list:
    return [pytest.param(r, marks=pytest.mark.xfail(strict=True, reason=rows[r[0]])) if r[0] in rows else r
            for r in MEGATRON_TABLE_1]


@pytest.mark.parametrize("row", MEGATRON_TABLE_1, ids=lambda r: f"{r[0]}B")
def test_row_shapes_reproduce_the_parameter_count_and_the_aggregate_throughput(row):
    # P = 12 l h^2 (1 + 13/(12 h) + (V + s)/(12 l h)), Narayanan et al. 2021, §5.1, eq. (2)
    assert _spec(row).total_params() / 1e9 == pytest.approx(row[0], abs=0.06)
    tflops, n, aggregate = row[8], row[6], row[10]
    assert tflops * n / 1000 == pytest.approx(aggregate, rel=0.01)  # per-GPU figures are rounded to 1 TFLOP/s


@pytest.mark.parametrize("row", _marked(BELOW_TOP_3), ids=lambda r: f"{r[0]}B")
def test_published_layout_is_in_the_planners_top_3(row):
    t, p = row[4], row[5]
    order = list(_ranked_pairs(row))
    assert (t, p) in order[:3], f"published {(t, p)} ranks {order.index((t, p)) + 1 if (t, p) in order else None}"


@pytest.mark.parametrize("row", _marked(BEYOND_10_PERCENT), ids=lambda r: f"{r[0]}B")
def test_published_layout_fits_and_is_predicted_near_the_best(row):
    t, p = row[4], row[5]
    best = _ranked_pairs(row)
    assert (t, p) in best, "the published layout is predicted not to fit in 80 GB"
    pub, top = best[(t, p)], next(iter(best.values()))
    assert pub.step_time_s <= 1.10 * top.step_time_s


@pytest.mark.parametrize("row", MEGATRON_TABLE_1, ids=lambda r: f"{r[0]}B")
def test_published_layout_is_predicted_near_the_measured_utilisation(row):
    t, p, pct = row[4], row[5], row[9]
    pub = _ranked_pairs(row)[(t, p)]
    # the paper's % of peak counts recomputation FLOPs: compare with the planner's hardware-FLOPs utilisation
    assert abs(100 * pub.hfu - pct) <= 10


if __name__ == "__main__":  # docs/planner.md's table: python tests/planner/test_planner_megatron.py
    for r, row in zip(megatron_report(), MEGATRON_TABLE_1):
        print(f"| {r['params_b']}B | {row[6]} | {row[7]} | {r['published']} | {r['rank']} of {r['pairs']} | "
              f"{r['planner_best']} | {100 * r['gap']:.1f}% | {100 * r['predicted_mfu']:.1f}% | "
              f"{100 * r['predicted_hfu']:.1f}% | {r['published_pct']}% |")
