"""The GPU presets' time model against the published measurements it is read from
(``lightning_par/planner/data/calibration.json``, :mod:`lightning_par.planner.calibration`): every number has a
source, the figures come back as published, the GEMM-efficiency and link models follow their documented rules, and
the step time uses them. Pure Python, no processes."""

from __future__ import annotations

import copy
import json
import math
from importlib import resources

import pytest

from lightning_par.planner import DEVICE_PRESETS, DeviceSpec, Layout, ModelSpec, get_precision
from lightning_par.planner.calibration import (
    COLLECTIVE_OPS,
    calibration_for,
    layer_gemm_shapes,
    layer_matmul_rates,
    load_calibration,
)
from lightning_par.planner.comm import group_link
from lightning_par.planner.step_time import pp_message_time, predict_step_time

A100 = DEVICE_PRESETS["a100-80gb"]
H100 = DEVICE_PRESETS["h100-80gb"]
BF16 = get_precision("mixed-bf16")
GiB, MiB, KiB = 1 << 30, 1 << 20, 1 << 10


def _raw() -> dict:
    return json.loads(resources.files("lightning_par.planner").joinpath("data", "calibration.json").read_text())


def _numbers(node, path=""):
    """Every ``{value, source, note}`` leaf of the data file, with its path."""
    if isinstance(node, dict) and "value" in node:
        yield path, node
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _numbers(v, f"{path}.{k}" if path else k)


# ------------------------------------------------------------------------------------------------ the data file
def test_every_number_names_a_published_source_or_says_why_it_is_assumed():
    data = _raw()
    sources = data["sources"]
    for key, src in sources.items():
        assert src["title"] and src["url"].startswith("https://") and src["where"], key
    numbers = list(_numbers(data["devices"]))
    assert len(numbers) > 40
    for path, entry in numbers:
        assert entry["source"] == "assumption" or entry["source"] in sources, path
        assert len(entry["note"]) > 15, path  # what the figure is, or the reasoning behind an assumption
    used = {entry["source"] for _, entry in numbers}
    assert used - {"assumption"} == set(sources)  # no source listed that no number uses
    # nothing comes from the validation set: no source is the PTD-P paper (Narayanan et al. 2021)
    assert not any("2104.04473" in s["url"] or "Efficient Large-Scale" in s["title"] for s in sources.values())


def test_presets_read_the_calibration_of_their_family():
    families = load_calibration()
    for name, dev in DEVICE_PRESETS.items():
        cal = families[dev.calibration]
        assert name in cal.presets
        assert dev.matmul_efficiency == cal.plateau
        assert (dev.intra_node_bandwidth, dev.intra_node_latency_s) == cal.link("p2p", True)
        assert (dev.inter_node_bandwidth, dev.inter_node_latency_s) == cal.link("p2p", False)
    # the published figures, as the sources print them
    a100, h100 = families["a100"], families["h100"]
    assert a100.plateau == pytest.approx(271.2 / 312, abs=1e-3) and h100.plateau == pytest.approx(794.5 / 989, abs=1e-3)
    assert (a100.sm_count, h100.sm_count) == (108, 132)
    assert a100.link("all_reduce", True) == (pytest.approx(234.89e9), pytest.approx(43.83e-6 / 14, rel=2e-3))
    assert a100.link("p2p", False)[0] == 24e9 and h100.link("all_gather", False)[0] == 47e9
    assert h100.link("all_reduce", True)[0] == 482.26e9  # NVLink SHARP
    assert h100.link("reduce_scatter", True)[0] == 362.9e9 and h100.link("p2p", True)[0] == 376e9


