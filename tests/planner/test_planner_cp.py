"""The planner's context parallelism without processes: cp layouts enumerate and validate through the runtime's rules,
memory per rank falls as 1/cp (model state over N = dp * cp under ZeRO), the cp axis's bytes follow Ring Attention's
and DeepSpeed-Ulysses' formulas, the emitted runs carry the cp size and method, and without cp nothing moves."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

from lightning_par.comm_cost import ring_steps
from lightning_par.context_parallel import comm_cost as cc
from lightning_par.models.gpt import GPTConfig
from lightning_par.planner import (
    DEVICE_PRESETS,
    Layout,
    ModelSpec,
    check_layout,
    enumerate_layouts,
    format_table,
    get_precision,
    layout_overrides,
    model_spec,
    plan,
    predict,
    predict_run,
    to_rows,
)
from lightning_par.context_parallel.planner import layer_comm as cp_layer_comm_bytes
from lightning_par.planner.comm import group_link, group_ranks_per_node, zero_step_comm_bytes
from lightning_par.planner.layouts import CP_METHODS, SCHEDULES
from lightning_par.planner.memory import activation_bytes_per_layer, model_state_bytes, predict_memory, rank_params
from lightning_par.planner.run_config import layout_from_run
from lightning_par.planner.step_time import predict_step_time
from tests.support.forked_run import run_forked

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
SMALL = GPTConfig.from_preset("small")  # 4 layers, 4 heads, 128 wide, 128 tokens
A100 = DEVICE_PRESETS["a100-80gb"].replace(calibration=None)  # the link fields alone: hand-computable
NVLINK, NIC = A100.intra_node_bandwidth, A100.inter_node_bandwidth
BF16 = get_precision("mixed-bf16")
#: A 7B-class GPT (docs/planner.md's worked example).
GPT_7B = GPTConfig(n_layer=32, n_head=32, n_embd=4096, block_size=2048, vocab_size=50304)


# ------------------------------------------------------------------------------------------------ without cp
def test_the_enumeration_without_cp_is_unchanged():
    spec = model_spec(GPT_7B)
    default = list(enumerate_layouts(spec, 64, 512, devices_per_node=8))
    assert list(enumerate_layouts(spec, 64, 512, devices_per_node=8, cp_sizes=(1,))) == default
    assert len(default) == 7212  # docs/planner.md's worked example: "7212 layouts"
    assert [lay.describe() for lay in (*default[:3], default[-1])] == [  # as before cp existed
        "dp64·tp1·pp1 ddp m=8 b=1 ckpt=none",
        "dp64·tp1·pp1 ddp m=8 b=1 ckpt=selective",
        "dp64·tp1·pp1 ddp m=8 b=1 ckpt=full",
        "dp1·tp8·pp8 ddp gpipe m=1 b=512 ckpt=full sp",
    ]
    assert all(lay.cp_size == 1 and lay.cp_method == "ring" and "cp" not in lay.describe() for lay in default)
    # with cp sizes added, the cp = 1 layouts are still all there, in the same order
    with_cp = list(enumerate_layouts(spec, 64, 512, devices_per_node=8, cp_sizes=(1, 2)))
    assert [lay for lay in with_cp if lay.cp_size == 1] == default
    assert any(lay.cp_size == 2 for lay in with_cp)


def test_the_ranking_without_cp_is_unchanged_and_shows_no_cp_columns():
    ranked = plan(GPT_7B, 64, devices_per_node=8, device="h100-80gb", global_batch_size=512, seq_len=2048)
    assert len(ranked) == 7212
    assert ranked[0].layout.describe() == "dp64·tp1·pp1 zero3 m=4 b=2 ckpt=none"  # docs/planner.md's rank 1
    assert "cp method" not in format_table(ranked, top=3)
    assert to_rows(ranked[:1])[0]["cp_size"] == 1  # the rows and the CSV always carry the column


# ------------------------------------------------------------------------------------------------ validity
def test_cp_layouts_enumerate_and_are_exactly_the_valid_ones():
    spec = model_spec(SMALL)
    n, batch = 8, 16
    got = set(enumerate_layouts(spec, n, batch, cp_sizes=(1, 2, 4), checkpointing=("none",)))
    brute = set()
    for dp, tp, pp, cp in itertools.product(range(1, n + 1), repeat=4):
        if dp * tp * pp * cp != n or batch % dp or cp not in (1, 2, 4):
            continue
        for b, mode, sched, v, sp, method in itertools.product(
                range(1, batch // dp + 1), ("ddp", "zero1", "zero2", "zero3"), SCHEDULES, (1, 2, 3, 4),
                (False, True), CP_METHODS):
            lay = Layout(dp, tp, pp, mode, b, batch // (dp * b), sched, v, "none", sp, cp, method)
            try:
                check_layout(lay, spec, num_devices=n, global_batch_size=batch)
            except ValueError:
                continue
            brute.add(lay)
    assert got == brute
    cp_layouts = [lay for lay in got if lay.cp_size > 1]
    assert {lay.cp_size for lay in cp_layouts} == {2, 4}
    assert {lay.cp_method for lay in cp_layouts} == set(CP_METHODS)
    for lay in cp_layouts:
        assert lay.world_size == lay.dp_size * lay.cp_size * lay.tp_size * lay.pp_size == n
        assert lay.global_batch_size == batch
        assert lay.cp_method == "ring" or spec.num_heads % (lay.cp_size * lay.tp_size) == 0
    assert any(lay.pp_size > 1 for lay in cp_layouts)  # cp inside each pipeline stage, as the runtime runs it
    # ZeRO over the cp ranks alone (dp = 1): the runtime shards over dp_shard_cp
    assert Layout(1, 2, 1, "zero3", 16, 1, cp_size=4) in got


def test_describe_and_mesh_show_cp_only_when_used():
    assert Layout(2, 2, 1).mesh == "dp2·tp2·pp1"
    lay = Layout(2, 2, 1, "zero1", cp_size=2, cp_method="all_to_all")
    assert lay.mesh == "dp2·cp2·tp2·pp1" and lay.world_size == 8
    assert lay.describe() == "dp2·cp2·tp2·pp1 zero1 cp=all_to_all m=1 b=1 ckpt=none"
    assert lay.dims().size("cp") == 2 and lay.dims().stride("cp") == 2  # between dp and tp in rank order


SEQ12 = ModelSpec(num_layers=4, hidden_size=64, num_heads=4, vocab_size=128, seq_len=12)


@pytest.mark.parametrize(
    ("layout", "model", "match"),
    [
        (Layout(1, 2, 1, cp_size=4, cp_method="all_to_all"), SMALL,  # the runtime's check_ulysses_heads
         r"n_head=4 is not divisible by cp_size \* tp_size = 4 \* 2; use ring attention"),
        (Layout(1, 1, 1, cp_size=4), SEQ12,  # the runtime's causal load balancing: 2 * cp chunks
         r"seq_len=12 is not divisible by 2 \* cp_size = 8"),
        (Layout(1, 4, 1, sequence_parallel=True, cp_size=2), SEQ12,
         r"sequence_parallel=True is not valid with tp_size=4, cp_size=2 and seq_len=12: expected the tokens per cp "
         r"rank, seq_len / cp_size = 6, divisible by tp_size"),
        (Layout(2, 1, 1, cp_size=2, cp_method="zigzag"), SMALL,
         r"cp_method='zigzag' is not valid: expected one of \['ring', 'all_to_all'\]"),
        (Layout(2, 1, 1, cp_method="all_to_all"), SMALL,
         r"cp_method='all_to_all' is not valid with cp_size=1: expected 'ring' \(nothing to split\)"),
        (Layout(2, 1, 1, cp_size=0), SMALL, r"cp_size=0 is not valid: expected an integer >= 1"),
        (Layout(2, 1, 1, cp_size=2), SMALL,  # the runtime's ParallelDims counts cp in the world size
         r"dp_size \* tp_size \* cp_size \* pp_size = 2 \* 1 \* 2 \* 1 = 4 does not equal world_size=2"),
    ],
)
def test_cp_refusals_name_the_field(layout, model, match):
    devices = 2 if "world_size=2" in match else None
    with pytest.raises(ValueError, match=match):
        check_layout(layout, model_spec(model), num_devices=devices)


def test_cp_layouts_the_runtime_runs_are_valid():
    spec = model_spec(SMALL)
    for lay in (Layout(1, 1, 1, "zero3", cp_size=2),  # ZeRO over the cp ranks alone
                Layout(1, 2, 1, cp_size=2, cp_method="all_to_all", sequence_parallel=True),
                Layout(2, 2, 1, "zero2", cp_size=2)):
        check_layout(lay, spec, num_devices=lay.world_size)


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(cp_sizes=[0]), r"cp_sizes=\[0\] is not valid: expected a non-empty list of positive integers"),
    (dict(cp_sizes=[]), r"cp_sizes=\[\] is not valid"),
    (dict(cp_sizes=[2], cp_methods=["zigzag"]),
     r"cp_methods=\['zigzag'\] is not valid: expected a non-empty subset of \['ring', 'all_to_all'\]"),
])
def test_plan_rejects_bad_cp_choices(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan(SMALL, 8, global_batch_size=16, **kwargs)


# ------------------------------------------------------------------------------------------------ memory
@pytest.mark.parametrize("ckpt", ["none", "selective", "full"])
@pytest.mark.parametrize(("tp", "sp"), [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("cp", [2, 4])
def test_activations_per_layer_fall_as_one_over_cp(ckpt, tp, sp, cp):
    s, b, h, a, e = 2048, 2, 1024, 16, 2
    whole = activation_bytes_per_layer(s, b, h, a, tp, sp, ckpt, e)
    # the count does not depend on the cp method (cp's planner.py passes only its split): the same call for both
    ulysses = activation_bytes_per_layer(s, b, h, a, tp, sp, ckpt, e, seq_split=cp)
    ring = activation_bytes_per_layer(s, b, h, a, tp, sp, ckpt, e, seq_split=cp)
    assert ulysses == pytest.approx(whole / cp)  # s / cp tokens; a / cp heads of s x s scores
    # the ring: s / cp x s scores per head; it keeps no visiting K/V block
    assert ring == pytest.approx(whole / cp)
    assert ring < whole / cp * 1.1


def test_activations_per_layer_on_small_numbers():
    # s = 8, b = 1, h = 4, a = 2, e = 2, cp = 2: s_local = 4; Korthikanti's terms at s_local, scores 4 x 8
    sbh = 4 * 1 * 4
    core = 2 * 4 * 8 * 1 * (2 * 2 + 1)
    expected = 12 * sbh * 2 + core + 4 * sbh * 2 + 2 * sbh
    assert activation_bytes_per_layer(8, 1, 4, 2, seq_split=2) == expected  # Ulysses and the ring alike:
    assert activation_bytes_per_layer(8, 1, 4, 2, 1, False, "none", 2, 2) == expected  # no visiting K/V block kept


def test_memory_per_rank_falls_as_one_over_cp():
    spec = model_spec(GPT_7B)
    base = predict_memory(spec, Layout(1, 1, 1, "ddp", 1, 1), BF16)
    previous = base.activation_bytes
    for cp in (2, 4, 8):
        ulysses = predict_memory(spec, Layout(1, 1, 1, "ddp", 1, 1, cp_size=cp, cp_method="all_to_all"), BF16)
        ring = predict_memory(spec, Layout(1, 1, 1, "ddp", 1, 1, cp_size=cp), BF16)
        assert ulysses.activation_bytes == pytest.approx(base.activation_bytes / cp)
        # the ring also keeps the K/V blocks that visited: 2 (s - s/cp) b h elements per layer (bf16), at most the
        # whole sequence's K and V
        assert ring.activation_bytes == pytest.approx(base.activation_bytes / cp)
        assert ring.activation_bytes < previous / 1.6  # still falls nearly as 1/cp: 8 ranks hold 16% of one's
        previous = ring.activation_bytes
        assert ring.model_state_bytes == ulysses.model_state_bytes == base.model_state_bytes  # ddp: a whole copy


@pytest.mark.parametrize("mode", ["zero1", "zero2", "zero3"])
def test_zero_state_shards_over_dp_times_cp(mode):
    spec = model_spec(GPT_7B)
    params = rank_params(spec, Layout(1, 1, 1), 0)
    for dp, cp in ((1, 2), (2, 2), (4, 2), (2, 4)):
        mem = predict_memory(spec, Layout(dp, 1, 1, mode, cp_size=cp), BF16)
        assert mem.model_state_bytes == model_state_bytes(params, mode, dp * cp, BF16)
        # the same state as plain dp over as many ranks
        assert mem.model_state_bytes == predict_memory(spec, Layout(dp * cp, 1, 1, mode), BF16).model_state_bytes


def test_ddp_with_cp_keeps_the_reducer_buckets_of_a_dp_group():
    spec = model_spec(SMALL)
    cp2 = predict_memory(spec, Layout(1, 1, 1, "ddp", 2, 1, cp_size=2), BF16)
    dp2 = predict_memory(spec, Layout(2, 1, 1, "ddp", 1, 1), BF16)
    assert cp2.buffer_bytes == dp2.buffer_bytes > 0


# ------------------------------------------------------------------------------------------------ communication
def test_cp_bytes_follow_the_formulas_on_small_numbers():
    # ring: (cp - 1) K/V blocks of 2 b (s/cp) (h/t) elements, forward and backward (Liu et al. 2023, §3)
    # forward: cp - 1 blocks of 2 b (S/cp) (h/t) elements; backward twice that (the blocks again, and their dK/dV)
    assert cc.ring_attention_layer_bytes(2, 8, 4, 2, 1, 2) == 3 * 1 * (2 * 2 * 4 * 4 * 2)  # 384
    assert cc.ring_attention_layer_bytes(2, 8, 4, 4, 1, 2) == 3 * 3 * (2 * 2 * 2 * 4 * 2)  # 576
    assert cc.ring_attention_layer_bytes(2, 8, 4, 4, 2, 2) == 576 / 2  # heads split over tp
    assert cc.ring_attention_layer_bytes(2, 8, 4, 4, 1, 2, recompute_forward=True) == 4 * 3 * 64
    # Ulysses: 4 all-to-alls forward and 4 backward of b (s/cp) (h/t) elements, (cp-1)/cp sent (Jacobs et al. 2023)
    local = 2 * 2 * 4 * 2  # b (s/cp) h e = 32 bytes at cp = 4
    assert cc.ulysses_layer_bytes(2, 8, 4, 4, 1, 2) == 8 * local * 3 / 4  # 192
    assert cc.ulysses_layer_bytes(2, 8, 4, 4, 1, 2, recompute_forward=True) == 12 * local * 3 / 4
    assert cc.ring_attention_layer_bytes(2, 8, 4, 1, 1, 2) == cc.ulysses_layer_bytes(2, 8, 4, 1, 1, 2) == 0
    # the messages: ring sends point to point, Ulysses' 2 + 2 all-to-alls (q/k/v as one) of cp - 1 steps
    assert cp_layer_comm_bytes("ring", 2, 8, 4, 4, 1, 2) == (576, 6, 1)
    assert cp_layer_comm_bytes("all_to_all", 2, 8, 4, 4, 1, 2) == (192, 4, 3)
    assert cp_layer_comm_bytes("all_to_all", 2, 8, 4, 4, 1, 2, recompute_forward=True)[1:] == (6, 3)
    assert ring_steps("all_to_all", 4) == 3
    with pytest.raises(ValueError, match=r"method='zigzag' is not valid: expected one of \['ring', 'all_to_all'\]"):
        cp_layer_comm_bytes("zigzag", 2, 8, 4, 4, 1, 2)


@pytest.mark.parametrize(("method", "ckpt"), [("ring", "none"), ("all_to_all", "none"), ("ring", "full"),
                                              ("all_to_all", "selective")])
def test_step_time_charges_the_cp_bytes_per_layer_and_micro_batch(method, ckpt):
    spec = ModelSpec(num_layers=4, hidden_size=64, num_heads=4, vocab_size=128, seq_len=16)
    lay = Layout(1, 1, 1, "ddp", 2, 3, activation_checkpointing=ckpt, cp_size=4, cp_method=method)
    t = predict_step_time(spec, lay, A100, BF16, devices_per_node=8)
    sent, ops, steps = cp_layer_comm_bytes(method, 2, 16, 64, 4, 1, 2, recompute_forward=ckpt != "none")
    per_layer = sent / NVLINK + ops * steps * A100.intra_node_latency_s
    assert t.cp_comm_s == pytest.approx(3 * 4 * per_layer)  # m micro-batches x L layers, over NVLink
    assert predict_step_time(spec, Layout(4, 1, 1, "ddp", 2, 3, activation_checkpointing=ckpt), A100, BF16,
                             8).cp_comm_s == 0.0


def test_compute_per_rank_falls_as_one_over_cp():
    spec = model_spec(GPT_7B)
    whole = predict_step_time(spec, Layout(1, 1, 1, "ddp", 4, 1), A100, BF16, 8)
    for cp in (2, 4):
        split = predict_step_time(spec, Layout(1, 1, 1, "ddp", 4, 1, cp_size=cp), A100, BF16, 8)
        assert split.compute_s == pytest.approx(whole.compute_s / cp)
        assert split.memory_bound_s == pytest.approx(whole.memory_bound_s / cp)
        assert split.model_flops == whole.model_flops  # the same tokens per step


def test_dp_and_cp_reduce_the_same_gradients_over_the_same_ranks():
    # dp2 with one sequence per rank and cp2 with two half sequences per rank: the same tokens per rank, the same
    # gradient all-reduce over 2 ranks (the runtime's dp_cp mesh)
    spec = model_spec(SMALL)
    dp2 = predict_step_time(spec, Layout(2, 1, 1, "zero2", 1, 1), A100, BF16, 8)
    cp2 = predict_step_time(spec, Layout(1, 1, 1, "zero2", 2, 1, cp_size=2), A100, BF16, 8)
    assert cp2.dp_comm_s == pytest.approx(dp2.dp_comm_s) and cp2.dp_comm_s > 0
    assert cp2.optimizer_s == pytest.approx(dp2.optimizer_s)
    params = rank_params(spec, Layout(2, 1, 1), 0)
    assert zero_step_comm_bytes("zero2", params, 2, 2, 2) > 0


@pytest.mark.parametrize(("layout", "axis", "per_node", "bandwidth"), [
    (Layout(1, 1, 1, cp_size=4), "cp", 1, NIC),  # a ring step across nodes: one adapter
    (Layout(1, 1, 1, cp_size=4, cp_method="all_to_all"), "cp", 2, 2 * NIC),  # all-to-all: one per member
    (Layout(2, 2, 1, cp_size=2), "cp", 1, NVLINK),  # cp ranks 2 apart, 4 ranks: inside a node of 4
    (Layout(2, 2, 1, cp_size=2), "dp_cp", 2, 2 * NIC),  # dp x cp = 4 ranks 2 apart over 8: 2 per node
    (Layout(2, 2, 1, cp_size=2), "dp", 1, NIC),  # dp alone: 2 ranks 4 apart, one per node
])
def test_cp_groups_take_their_link_from_the_rank_order(layout, axis, per_node, bandwidth):
    dpn = 2 if layout.world_size == 4 else 4
    assert group_ranks_per_node(layout, axis, dpn) == per_node
    assert group_link(A100, layout, axis, dpn)[0] == pytest.approx(bandwidth)


# ------------------------------------------------------------------------------------------------ plan and runs
def test_plan_ranks_cp_layouts_when_asked():
    ranked = plan(SMALL, 8, devices_per_node=8, device="a100-80gb", global_batch_size=16, cp_sizes=(1, 2, 4))
    with_cp = [p for p in ranked if p.cp_size > 1]
    assert with_cp and {p.cp_method for p in with_cp} == set(CP_METHODS)
    assert all(p.time.cp_comm_s > 0 for p in with_cp)
    assert "cp method" in format_table(ranked, top=3)
    rows = to_rows(with_cp[:1])
    assert rows[0]["cp_size"] == with_cp[0].cp_size and rows[0]["cp_method"] == with_cp[0].cp_method
    only_ring = plan(SMALL, 8, global_batch_size=16, cp_sizes=(2,), cp_methods=("ring",))
    assert only_ring and {(p.cp_size, p.cp_method) for p in only_ring} == {(2, "ring")}


def _compose(overrides):
    from hydra import compose, initialize_config_dir

    from lightning_par.config.schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("layout", [
    Layout(2, 1, 1, "zero2", 4, 1, cp_size=2),
    Layout(1, 2, 1, "ddp", 2, 2, cp_size=2, cp_method="all_to_all", sequence_parallel=True),
    Layout(1, 1, 1, "zero3", 4, 1, cp_size=4),
])
def test_emitted_overrides_carry_the_cp_size_and_method(layout):
    from omegaconf import OmegaConf

    from lightning_par.train import validate_run

    spec = model_spec(SMALL)
    options = {p.stem for p in (CONF / "parallel").glob("*.yaml")}
    check_layout(layout, spec, num_devices=4)
    overrides = layout_overrides(layout, options, spec.num_layers)
    assert "strategy=parallel_3d" in overrides
    assert f"parallel.cp_size={layout.cp_size}" in overrides and "parallel.world_size=4" in overrides
    assert f"strategy.context_parallel.method={layout.cp_method}" in overrides
    cfg = _compose(overrides + ["model=small"])
    run = OmegaConf.to_container(cfg, resolve=True)
    assert layout_from_run(run) == layout
    validate_run(cfg)  # the strategy accepts the layout
    pred = predict_run(run, device="a100-80gb")
    assert pred["cp_comm_s"] > 0
    expected = predict(spec, layout, device="a100-80gb", devices_per_node=4, precision=run["trainer"]["precision"])
    assert pred["step_time_s"] == pytest.approx(expected.step_time_s)


def test_overrides_without_cp_say_nothing_of_it():
    overrides = layout_overrides(Layout(2, 2, 1, "zero1"), {"tp2_dp2"}, 4)
    assert overrides[0] == "parallel=tp2_dp2" and not any("cp" in o or "context_parallel" in o for o in overrides)


def test_the_plan_config_has_cp_off_by_default():
    from hydra import compose, initialize_config_dir

    from lightning_par.config.schema import register_configs
    from lightning_par.planner.config import register_planner_config

    register_configs()
    register_planner_config()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        assert list(compose(config_name="plan").planner.cp_sizes) == [1]
        cfg = compose(config_name="plan", overrides=["planner.cp_sizes=[1,2,4]", "planner.cp_methods=[ring]"])
        assert list(cfg.planner.cp_sizes) == [1, 2, 4] and list(cfg.planner.cp_methods) == ["ring"]


@pytest.mark.e2e
def test_plan_recipe_with_cp_sizes(tmp_path):
    out = tmp_path / "plan"
    cmd = [sys.executable, "recipes/plan.py", "model=small", "parallel.world_size=8", "planner.global_batch_size=16",
           "planner.cp_sizes=[1,2]", "planner.checkpointing=[none]", "planner.top_k=1", f"hydra.run.dir={out}"]
    proc = run_forked(cmd, ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "cp method" in proc.stdout
    text = (out / "plan.csv").read_text()
    assert ",2,ring," in text and ",2,all_to_all," in text
