"""Pipeline schedules: their analysis without processes (order of operations, stashed activations, deadlock freedom,
the bubble of the ideal timeline), torch's engine on one rank, bubble accounting, and option errors."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from lightning_par.launcher import run_distributed
from lightning_par.models import GPT, GPTConfig
from lightning_par.pipeline_parallel import (
    Action,
    PipelineEngine,
    PipelineOptions,
    bubble_formula,
    build_order,
    cut_network,
    peak_in_flight,
    simulate,
    simulate_actions,
    split_tree,
    summarize_bubble,
)
from lightning_par.pipeline_parallel.schedules import validate_schedule
from lightning_par.strategies.pipeline import PipelineStrategy


def names(order: list[Action]) -> list[str]:
    return [repr(a) for a in order]


def test_gpipe_runs_every_forward_then_every_backward():
    assert names(build_order("gpipe", 1, 2, 3)) == ["F0", "F1", "F2", "B0", "B1", "B2"]


def test_1f1b_order_per_stage():
    """PipeDream-Flush at p=4, m=6: p - s - 1 warm-up forwards, then one forward / one backward, then the drain."""
    assert names(build_order("1f1b", 0, 4, 6)) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5".split()
    assert names(build_order("1f1b", 2, 4, 6)) == "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5".split()
    assert names(build_order("1f1b", 3, 4, 6)) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5".split()


def test_interleaved_order_matches_megatron():
    """p=2, v=2, m=4: micro-batches enter the chunks in groups of p; rank 0 warms up with 2(p-1) + (v-1)p = 4."""
    assert names(build_order("interleaved_1f1b", 0, 2, 4, 2)) == (
        "F0 F1 F0.c1 F1.c1 F2 B0.c1 F3 B1.c1 F2.c1 B0 F3.c1 B1 B2.c1 B3.c1 B2 B3".split()
    )
    assert names(build_order("interleaved_1f1b", 1, 2, 4, 2)) == (
        "F0 F1 F0.c1 B0.c1 F1.c1 B1.c1 F2 B0 F3 B1 F2.c1 B2.c1 F3.c1 B3.c1 B2 B3".split()
    )


GRID = [
    (schedule, p, m, v)
    for schedule, p, m, v in itertools.product(
        ["gpipe", "1f1b", "interleaved_1f1b"], [1, 2, 3, 4], [1, 2, 3, 4, 6, 8], [None, 2, 3]
    )
    if (v is None) != (schedule == "interleaved_1f1b") and (schedule != "interleaved_1f1b" or m % p == 0)
]


@pytest.mark.parametrize("schedule,p,m,v", GRID)
def test_every_microbatch_once_forward_then_backward(schedule, p, m, v):
    for rank in range(p):
        order = build_order(schedule, rank, p, m, v)
        forwards = [(a.chunk, a.microbatch) for a in order if a.kind == "F"]
        backwards = [(a.chunk, a.microbatch) for a in order if a.kind == "B"]
        chunks = v or 1
        assert sorted(forwards) == sorted(backwards) == [(c, i) for c in range(chunks) for i in range(m)]
        assert len(set(forwards)) == len(forwards)
        for c, i in forwards:
            assert order.index(Action("F", c, i)) < order.index(Action("B", c, i))


@pytest.mark.parametrize("schedule,p,m,v", GRID)
@pytest.mark.parametrize("t_forward,t_backward", [(1.0, 1.0), (1.0, 2.0)])
def test_simulated_bubble_equals_formula(schedule, p, m, v, t_forward, t_backward):
    """With uniform stages and free communication, the idle share of every stage is (p-1)/(vm+p-1) exactly, and no
    schedule deadlocks under blocking receives and non-blocking sends."""
    step = simulate(schedule, p, m, v, t_forward, t_backward)
    expected = bubble_formula(p, m, v or 1)
    assert step.bubble == pytest.approx([expected] * p, abs=1e-12)
    assert step.makespan == pytest.approx((m * (v or 1) + p - 1) * (t_forward + t_backward) / (v or 1))


def test_simulated_latency_adds_to_the_bubble():
    ideal = simulate("1f1b", 4, 8, t_forward=1.0, t_backward=2.0)
    slow = simulate("1f1b", 4, 8, t_forward=1.0, t_backward=2.0, latency=0.1)
    assert all(s > i for s, i in zip(slow.bubble, ideal.bubble))


def test_an_overlapped_pair_sends_its_outputs_when_both_end():
    """torch's DualPipeV runs an ``OVERLAP_F_B`` pair back to back and sends after both: the next stage waits longer."""
    unit = lambda kind, stage: 1.0  # noqa: E731
    downstream = [("F", 1, 0), ("F", 1, 1)]
    apart = simulate_actions([[("F", 0, 0), ("F", 0, 1)], downstream], 2, unit)
    paired = simulate_actions([[(("F", 0, 0), ("F", 0, 1))], downstream], 2, unit)
    assert apart.makespan == 3.0  # stage 1 starts micro-batch 0 as soon as stage 0 has made it
    assert paired.makespan == 4.0  # it waits for the pair: both outputs leave at time 2
    assert paired.timeline[0] == [(("F", 0, 0), 0.0, 1.0), (("F", 0, 1), 1.0, 2.0)]