@pytest.mark.parametrize(("edit", "match"), [
    (lambda d: d["devices"]["a100"]["gemm"]["plateau"].update(source="a blog"), r"gemm\.plateau\.source='a blog'"),
    (lambda d: d["devices"]["a100"]["gemm"]["plateau"].update(note=""), r"gemm\.plateau\.note is missing"),
    (lambda d: d["devices"]["a100"]["gemm"]["plateau"].update(value=1.2), r"gemm\.plateau=1\.2 .* \(0, 1\]"),
    (lambda d: d["devices"]["h100"]["gemm"]["sm_count"].update(value=0), r"sm_count=0 .* positive integer"),
    (lambda d: d["devices"]["a100"]["links"]["inter"].pop("p2p"), r"links\.inter\.p2p is missing"),
    (lambda d: d["devices"]["a100"]["links"]["intra"]["p2p"]["bandwidth"].update(value=-1),
     r"intra\.p2p\.bandwidth=-1 .* > 0"),
    (lambda d: d["devices"]["a100"]["links"]["intra"]["all_reduce"]["busbw_curve"]["value"].reverse(),
     r"busbw_curve is not valid: .* ascending"),
    (lambda d: d["devices"]["a100"]["links"]["intra"]["all_gather"]["curve_shape"].update(value="p2p"),
     r"curve_shape='p2p' is not valid"),
    (lambda d: d["sources"]["ml_eng_mamf"].pop("url"), r"sources\.ml_eng_mamf is not valid: missing \['url'\]"),
])
def test_a_bad_calibration_file_is_refused_naming_the_field(tmp_path, edit, match):
    data = copy.deepcopy(_raw())
    edit(data)
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=match):
        load_calibration(path)


def test_bad_names_and_payloads_are_refused():
    with pytest.raises(ValueError, match=r"calibration='tpu-v4' is not valid: expected None or one of \['a100', "):
        DeviceSpec(name="x", memory_bytes=8e10, peak_flops=1e14, memory_bandwidth=1e12, intra_node_bandwidth=1e11,
                   inter_node_bandwidth=1e10, calibration="tpu-v4")
    cal = calibration_for("a100")
    with pytest.raises(ValueError, match=r"op='broadcast' is not valid: expected one of \['all_reduce'"):
        cal.link("broadcast", True)
    with pytest.raises(ValueError, match=r"payload_bytes=0 is not valid"):
        cal.link("all_reduce", True, 0)
    with pytest.raises(ValueError, match=r"k=0 is not valid"):
        cal.gemm_efficiency(16, 16, 0, A100.peak_flops, A100.memory_bandwidth)


# ------------------------------------------------------------------------------------------------ links per payload
def test_bus_bandwidth_follows_the_published_payload_sweep():
    cal = calibration_for("a100")
    # measured points come back as measured (nccl-tests all_reduce_perf, 8x A100): latency 0, it is in the time
    assert cal.link("all_reduce", True, 16 * MiB) == (pytest.approx(106.16e9), 0.0)
    assert cal.link("all_reduce", True, 64 * MiB) == (pytest.approx(171.54e9), 0.0)
    # between two points: linear in log(payload)
    assert cal.link("all_reduce", True, 96 * MiB)[0] == pytest.approx(
        171.54e9 + math.log(1.5) / math.log(2) * (176.92e9 - 171.54e9))
    # below the smallest payload the time stays at its floor; above the largest the rate stays at its value
    floor = 32 * KiB / cal.link("all_reduce", True, 32 * KiB)[0]
    assert 1 * KiB / cal.link("all_reduce", True, 1 * KiB)[0] == pytest.approx(floor)
    assert cal.link("all_reduce", True, 64 * GiB)[0] == pytest.approx(234.89e9)
    # ring collectives without their own sweep follow the all-reduce's shape from their own large-payload figure
    h = calibration_for("h100")
    assert h.link("all_gather", True, 16 * MiB)[0] == pytest.approx(361.4e9 * 219.89 / 482.26)
    # no payload sweep across nodes or for p2p: alpha-beta, the figure and its latency
    assert cal.link("all_reduce", False, 16 * MiB) == cal.link("all_reduce", False)
    assert cal.link("p2p", True, 16 * MiB) == cal.link("p2p", True)


