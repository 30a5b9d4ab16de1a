"""The layout planner without processes: formulas against the papers' figures, enumeration, errors, ranking, configs."""

from __future__ import annotations

import itertools
import math
import shutil
from pathlib import Path

import pytest

from lightning_par.models.gpt import GPTConfig
from lightning_par.planner import (
    DEVICE_PRESETS,
    CpuCalibration,
    Layout,
    ModelSpec,
    check_layout,
    enumerate_layouts,
    get_precision,
    layout_overrides,
    model_spec,
    plan,
    predict,
    predict_run,
)
from lightning_par.planner.comm import allgather_bytes, allreduce_bytes, tp_layer_comm_bytes, zero_step_comm_bytes
from lightning_par.planner.config import overrides_to_recipe, write_layout_recipes
from lightning_par.planner.layouts import divisors
from lightning_par.planner.memory import (
    activation_bytes_per_layer,
    microbatches_in_flight,
    model_state_bytes,
    rank_params,
)
from lightning_par.planner.model import GPT_BLOCK_OPS
from lightning_par.planner.run_config import layout_from_run
from lightning_par.planner.step_time import bubble_fraction
from lightning_par.planner.validate import spearman_rho

CONF = Path(__file__).resolve().parents[2] / "conf"
SMALL = GPTConfig.from_preset("small")


def _cpu_calibration(worlds=(1, 2, 4, 8)) -> CpuCalibration:
    """A made-up calibration (round figures) so that device='cpu' works without measuring."""
    figures = dict(matmul_flops=2e10, idle_speedup=2.0, op_overhead_s=2e-5, tp_layer_overhead_s=5e-3,
                   optimizer_tensor_overhead_s=3e-5, sharded_optimizer_tensor_overhead_s=5e-4, memory_bandwidth=5e9,
                   allreduce_latency_s=1e-3, allreduce_bandwidth=1e9, message_latency_s=2e-4, reserved_bytes=4e8)
    return CpuCalibration(worlds={w: dict(figures) for w in worlds}, machine={"memory_bytes": 24 << 30})


# ------------------------------------------------------------------------------------------------ formulas
def test_zero_state_matches_the_papers_figure_1():
    # Rajbhandari et al. 2020, Figure 1: Psi = 7.5B, N_d = 64, K = 12 (mixed-precision Adam): 120 GB, 31.4 GB,
    # 16.6 GB, 1.9 GB per device for the baseline and stages 1, 2, 3.
    prec = get_precision("mixed-bf16")
    expected = {"ddp": 120e9, "zero1": 31.4e9, "zero2": 16.6e9, "zero3": 1.9e9}
    for mode, figure in expected.items():
        assert model_state_bytes(7.5e9, mode, 64, prec) == pytest.approx(figure, rel=0.015), mode


def test_activation_bytes_match_korthikanti_table_2():
    s, b, h, a, t = 2048, 1, 12288, 96, 8  # GPT-3 175B shapes at tp 8
    sbh = s * b * h
    table = {  # Korthikanti et al. 2022, Table 2, bytes per layer
        ("none", False, 1): sbh * (34 + 5 * a * s / h),
        ("none", False, t): sbh * (10 + 24 / t + 5 * a * s / (h * t)),
        ("none", True, t): sbh / t * (34 + 5 * a * s / h),
        ("selective", False, t): sbh * (10 + 24 / t),
        ("selective", True, t): sbh * 34 / t,
        ("full", False, t): 2 * sbh,
    }
    for (ckpt, sp, tp), figure in table.items():
        got = activation_bytes_per_layer(s, b, h, a, tp, sp, ckpt, element_bytes=2)
        assert got == pytest.approx(figure, rel=1e-12), (ckpt, sp, tp)


def test_fp32_activations_count_elements_twice_but_masks_once():
    s, b, h, a = 128, 4, 128, 4
    two, four = (activation_bytes_per_layer(s, b, h, a, element_bytes=e) for e in (2, 4))
    masks = 2 * s * b * h + a * s * s * b  # two dropout masks of s b h, one of a s^2 b, one byte each
    assert four - masks == pytest.approx(2 * (two - masks))


