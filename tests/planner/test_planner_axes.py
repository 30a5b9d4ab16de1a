"""The planner on the axis registry: every axis's terms come from its folder, and HSDP, cp and ep in enumeration,
memory and time (no processes; the world-8 gloo check of the bytes is tests/planner/test_planner_state.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from lightning_par.axis_registry import Axis, PlannerTerms
from lightning_par.models.gpt import GPTConfig
from lightning_par.planner import Layout, check_layout, layout_overrides, plan, predict, to_markdown
from lightning_par.planner.layouts import planner_terms
from lightning_par.planner.memory import model_state_bytes, rank_param_groups, rank_state_bytes
from lightning_par.planner.model import ModelSpec, model_spec
from lightning_par.planner.precision import get_precision
from lightning_par.planner.run_config import layout_from_run

CONF = Path(__file__).resolve().parents[2] / "conf"
FP32 = get_precision("fp32")
DENSE = GPTConfig.from_preset("small")
MOE = GPTConfig.from_preset("moe_small")  # 4 blocks x 128, 8 experts in blocks 1 and 3, top-2
MOE_BIG = GPTConfig(n_layer=8, n_head=16, n_embd=1024, block_size=1024, vocab_size=32000, num_experts=8, moe_every=2)


# ------------------------------------------------------------------------------------------------ registry
def test_every_axis_gives_its_planner_terms_from_its_own_folder():
    from lightning_par.axes import AXES

    terms = dict(planner_terms())
    assert sorted(terms) == ["cp", "dp", "ep", "pp", "tp"]
    assert [n for n, t in terms.items() if t.state_bytes is not None] == ["dp", "ep"]
    for axis in AXES:
        if axis.planner is not None:
            assert type(axis.planner).__module__ == "lightning_par.axis_registry"
            parts = (axis.planner.check, axis.planner.slot_comm_s, axis.planner.step_comm_s, axis.planner.state_bytes)
            owner = {f.__module__ for f in parts if f is not None}
            assert owner == {f"lightning_par.{axis.steps[0][1].__module__.split('.')[1]}.planner"}, axis.name
    lay = Layout(2, 2, 2, "zero1", 1, 4, "1f1b", cp_size=1, ep_size=2)
    pred = predict(MOE_BIG, lay, device="h100-80gb")
    assert set(pred.time.comm_s) == set(terms)  # every registered term reported under its axis's name
    assert pred.time.comm_s["ep"] > 0 and pred.time.comm_s["tp"] > 0 and pred.time.comm_s["pp"] > 0


def test_the_core_sums_whatever_the_registry_holds(monkeypatch):
    """A new axis is an entry with its terms: its check refuses and its time is added, with no planner edit."""
    import lightning_par.axes as axes

    def refuse_odd_microbatches(layout, model):
        if layout.num_microbatches % 2:
            raise ValueError(f"num_microbatches={layout.num_microbatches} is not valid for the new axis: even.")

    new = Axis(name="new", planner=PlannerTerms(check=refuse_odd_microbatches, slot_comm_s=lambda ctx: 0.25,
                                                state_bytes=lambda ctx, pp_rank: 1000.0))
    lay = Layout(8, 1, 1, "zero2", 1, 2)
    before = predict(DENSE, lay)
    monkeypatch.setattr(axes, "AXES", (*axes.AXES, new))
    after = predict(DENSE, lay)
    assert after.time.comm_s["new"] == pytest.approx(2 * 0.25)  # per micro-batch slot, 2 slots
    assert after.step_time_s == pytest.approx(before.step_time_s + 0.5)
    assert after.memory.model_state_bytes == pytest.approx(before.memory.model_state_bytes + 1000)
    with pytest.raises(ValueError, match="num_microbatches=1 is not valid for the new axis"):
        check_layout(dataclasses.replace(lay, num_microbatches=1, micro_batch_size=2), model_spec(DENSE))


# ------------------------------------------------------------------------------------------------ MoE model
@pytest.mark.parametrize("config", [
    GPTConfig.from_preset("moe_tiny", vocab_size=256),
    GPTConfig.from_preset("moe_small", moe_shared_expert=True),
    GPTConfig.from_preset("moe_tiny", bias=False, moe_top_k=1, moe_hidden=24),
    MOE_BIG,
])
def test_moe_spec_counts_total_and_active_parameters_as_the_gpt(config):
    spec = model_spec(config)
    assert spec.total_params() == config.num_params()
    assert spec.non_embedding_params() == config.num_active_params(include_embedding=False)
    assert spec.model_flops_per_token() == config.flops_per_token()  # FLOPs of the active experts only
    assert spec.total_params() > spec.non_embedding_params() + spec.embedding_params()  # experts idle per token


def test_moe_spec_refuses_bad_fields():
    base = dict(num_layers=4, hidden_size=64, num_heads=4, vocab_size=100, seq_len=32)
    with pytest.raises(ValueError, match=r"ModelSpec.num_experts=1 is not valid: expected 0 \(dense\) or an integer"):
        ModelSpec(**base, num_experts=1)
    with pytest.raises(ValueError, match="ModelSpec.moe_top_k=5 is not valid with num_experts=4"):
        ModelSpec(**base, num_experts=4, moe_top_k=5)
    with pytest.raises(ValueError, match="ModelSpec.moe_every=5 is not valid with num_layers=4"):
        ModelSpec(**base, num_experts=4, moe_every=5)
    with pytest.raises(ValueError, match="ModelSpec.num_params=1000000 is not valid with num_experts=4"):
        ModelSpec(**base, num_experts=4, num_params=1_000_000)


# ------------------------------------------------------------------------------------------------ memory
def test_hsdp_shards_the_state_over_dp_shard_not_dp():
    spec = model_spec(DENSE)
    hsdp_ddp, ddp = (predict(DENSE, Layout(8, 1, 1, "ddp", dp_replicate_size=r), precision="fp32") for r in (2, 1))
    assert hsdp_ddp.step_time_s == pytest.approx(ddp.step_time_s)  # ddp: one group of 8 either way
    assert hsdp_ddp.memory.model_state_bytes == ddp.memory.model_state_bytes
    for mode in ("zero1", "zero2", "zero3"):
        hsdp = predict(DENSE, Layout(8, 1, 1, mode, dp_replicate_size=2), precision="fp32")
        params = rank_param_groups(spec, hsdp.layout, 0)[0]
        assert hsdp.memory.model_state_bytes == pytest.approx(model_state_bytes(params, mode, 4, FP32))
        flat = predict(DENSE, Layout(8, 1, 1, mode), precision="fp32")
        assert hsdp.memory.model_state_bytes > flat.memory.model_state_bytes
    with_cp = Layout(2, 1, 1, "zero3", cp_size=2, dp_replicate_size=2)  # dp_shard 1 x cp 2: N = 2
    assert rank_state_bytes(spec, with_cp, FP32, 0) == pytest.approx(rank_param_groups(spec, with_cp, 0)[0] * 16 / 2)


def test_experts_split_over_ep_and_shard_over_edp_shard():
    spec = model_spec(MOE_BIG)  # 8 experts of 2 * 1024 * 2048 in 4 of 8 blocks
    per_block = 8 * 2 * 1024 * 2048
    for ep in (1, 2, 4, 8):
        lay = Layout(8, 1, 1, "zero3", ep_size=ep)
        dense, experts = rank_param_groups(spec, lay, 0)
        assert experts == 4 * per_block / ep and dense + 4 * per_block == spec.total_params()
        # experts' state over edp_shard = 8 / ep ranks (whole experts: 8 / ep local experts divide evenly)
        assert rank_state_bytes(spec, lay, FP32, 0) == pytest.approx(16 * dense / 8 + 16 * experts / (8 / ep))
    # with a pipeline, a rank holds its own blocks' experts: blocks 1, 3 on pp rank 0 and 5, 7 on pp rank 1
    assert rank_param_groups(spec, Layout(4, 1, 2, "zero1", 1, 2, "1f1b", ep_size=2), 1)[1] == 2 * per_block / 2
    # fewer local experts than edp_shard ranks: the fullest rank holds a whole expert, not 1 / edp_shard of them
    lay = Layout(8, 1, 1, "zero3", ep_size=4)  # 2 local experts over edp_shard = 2: one each
    tight = Layout(16, 1, 1, "zero3", ep_size=4)  # 2 local experts over edp_shard = 4: one each on two ranks
    assert rank_state_bytes(spec, tight, FP32, 0) - 16 * rank_param_groups(spec, tight, 0)[0] / 16 == pytest.approx(
        rank_state_bytes(spec, lay, FP32, 0) - 16 * rank_param_groups(spec, lay, 0)[0] / 8)


def test_tp_leaves_the_experts_whole_and_refuses_sequence_parallel_with_moe():
    spec = model_spec(MOE_BIG)
    one, two = (rank_param_groups(spec, Layout(2, t, 1, "ddp"), 0) for t in (1, 2))
    assert two[1] == one[1] and two[0] < one[0]
    with pytest.raises(ValueError, match="sequence_parallel=True is not valid with tp_size=2 for a model with"):
        check_layout(Layout(4, 2, 1, "ddp", sequence_parallel=True), spec)


# ------------------------------------------------------------------------------------------------ time
def test_ep_all_to_alls_and_hsdp_all_reduce_in_the_step_time():
    lay = Layout(8, 1, 1, "zero2", 2, 4, ep_size=2)
    pred = {ep: predict(MOE_BIG, dataclasses.replace(lay, ep_size=ep), device="h100-80gb", devices_per_node=4)
            for ep in (1, 2, 4, 8)}
    assert pred[1].time.ep_comm_s == 0
    # b s k h e (ep-1)/ep per all-to-all, 4 per MoE block and micro-batch (2 forward, 2 backward)
    sent = 2 * 1024 * 2 * 1024 * 2 * (1 / 2) * 4 * 4 * 4  # x 4 MoE blocks x 4 micro-batches
    dev = pred[2]
    assert dev.time.ep_comm_s >= sent / 600e9  # at most NVLink speed inside a node (ep group within 4 devices)
    assert pred[2].time.ep_comm_s < pred[4].time.ep_comm_s < pred[8].time.ep_comm_s  # (ep-1)/ep, then across nodes
    # the experts' gradients are reduced over edp (8 / ep ranks): less dp traffic as ep grows, none at ep = 8;
    # each rank's optimizer still steps 1/8 of them
    assert pred[1].time.dp_comm_s > pred[2].time.dp_comm_s > pred[4].time.dp_comm_s > pred[8].time.dp_comm_s
    assert pred[8].time.optimizer_s == pytest.approx(pred[1].time.optimizer_s)
    flat, hsdp = (predict(DENSE, Layout(16, 1, 1, "zero2", 1, 2, dp_replicate_size=r), devices_per_node=8)
                  for r in (1, 2))
    assert hsdp.time.dp_comm_s != flat.time.dp_comm_s and hsdp.time.comm_s["dp"] == hsdp.time.dp_comm_s


# ------------------------------------------------------------------------------------------------ enumeration
def test_plan_enumerates_hsdp_and_ep_on_the_runtimes_rules():
    default = plan(MOE, 8, global_batch_size=16, checkpointing=("none",))
    assert {(p.dp_replicate_size, p.ep_size) for p in default} == {(1, 1)}
    ranked = plan(MOE, 8, global_batch_size=16, checkpointing=("none",), dp_replicate_sizes=(1, 2),
                  ep_sizes=(1, 2, 4, 8))
    seen = {(p.dp_replicate_size, p.ep_size) for p in ranked}
    assert {(2, 1), (1, 2), (2, 2), (1, 8), (2, 4)} <= seen and (2, 8) not in seen  # ep 8 > dp_shard 4 under HSDP
    for p in ranked:
        dims = p.layout.dims()  # the runtime's ParallelDims accepts every one
        assert dims.size("dp_shard_cp") % p.ep_size == 0
        assert p.dp_replicate_size == 1 or p.dp_mode != "ddp"
    table = to_markdown(ranked)
    assert "| rep |" in table and "| ep |" in table and "ep comm s" in table
    assert "| rep |" not in to_markdown(default) and "| ep |" not in to_markdown(default)


@pytest.mark.parametrize("call, message", [
    (lambda: plan(DENSE, 8, ep_sizes=(1, 2)), r"ep_sizes=\[1, 2\] is not valid for a dense model"),
    (lambda: plan(MOE, 8, ep_sizes=(0,)), r"ep_sizes=\[0\] is not valid: expected a non-empty list of positive"),
    (lambda: plan(MOE, 8, dp_replicate_sizes=()), r"dp_replicate_sizes=\[\] is not valid"),
    (lambda: plan(MOE, 8, sizes={"xp_size": (1, 2)}), r"sizes=\{'xp_size': \(1, 2\)\} is not valid: \['xp_size'\]"),
    (lambda: plan(MOE, 8, sizes={"ep_size": (1, -2)}), r"sizes\['ep_size'\]=\[1, -2\] is not valid"),
    (lambda: check_layout(Layout(8, 1, 1, "zero2", ep_size=3), model_spec(MOE)),
     r"ep_size=3 is not valid: expert parallelism borrows its ranks from dp_shard_size \* cp_size"),
    (lambda: check_layout(Layout(6, 1, 1, "zero2", ep_size=3), model_spec(MOE)),
     r"ep_size=3 is not valid for the model with num_experts=8: each ep rank holds num_experts / ep_size experts; "
     r"expected ep_size in \[1, 2\]"),
    (lambda: check_layout(Layout(8, 1, 1, "zero2", ep_size=2), model_spec(DENSE)),
     r"ep_size=2 is not valid for a dense model \(num_experts=0\): expected 1"),
    (lambda: check_layout(Layout(8, 1, 1, "zero2", dp_replicate_size=3), model_spec(DENSE)),
     r"dp_replicate_size=3 is not valid with dp_size=8: expected a divisor of dp_size"),
    (lambda: check_layout(Layout(2, 1, 1, "zero1", dp_replicate_size=2), model_spec(DENSE)),
     r"dp_mode='zero1' is not valid with dp_shard_size \* cp_size = 1"),
])
def test_bad_hsdp_and_ep_input_is_refused_naming_the_field(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_hsdp_and_ep_layouts_become_runs_that_compose_and_read_back():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from lightning_par.config.schema import register_configs
    from lightning_par.train import validate_run

    register_configs()
    options = {p.stem for p in (CONF / "parallel").glob("*.yaml")}
    layouts = [Layout(4, 1, 1, "zero3", 2, 1, dp_replicate_size=2), Layout(4, 1, 1, "zero2", 2, 1, ep_size=2),
               Layout(2, 2, 1, "zero1", 2, 1, ep_size=2, cp_size=2, dp_replicate_size=2)]
    for lay in layouts:
        overrides = layout_overrides(lay, options, 2) + ["model=moe_tiny"]
        assert "strategy=parallel_3d" in overrides
        with initialize_config_dir(config_dir=str(CONF), version_base=None):
            cfg = compose(config_name="config", overrides=overrides)
        run = OmegaConf.to_container(cfg, resolve=True)
        assert layout_from_run(run) == lay
        validate_run(cfg)  # the strategy accepts the layout


def test_plan_config_takes_hsdp_and_ep_sizes_and_refuses_bad_ones_at_compose_time():
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import ValidationError

    from lightning_par.config.schema import register_configs
    from lightning_par.planner.config import register_planner_config

    register_configs()
    register_planner_config()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="plan", overrides=["model=moe_small", "planner.ep_sizes=[1,2,4]",
                                                     "planner.dp_replicate_sizes=[1,2]"])
        assert list(cfg.planner.ep_sizes) == [1, 2, 4] and list(cfg.planner.dp_replicate_sizes) == [1, 2]
        with pytest.raises((ValidationError, ConfigCompositionException), match="ep_sizes"):
            compose(config_name="plan", overrides=["planner.ep_sizes=[two]"])