def test_an_overlapped_pair_waits_for_every_input():
    unit = lambda kind, stage: 1.0  # noqa: E731
    # rank 1's pair needs stage 0's forward of micro-batch 1, which rank 0 makes after a 1-unit forward of mb 0
    step = simulate_actions([[("F", 0, 0), ("F", 0, 1)], [(("F", 1, 0), ("F", 1, 1))]], 2, unit)
    assert step.timeline[1][0][1] == 2.0  # not 1.0, when micro-batch 0 alone was ready
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate_actions([[(("F", 0, 0), ("B", 0, 0))], [("F", 1, 0), ("B", 1, 0)]], 2, unit)


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 2), (4, 8), (8, 16)])
def test_1f1b_holds_at_most_p_minus_stage_microbatches(p, m):
    assert [peak_in_flight(build_order("1f1b", s, p, m)) for s in range(p)] == [min(p - s, m) for s in range(p)]
    assert [peak_in_flight(build_order("gpipe", s, p, m)) for s in range(p)] == [m] * p


def test_interleaved_stash_is_bounded_by_its_warmup():
    # Rank r holds 2(p - r - 1) + (v - 1) p warm-up forwards plus the one in flight (Narayanan et al. 2021, §2.2).
    p, v, m = 4, 2, 8
    assert [peak_in_flight(build_order("interleaved_1f1b", r, p, m, v)) for r in range(p)] == [
        2 * (p - r - 1) + (v - 1) * p + 1 for r in range(p)
    ]


def test_bubble_formula_values():
    assert bubble_formula(4, 8) == pytest.approx(3 / 11)
    assert bubble_formula(2, 1) == pytest.approx(1 / 2)
    assert bubble_formula(4, 8, 2) == pytest.approx(3 / 19)


# ---------------------------------------------------------------------------------------------------- errors
def test_unknown_schedule():
    with pytest.raises(ValueError, match=r"schedule='zb' is not valid: expected one of \['gpipe', '1f1b'"):
        validate_schedule("zb", 2, 4)
    with pytest.raises(ValueError, match="schedule='zb' is not valid"):
        PipelineStrategy(schedule="zb")


def test_interleaved_needs_whole_rounds_of_microbatches():
    # torch's interleaved schedules run micro-batches in rounds of m // max(1, m // p).
    message = r"num_microbatches=9 is not valid for schedule='interleaved_1f1b' with pp_size=4"
    with pytest.raises(ValueError, match=message):
        PipelineStrategy(pp_size=4, schedule="interleaved_1f1b", num_microbatches=9)
    PipelineStrategy(pp_size=4, schedule="interleaved_1f1b", num_microbatches=8)
    # The analysis model of the schedule (Megatron's order) needs a multiple of pp_size.
    with pytest.raises(ValueError, match=r"expected a multiple of pp_size \(4, 8, 12"):
        validate_schedule("interleaved_1f1b", 4, 6)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_microbatches=0), r"num_microbatches=0 is not valid: expected an integer >= 1"),
        (dict(schedule="1f1b", virtual_stages=2), r"virtual_stages=2 is not valid for schedule='1f1b'"),
        (dict(schedule="interleaved_1f1b", virtual_stages=1), r"virtual_stages=1 is not valid for schedule='inter"),
        (dict(split="layers"), r"split='layers' is not valid: expected one of \['params', 'time', 'size'\]"),
        (dict(bucket_cap_mb=0), r"bucket_cap_mb=0 is not valid"),
        (dict(pp_size=0), r"pp_size=0 is not valid"),
    ],
)
def test_strategy_option_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PipelineStrategy(**kwargs)