def test_a_tensor_parallel_all_reduce_is_charged_at_the_rate_measured_for_its_payload():
    spec = ModelSpec(num_layers=36, hidden_size=4096, num_heads=32, vocab_size=51200, seq_len=2048)
    lay = Layout(32, 4, 1, "ddp", 1, 16, "none", 1, "full", False)
    got = predict_step_time(spec, lay, A100, BF16, devices_per_node=8)
    payload = 2048 * 4096 * 2  # b s h bf16: 16 MiB, measured at 106.16 GB/s busbw on 8x A100
    per_layer = 6 * 2 * payload * 3 / 4 / 106.16e9  # six all-reduces with full recomputation, 2 n (t-1)/t each
    assert got.tp_comm_s == pytest.approx(16 * 36 * per_layer)
    # the same step on the fields alone (no calibration): 2.2x cheaper all-reduces, at the large-payload rate
    plain = predict_step_time(spec, lay, A100.replace(calibration=None), BF16, devices_per_node=8)
    assert plain.tp_comm_s < got.tp_comm_s / 2


def test_groups_across_nodes_use_one_measured_adapter_per_member_capped_by_the_ops_nvlink_rate():
    lay = Layout(32, 4, 1, "ddp", 1, 16, "none", 1, "full", False)  # dp groups: 2 members per 8-GPU node
    assert group_link(A100, lay, "dp", 8, op="all_reduce", payload_bytes=25 * MiB) == (2 * 24e9, 1e-5)
    fat = Layout(128, 1, 1, "ddp", 1, 4)  # 8 members per node: 8 x 47 GB/s, under the all-reduce's NVLink rate
    assert group_link(H100, fat, "dp", 8, op="all_reduce")[0] == pytest.approx(8 * 47e9)
    assert group_link(H100, fat, "dp", 8, op="reduce_scatter")[0] == pytest.approx(362.9e9)  # capped by NVLink
    pp = Layout(16, 2, 4, "ddp", 1, 32, "1f1b")
    bsh = 2048 * 4096 * 2
    assert pp_message_time(bsh, pp, A100, 8) == pytest.approx(1e-5 + bsh / 24e9)  # one HDR HCA


# ------------------------------------------------------------------------------------------------ GEMM efficiency
def test_a_gemm_filling_whole_waves_runs_at_the_measured_plateau_and_a_partial_wave_idles_sms():
    cal = calibration_for("a100")
    peak, bw = A100.peak_flops, A100.memory_bandwidth
    # 12 x 9 tiles of 256 x 128 = 108 tiles = one wave on 108 SMs; k large: compute-bound
    assert cal.gemm_efficiency(12 * 256, 9 * 128, 8192, peak, bw) == pytest.approx(cal.plateau)
    # one row of tiles more: 13 x 9 = 117 tiles = 2 waves (the best of the three tiles: 128 x 256 gives 26 x 5 = 130)
    m = 13 * 256
    best = max(117 / 216, (26 * 5) / (2 * 108) * (9 * 128) / (5 * 256), 26 * 9 / (3 * 108))
    assert cal.wave_efficiency(m, 9 * 128) == pytest.approx(best)
    assert cal.gemm_efficiency(m, 9 * 128, 8192, peak, bw) == pytest.approx(cal.plateau * best)
    # a head-sized inner dimension (attention scores, d = 64): bound by moving its s x s output
    s, d = 2048, 64
    memory_bound = 2 * s * s * d / ((s * d + d * s + s * s) * 2 / bw) / peak
    assert cal.gemm_efficiency(s, s, d, peak, bw) == pytest.approx(memory_bound)
    assert memory_bound < 0.5 * cal.plateau