def test_communication_volumes_follow_the_ring_formulas():
    assert allreduce_bytes(100.0, 4) == pytest.approx(150.0)  # 2 (N-1)/N
    assert allgather_bytes(100.0, 4) == pytest.approx(75.0)  # (N-1)/N
    # Narayanan et al. 2021, §3.2: 8 b s h (t-1)/t elements per layer, forward + backward
    assert tp_layer_comm_bytes(1, 2048, 12288, 8, 2) == pytest.approx(8 * 2048 * 12288 * 7 / 8 * 2)
    recomputed = tp_layer_comm_bytes(1, 2048, 12288, 8, 2, recompute_forward=True)
    assert recomputed == pytest.approx(12 * 2048 * 12288 * 7 / 8 * 2)
    # ZeRO §7: DDP 2 Psi; stage 2 2 Psi (reduce-scatter + all-gather); stage 3 3 Psi per micro-batch (fp16 here)
    psi, n = 1e9, 8
    assert zero_step_comm_bytes("ddp", psi, n, 2, 2) == pytest.approx(2 * 2 * psi * 7 / 8)
    assert zero_step_comm_bytes("zero2", psi, n, 2, 2) == pytest.approx(2 * 2 * psi * 7 / 8)
    assert zero_step_comm_bytes("zero3", psi, n, 2, 2, num_microbatches=3) == pytest.approx(3 * 3 * 2 * psi * 7 / 8)


def test_bubble_fraction():
    assert bubble_fraction(8, 32) == pytest.approx(7 / 39)  # (p-1)/(m+p-1)
    assert bubble_fraction(8, 32, 2) == pytest.approx(7 / 71)  # (p-1)/(v m + p-1)
    assert bubble_fraction(1, 4) == 0.0


def test_in_flight_microbatches_per_schedule():
    lay = Layout(1, 1, 4, micro_batch_size=1, num_microbatches=8, schedule="1f1b")
    assert [microbatches_in_flight(lay, r) for r in range(4)] == [4, 3, 2, 1]
    gpipe = Layout(1, 1, 4, micro_batch_size=1, num_microbatches=8, schedule="gpipe")
    assert microbatches_in_flight(gpipe, 0) == 8
    inter = Layout(1, 1, 4, micro_batch_size=1, num_microbatches=8, schedule="interleaved_1f1b", virtual_stages=2)
    # Korthikanti §4.2.3: the first rank holds (1 + (p-1)/(p v)) times 1F1B's activations: 4 * (1 + 3/8)
    assert microbatches_in_flight(inter, 0) == pytest.approx(4 * (1 + 3 / 8))


def test_gpt_parameter_counts_are_exact():
    for name in ("tiny", "small", "gpt2"):
        cfg = GPTConfig.from_preset(name)
        spec = model_spec(cfg)
        assert spec.total_params() == cfg.num_params()
        assert spec.model_flops_per_token() == cfg.flops_per_token()
    # small at tp 2, first of two stages: wte split, wpe whole, 2 blocks of 12 d^2 + 7d split and 6d replicated
    d = 128
    expected = 256 * d // 2 + 128 * d + 2 * ((12 * d * d + 7 * d) // 2 + 6 * d)
    assert rank_params(model_spec(SMALL), Layout(2, 2, 2, schedule="1f1b"), 0) == expected


def test_megatron_parameter_formula():
    # Narayanan et al. 2021, §5.1: P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)) with tied embeddings
    l, h, v, s = 128, 25600, 51200, 2048
    spec = ModelSpec(num_layers=l, hidden_size=h, num_heads=160, vocab_size=v, seq_len=s, tied_embeddings=True)
    paper = 12 * l * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * l * h))
    assert spec.total_params() == pytest.approx(paper, rel=1e-6)  # the paper leaves out the final norm


def test_gpt_block_op_count_is_what_the_reference_block_dispatches():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from lightning_par.models.gpt import GPT

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    block = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=4)).blocks["0"]
    x = torch.randn(1, 4, 16, requires_grad=True)
    with Count():
        block(x).sum().backward()
    assert Count.n == GPT_BLOCK_OPS