def test_batch_not_divisible_into_microbatches():
    with pytest.raises(ValueError, match=r"batch of shape \(6, 3\) is not valid with num_microbatches=4: expected"):
        split_tree(torch.zeros(6, 3), 4, "the batch")
    parts = split_tree({"y": torch.arange(8), "mask": (torch.ones(8, 2),)}, 4)
    assert len(parts) == 4 and parts[1]["y"].tolist() == [2, 3] and parts[3]["mask"][0].shape == (2, 2)


def test_registered_names_and_presets():
    from lightning.fabric.strategies.registry import _StrategyRegistry

    registry = _StrategyRegistry()  # a fresh one: the global registry is lightning_par/__init__'s business
    PipelineStrategy.register_strategies(registry)
    for name in ("gpipe", "1f1b"):
        assert registry[name]["strategy"] is PipelineStrategy
        assert registry[name]["init_params"] == {"schedule": name}
        assert registry.get(name).options.pipeline.schedule == name
        assert registry.get(name).strategy_name == name
    assert registry["pipeline"]["init_params"] == {}
    assert registry["pipeline"]["strategy"](schedule="zbv_zero_bubble").strategy_name == "pipeline"


# ---------------------------------------------------------------------------------------------------- engine
def _engine_on_one_rank(schedule: str, virtual: int) -> dict:
    """pp_size=1: torch's schedule passes every activation inside the process."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    config = GPTConfig(n_layer=4, n_head=2, n_embd=16, block_size=8, vocab_size=32)
    torch.manual_seed(0)
    whole = GPT(config)
    torch.manual_seed(0)
    staged = GPT(config)
    x = torch.randint(0, 32, (8, 8), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 32, (8, 8), generator=torch.Generator().manual_seed(2))

    def loss_fn(logits, targets):
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    reference = loss_fn(whole(x), y)
    reference.backward()
    options = PipelineOptions(schedule=schedule, num_microbatches=4, virtual_stages=virtual)
    ids = options.stage_ids(0, 1)
    holder, modules = cut_network(staged, [4 // virtual] * virtual, ids)
    engine = PipelineEngine(modules, ids, options, dist.group.WORLD, 1, torch.device("cpu"), loss_fn)
    loss = engine.train_step((x,), y)
    record = engine.history[-1]
    return {
        "loss": float(loss), "reference": float(reference), "eval": float(engine.eval_step((x,), y)),
        "grads": {n: (p.grad, dict(whole.named_parameters())[n].grad) for n, p in holder.named_parameters()},
        "forwards": sum(e.kind == "F" for e in record.events), "backwards": sum(e.kind == "B" for e in record.events),
        "peak": record.peak_in_flight,
    }


@pytest.mark.distributed  # starts a (one-rank) world: run by `make test`'s distributed stage, not `make test-fast`
@pytest.mark.parametrize("schedule,virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4)])
def test_engine_on_one_rank_matches_the_whole_model(schedule, virtual):
    """The schedule's gradients equal one backward of the whole batch's mean loss; every micro-batch runs forward
    and backward through every chunk once; GPipe holds all micro-batches, 1F1B on one stage one at a time."""
    out = run_distributed(_engine_on_one_rank, 1, (schedule, virtual), timeout_s=120)[0]
    assert out["loss"] == pytest.approx(out["reference"], rel=1e-6)
    assert out["eval"] == pytest.approx(out["reference"], rel=1e-6)
    for name, (got, expected) in out["grads"].items():
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7, msg=name)
    assert out["forwards"] == out["backwards"] == 4 * virtual
    if schedule == "gpipe":
        assert out["peak"] == 4
    if schedule == "1f1b":
        assert out["peak"] == 1


# ---------------------------------------------------------------------------------------------------- accounting
def test_summarize_bubble_uses_the_common_window():
    # Two stages, two steps: (span, busy, peak). Stage 1 finishes early in step 0; the window is the longest span.
    stages = [[(1.0, 0.6, 2), (2.0, 1.0, 2)], [(0.8, 0.6, 1), (1.5, 1.2, 1)]]
    out = summarize_bubble(stages)
    assert out["pp_step_window_s"] == pytest.approx(3.0)
    assert out["pp_busy_s"] == pytest.approx([1.6, 1.8])
    assert out["pp_idle_s"] == pytest.approx([1.4, 1.2])
    assert out["pp_bubble_per_stage"] == pytest.approx([1.4 / 3, 1.2 / 3])
    assert out["pp_bubble"] == pytest.approx(2.6 / 6)
    assert out["pp_peak_microbatches_in_flight"] == [2, 1]
    with pytest.raises(ValueError, match="same steps"):
        summarize_bubble([[(1.0, 0.5, 1)], []])