def test_layer_matmul_rate_is_the_flop_weighted_harmonic_mean_of_its_gemms():
    spec = ModelSpec(num_layers=24, hidden_size=2304, num_heads=24, vocab_size=51200, seq_len=2048)
    lay = Layout(32, 2, 1, "ddp", 1, 16)
    shapes = layer_gemm_shapes(spec, lay)
    assert shapes[0] == (2048, 3 * 2304 // 2, 2304, 1) and shapes[4] == (2048, 2048, 96, 12)
    cal = calibration_for("a100")
    flops = seconds = 0.0
    for m, n, k, c in shapes:
        for mm, nn, kk in ((m, n, k), (m, k, n), (k, n, m)):  # forward, input gradient, weight gradient
            f = 2.0 * m * n * k * c
            flops += f
            seconds += f / (A100.peak_flops * cal.gemm_efficiency(mm, nn, kk, A100.peak_flops, A100.memory_bandwidth))
    layer, head = layer_matmul_rates(spec, lay, A100)
    assert layer == pytest.approx(flops / seconds)
    assert 0.3 * A100.peak_flops < layer < head <= A100.achieved_flops
    # a device without a calibration runs every matmul at its achieved rate
    plain = A100.replace(calibration=None)
    assert layer_matmul_rates(spec, lay, plain) == (plain.achieved_flops, plain.achieved_flops)


def test_wider_layers_reach_more_of_the_plateau():
    # PTD-P §5.1 "GPU utilization improves as the models get larger (larger matrix multiplications)": the 1.7B,
    # 18.4B and 1T widths of Table 1 at t = 1, 8, 8 (a check of the shape model, not an input to it)
    rates = []
    for layers, h, a, t in ((24, 2304, 24, 1), (40, 6144, 48, 8), (128, 25600, 160, 8)):
        spec = ModelSpec(num_layers=layers, hidden_size=h, num_heads=a, vocab_size=51200, seq_len=2048)
        rates.append(layer_matmul_rates(spec, Layout(1, t, 1, "ddp", 1, 1), A100)[0])
    assert rates[0] < rates[1] < rates[2] <= A100.achieved_flops


def test_every_op_of_every_family_has_both_links():
    for cal in load_calibration().values():
        for op in COLLECTIVE_OPS:
            for inside in (True, False):
                bw, lat = cal.link(op, inside)
                assert bw > 1e9 and 0 <= lat < 1e-4


def test_sequence_parallel_pairs_take_the_all_gather_rate_which_nvlink_sharp_does_not_speed_up():
    spec = ModelSpec(num_layers=32, hidden_size=4096, num_heads=32, vocab_size=50304, seq_len=2048)
    plain, sp = (Layout(8, 8, 1, "ddp", 1, 4, "none", 1, "none", flag) for flag in (False, True))
    payload = 2048 * 4096 * 2  # 16 MiB: H200's sweep gives the all-reduce 219.89 GB/s (SHARP), the ring ops less
    per_layer = 4 * 2 * payload * 7 / 8
    assert predict_step_time(spec, plain, H100, BF16, 8).tp_comm_s == pytest.approx(4 * 32 * per_layer / 219.89e9)
    ag = 361.4e9 * 219.89 / 482.26
    assert predict_step_time(spec, sp, H100, BF16, 8).tp_comm_s == pytest.approx(4 * 32 * per_layer / ag)


def test_independent_published_measurements_agree_with_the_file():
    """Other public nccl-tests runs than the ones the file quotes, as a check on them (not inputs)."""
    a100, h100 = calibration_for("a100"), calibration_for("h100")
    # NVIDIA/nccl-tests issue 175: one 8x A100 node, all_reduce_perf up to 4 GiB, busbw 232.54 GB/s
    assert a100.link("all_reduce", True, 4 * GiB)[0] == pytest.approx(232.54e9, rel=0.01)
    # NVIDIA/nccl-tests issue 212 (an NCCL developer): H100 ring collectives ~370 GB/s, NVLS all-reduce ~480 GB/s
    assert h100.link("all_gather", True)[0] == pytest.approx(370e9, rel=0.03)
    assert h100.link("all_reduce", True)[0] == pytest.approx(480e9, rel=0.01)