# ------------------------------------------------------------------------------------------------ enumeration
def test_enumeration_is_exactly_the_valid_layouts():
    spec = model_spec(SMALL)  # 4 heads, 4 layers
    n, batch = 8, 32
    got = set(enumerate_layouts(spec, n, batch, max_virtual_stages=2))
    brute = set()
    for dp, tp, pp in itertools.product(divisors(n), repeat=3):
        for b, mode, (sched, v), ckpt, sp in itertools.product(
            divisors(batch), ("ddp", "zero1", "zero2", "zero3"),
            [("none", 1), ("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)],
            ("none", "selective", "full"), (False, True),
        ):
            if dp * b == 0 or batch % (dp * b):
                continue
            lay = Layout(dp, tp, pp, mode, b, batch // (dp * b), sched, v, ckpt, sp)
            try:
                check_layout(lay, spec, num_devices=n, global_batch_size=batch)
            except ValueError:
                continue
            brute.add(lay)
    assert got == brute and got
    for lay in got:
        assert lay.dp_size * lay.tp_size * lay.pp_size == n
        assert spec.num_heads % lay.tp_size == 0 and spec.num_layers % (lay.pp_size * lay.virtual_stages) == 0
        assert lay.global_batch_size == batch


@pytest.mark.parametrize(
    ("layout", "match"),
    [
        (Layout(3, 1, 1), "does not equal world_size=4"),  # the runtime's ParallelDims, num_devices=4
        (Layout(1, 8, 1), r"tp_size=8 is not valid for num_heads=4.*\[1, 2, 4\]"),
        (Layout(1, 1, 4, schedule="1f1b", virtual_stages=1, num_microbatches=4), None),
        (Layout(1, 1, 8, schedule="1f1b"), r"num_layers=4: expected a divisor"),
        (Layout(2, 2, 1, dp_mode="zero4"), r"dp_mode='zero4' is not valid: expected one of"),
        (Layout(4, 1, 1, schedule="1f1b"), r"schedule='1f1b' is not valid with pp_size=1"),
        (Layout(1, 1, 2, schedule="interleaved_1f1b", virtual_stages=2, num_microbatches=3), "multiple of pp_size"),
        (Layout(1, 1, 4, schedule="1f1b", num_microbatches=2, micro_batch_size=1),
         "num_microbatches=2 is not valid for schedule='1f1b' with pp_size=4: expected at least pp_size"),
        (Layout(1, 2, 2, dp_mode="zero1", schedule="1f1b", num_microbatches=2),
         r"dp_mode='zero1' is not valid with dp_size=1"),
        (Layout(4, 1, 1, sequence_parallel=True), "sequence_parallel=True is not valid with tp_size=1"),
    ],
)
def test_invalid_layouts_name_the_field(layout, match):
    spec = model_spec(SMALL)
    devices = 4 if match and "world_size=4" in match else layout.world_size
    if match is None:
        check_layout(layout, spec, num_devices=devices)
        return
    with pytest.raises(ValueError, match=match):
        check_layout(layout, spec, num_devices=devices)


def test_tensor_parallel_groups_stay_inside_a_node():
    spec = ModelSpec(num_layers=8, hidden_size=768, num_heads=12, vocab_size=1024, seq_len=512)
    tps = {lay.tp_size for lay in enumerate_layouts(spec, 24, 48, devices_per_node=8, checkpointing=("none",))}
    assert tps == {1, 2, 4}  # 3, 6 and 12 divide the heads and 24 but not a node of 8
    with pytest.raises(ValueError, match="devices_per_node=8: a tensor-parallel group must lie inside one node"):
        check_layout(Layout(4, 6, 1, micro_batch_size=12), spec, devices_per_node=8)


# ------------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(num_devices=0), r"num_devices=0 is not valid: expected a positive integer"),
        (dict(num_devices=12, devices_per_node=8), r"num_devices=12 is not valid with devices_per_node=8"),
        (dict(device="a100"), r"device='a100' is not valid: expected a DeviceSpec or one of \['a100-40gb'"),
        (dict(global_batch_size=-1), r"global_batch_size=-1 is not valid"),
        (dict(dp_modes=["zero4"]), r"dp_modes=\['zero4'\] is not valid: expected a non-empty subset"),
        (dict(precision="fp8"), r"precision='fp8' is not valid: expected one of"),
        (dict(seq_len=0), r"plan.seq_len=0 is not valid"),
        (dict(global_batch_size=3, num_devices=8, micro_batch_sizes=[2]), "no valid layout"),
    ],
)
def test_plan_rejects_bad_input_with_the_field_named(kwargs, match):
    args = dict(model=SMALL, num_devices=8, devices_per_node=8, device="a100-80gb", global_batch_size=16)
    with pytest.raises(ValueError, match=match):
        plan(**{**args, **kwargs})


def test_model_descriptions_are_checked():
    with pytest.raises(ValueError, match=r"missing \['hidden_size', 'num_heads'"):
        model_spec({"num_layers": 4, "vocab_size": 10, "seq_len": 8})
    with pytest.raises(ValueError, match=r"model fields \['depth'\] are not valid"):
        model_spec({"num_layers": 4, "hidden_size": 64, "num_heads": 4, "vocab_size": 10, "seq_len": 8, "depth": 3})
    with pytest.raises(ValueError, match=r"ModelSpec.hidden_size=66 is not valid with num_heads=4"):
        ModelSpec(num_layers=4, hidden_size=66, num_heads=4, vocab_size=10, seq_len=8)
    with pytest.raises(ValueError, match=r"ModelSpec.num_params=100 is not valid"):
        ModelSpec(num_layers=4, hidden_size=64, num_heads=4, vocab_size=10, seq_len=8, num_params=100)


def test_a_user_dataclass_with_the_spec_fields_is_planned():
    from dataclasses import dataclass

    @dataclass
    class MyModel:  # not the GPT: a user's description
        num_params: int = 1_300_000_000
        num_layers: int = 24
        hidden_size: int = 2048
        num_heads: int = 16
        seq_len: int = 2048
        vocab_size: int = 32000
        flops_per_token: float = 6 * 1.3e9 + 12 * 24 * 2048 * 2048

    ranked = plan(MyModel(), num_devices=8, device="a100-40gb", global_batch_size=64, checkpointing=("none",))
    assert ranked[0].fits
    spec = model_spec(MyModel())
    assert spec.total_params() == 1_300_000_000 and spec.model_flops_per_token() == MyModel.flops_per_token


# ------------------------------------------------------------------------------------------------ ranking
def test_plan_ranks_fitting_layouts_by_time_then_unfit_by_memory():
    big = GPTConfig(n_layer=32, n_head=32, n_embd=4096, block_size=2048, vocab_size=50304)
    ranked = plan(model=big, num_devices=8, devices_per_node=8, device="a100-40gb", global_batch_size=32, seq_len=2048)
    fit = [p for p in ranked if p.fits]
    unfit = [p for p in ranked if not p.fits]
    assert fit and unfit and ranked == fit + unfit
    assert [p.step_time_s for p in fit] == sorted(p.step_time_s for p in fit)
    assert [p.bytes_per_device for p in unfit] == sorted(p.bytes_per_device for p in unfit)
    best = ranked[0]
    assert best.dp_size * best.tp_size * best.pp_size == 8 and best.bytes_per_device <= 40 * 2**30
    # 6.9B parameters with 16 bytes of state each cannot be replicated on 40 GB
    ddp_alone = [p for p in ranked if p.tp_size == 1 and p.pp_size == 1 and p.dp_mode == "ddp"]
    assert ddp_alone and all(not p.fits and "GiB usable on a100-40gb" in p.reason for p in ddp_alone)


def test_more_memory_fits_more_layouts_and_faster_devices_are_faster():
    big = GPTConfig(n_layer=32, n_head=32, n_embd=4096, block_size=2048, vocab_size=50304)
    fits = {d: sum(p.fits for p in plan(big, 8, device=d, global_batch_size=32, checkpointing=("none",)))
            for d in ("a100-40gb", "a100-80gb", "h200")}
    assert fits["a100-40gb"] < fits["a100-80gb"] < fits["h200"]
    lay = Layout(8, 1, 1, "zero3", micro_batch_size=1, num_microbatches=4, activation_checkpointing="full")
    a100, h100 = (predict(big, lay, device=d) for d in ("a100-80gb", "h100-80gb"))
    assert h100.step_time_s < a100.step_time_s


def test_checkpointing_trades_memory_for_time():
    lay = dict(dp_size=8, tp_size=1, pp_size=1, dp_mode="zero3", micro_batch_size=4, num_microbatches=1)
    big = GPTConfig(n_layer=24, n_head=16, n_embd=2048, block_size=2048, vocab_size=50304)
    none, sel, full = (predict(big, Layout(**lay, activation_checkpointing=c)) for c in ("none", "selective", "full"))
    assert none.memory.activation_bytes > sel.memory.activation_bytes > full.memory.activation_bytes
    assert none.step_time_s < sel.step_time_s < full.step_time_s
    assert full.hfu > full.mfu and none.hfu == pytest.approx(none.mfu)


# ------------------------------------------------------------------------------------------------ cpu device
def test_cpu_device_needs_a_calibration(tmp_path):
    with pytest.raises(ValueError, match="needs a calibration of this machine.*plan_validate.py --calibrate-only"):
        plan(SMALL, 4, device="cpu", global_batch_size=8, calibration=tmp_path / "none.json")
    cal = _cpu_calibration(worlds=(2,))
    with pytest.raises(ValueError, match=r"num_devices=4 is not valid for device='cpu': calibrated world sizes are"):
        plan(SMALL, 4, device="cpu", global_batch_size=8, calibration=cal)
    path = cal.save(tmp_path / "cal.json")
    ranked = plan(SMALL, 2, devices_per_node=2, device="cpu", global_batch_size=8, calibration=path)
    assert ranked[0].fits and CpuCalibration.load(path).worlds == cal.worlds


# ------------------------------------------------------------------------------------------------ configs
def _compose(overrides, conf=CONF):
    from hydra import compose, initialize_config_dir

    from lightning_par.config.schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def test_emitted_overrides_compose_into_the_planned_run():
    from omegaconf import OmegaConf

    from lightning_par.train import validate_run

    spec = model_spec(SMALL)
    options = {p.stem for p in (CONF / "parallel").glob("*.yaml")}
    cal = _cpu_calibration()
    layouts = [  # one per strategy the overrides pick, and each dp mode / schedule / sequence-parallel choice
        Layout(8, 1, 1, "ddp", 4, 1),  # ddp_overlap
        Layout(8, 1, 1, "zero2", 4, 1),  # zero2
        Layout(8, 1, 1, "zero3", 2, 2),  # zero3 at pp 1: two micro-batches are gradient accumulation
        Layout(4, 2, 1, "ddp", 8, 1, sequence_parallel=True),  # tensor_parallel
        Layout(2, 1, 4, "ddp", 4, 4, "gpipe"),  # gpipe
        Layout(4, 1, 2, "ddp", 2, 4, "interleaved_1f1b", 2),  # pipeline (any schedule)
        Layout(4, 1, 2, "zero3", 2, 4, "interleaved_1f1b", 2),  # parallel_3d, interleaved
        Layout(2, 2, 2, "zero3", 4, 4, "1f1b", sequence_parallel=True),  # parallel_3d, all three axes
    ]
    for lay in layouts:
        check_layout(lay, spec, num_devices=8, global_batch_size=32)
        cfg = _compose(layout_overrides(lay, options, spec.num_layers) + ["model=small"])
        run = OmegaConf.to_container(cfg, resolve=True)
        assert layout_from_run(run) == lay
        validate_run(cfg)  # the strategy accepts the layout
        pred = predict_run(run, device="cpu", calibration=cal)
        assert pred["step_time_s"] == pytest.approx(predict(spec, lay, device="cpu", devices_per_node=8,
                                                            precision="fp32", calibration=cal).step_time_s)


def test_micro_batches_without_pipelining_become_gradient_accumulation():
    """At pp 1 no strategy cuts a batch into micro-batches (only the pipeline schedules do): a layout with m > 1 and
    pp 1 runs as Lightning's gradient accumulation of micro-batch b, which is what its memory and time assume."""
    lay = Layout(8, 1, 1, "zero3", 2, 4)
    overrides = layout_overrides(lay, None, 4)
    assert "trainer.accumulate_grad_batches=4" in overrides and "data.batch_size=2" in overrides, overrides
    assert "strategy=zero3" in overrides and not any("num_microbatches" in o for o in overrides), overrides
    piped = layout_overrides(Layout(4, 1, 2, "zero1", 2, 4, "1f1b"), None, 4)
    assert "strategy.pipeline.num_microbatches=4" in piped and "data.batch_size=8" in piped, piped
    assert not any("accumulate" in o for o in piped), piped


def test_layout_recipes_run_as_one_multirun(tmp_path):
    from omegaconf import OmegaConf

    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    ranked = plan(SMALL, 8, devices_per_node=8, device="cpu", global_batch_size=32, checkpointing=("none",),
                  calibration=_cpu_calibration())[:3]
    options = [p.stem for p in (CONF / "parallel").glob("*.yaml")]
    out, names = write_layout_recipes(ranked, tmp_path / "layouts", options, 4)
    for name, pred in zip(names, ranked):
        shutil.copy(out / "recipe" / f"{name}.yaml", conf / "recipe" / f"{name}.yaml")
        run = OmegaConf.to_container(_compose([f"+recipe={name}", "model=small"], conf), resolve=True)
        assert layout_from_run(run) == pred.layout


def test_overrides_to_recipe():
    text = overrides_to_recipe(["parallel=tp2_dp4", "strategy=parallel_3d", "strategy.dp_mode=zero1",
                                "strategy.pipeline.split=[2,2]", "data.batch_size=8"], comment="rank 1")
    assert text.startswith("# @package _global_\n# rank 1\ndefaults:\n  - override /parallel: tp2_dp4\n")
    assert "dp_mode: zero1" in text and "split: [2, 2]" in text and "batch_size: 8" in text


def test_predict_run_reads_every_strategy_name():
    base = {"model": {"preset": "small", "vocab_size": 256}, "trainer": {"precision": "32-true"},
            "data": {"batch_size": 8}}
    cases = {
        "ddp_overlap": ({"world_size": 4, "dp_size": -1}, Layout(4, 1, 1, "ddp", 8, 1)),
        "zero2": ({"world_size": 4, "dp_size": 4}, Layout(4, 1, 1, "zero2", 8, 1)),
        "tensor_parallel": ({"world_size": 4, "tp_size": 2}, Layout(2, 2, 1, "ddp", 8, 1)),
        "1f1b": ({"world_size": 4, "pp_size": 2}, Layout(2, 1, 2, "ddp", 2, 4, "1f1b")),
    }
    for name, (par, expected) in cases.items():
        strategy = {"name": name, "pipeline": {"num_microbatches": 4, "schedule": "1f1b"}}
        assert layout_from_run({**base, "parallel": par, "strategy": strategy}) == expected, name
    nested = {**base, "parallel": {"world_size": 8, "dp_size": 2, "tp_size": 2, "pp_size": 2},
              "strategy": {"name": "parallel_3d", "dp_mode": "zero1",
                           "pipeline": {"schedule": "interleaved_1f1b", "num_microbatches": 2, "virtual_stages": 2},
                           "tensor_parallel": {"sequence_parallel": True}}}
    assert layout_from_run(nested) == Layout(2, 2, 2, "zero1", 4, 2, "interleaved_1f1b", 2, "none", True)
    with pytest.raises(ValueError, match=r"strategy.name='fsdp' is not valid for predict_run"):
        layout_from_run({**base, "parallel": {"world_size": 2}, "strategy": {"name": "fsdp"}})
    with pytest.raises(ValueError, match="pass device="):
        predict_run({**base, "parallel": {"world_size": 2}, "strategy": {"name": "ddp_overlap"},
                     "trainer": {"accelerator": "gpu", "precision": "32-true"}})


def test_spearman_rho():
    assert spearman_rho([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman_rho([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # ranks x = (1, 2, 3, 4, 5), y = (2, 1, 4, 3, 5): 1 - 6 * 4 / (5 * 24) = 0.8
    assert spearman_rho([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="constant"):
        spearman_rho([1, 1, 1], [1, 2, 3])


def test_presets_are_sane():
    for name, dev in DEVICE_PRESETS.items():
        assert dev.name == name and dev.usable_bytes > 30 * 2**30 and 1e14 < dev.peak_flops < 2e15
        assert math.isclose(dev.achieved_flops, dev.peak_flops * dev.matmul_efficiency)


def test_sweep_report_sets_predicted_next_to_measured(tmp_path, monkeypatch):
    import json

    from omegaconf import OmegaConf

    from lightning_par.sweep import write_sweep_report

    monkeypatch.setenv("LIGHTNING_PAR_CPU_CALIBRATION", str(_cpu_calibration().save(tmp_path / "cal.json")))
    config = OmegaConf.to_container(_compose(["parallel=dp2", "model=tiny", "trainer.accelerator=cpu"]), resolve=True)
    job = tmp_path / "sweep" / "0_parallel=dp2"
    job.mkdir(parents=True)
    measured = {"strategy": "ddp_overlap", "dp_size": 2, "tp_size": 1, "pp_size": 1, "world_size": 2,
                "tokens_per_s": 1234.0, "param_bytes": [1, 1], "grad_bytes": [1, 1], "optimizer_state_bytes": [1, 1]}
    (job / "summary.json").write_text(json.dumps({**measured, "config": config}))
    (tmp_path / "sweep" / "1_user").mkdir()
    (tmp_path / "sweep" / "1_user" / "summary.json").write_text(json.dumps(measured))  # no config: n/a
    md, _ = write_sweep_report(tmp_path / "sweep")
    lines = md.read_text().splitlines()
    assert "predicted tokens/s" in lines[2] and "predicted state MiB" in lines[2]
    predicted = predict_run(config, calibration=_cpu_calibration())
    assert f"| {predicted['tokens_per_s']:.0f} |" in lines[4]
    assert f"| {predicted['model_state_bytes'] / 2**20:.3f} |" in lines[4]
    assert lines[5].count("n/a") >= 2


def test_latency_bandwidth_fit_recovers_a_line():
    from lightning_par.planner.calibrate import _fit_alpha_beta

    sent = [4e3, 6.4e4, 5e5, 4e6]
    alpha, beta = _fit_alpha_beta(sent, [1e-3 + x / 1e9 for x in sent])
    assert alpha == pytest.approx(1e-3) and beta == pytest.approx(1e9)


def test_plan_config_composes_and_rejects_bad_overrides():
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import ValidationError

    from lightning_par.config.schema import register_configs
    from lightning_par.planner.config import register_planner_config

    register_configs()
    register_planner_config()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="plan", overrides=["planner=cpu", "model=tiny", "parallel=dp4"])
        assert cfg.planner.device == "cpu" and cfg.planner.checkpointing == ["none"] and cfg.parallel.world_size == 4
        with pytest.raises((ValidationError, ConfigCompositionException), match="top_k"):
            compose(config_name="plan", overrides=["planner.top_k=two"])


def test_largest_model_state_is_reported_even_when_another_rank_is_fuller():
    # GPipe with one micro-batch: the last rank (logits) is the fullest, the first (embeddings) holds more state
    lay = Layout(4, 1, 2, "ddp", 8, 1, "gpipe")
    spec = model_spec(SMALL)
    pred = predict(SMALL, lay, device="a100-80gb", precision="fp32")
    first, last = (rank_params(spec, lay, r) * 16 for r in (0, 1))
    assert first > last and pred.memory.pp_rank == 1
    assert pred.memory.max_model_state_bytes == pytest.approx(first)
