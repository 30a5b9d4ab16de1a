"""The dry run (:mod:`lightning_par.planner.dry_run`): the real ``parallelize()`` for one rank of an N-rank world on
the meta device and a fake process group, its model-state bytes against the planner's analytic prediction.

Every dp mode, tp, pp, HSDP, cp and ep at N = 8, 512 and 1024, within 1%: each pipeline stage against the planner's
model state of that stage, and for HSDP and ep layouts the worst rank against the planner's fullest rank
(``predict_memory``). The gloo check at N = 8 is ``tests/planner/test_plan_dry_run.py``.
"""

from __future__ import annotations

import pytest
import torch

from lightning_par.models import GPTConfig, GPTLightningModule
from lightning_par.parallel_dims import ParallelDims
from lightning_par.parallelize import ParallelOptions
from lightning_par.planner import Layout, get_precision, model_spec, predict_memory
from lightning_par.planner.dry_run import dry_run, dry_run_ranks, fake_world, stage_ranks, worst_rank
from lightning_par.planner.memory import model_state_bytes, rank_params

FP32 = get_precision("fp32")
#: N = 8: small enough that no dim-0 chunk is padded at dp 8.
SMALL = GPTConfig(n_layer=4, n_head=4, n_embd=64, block_size=32, vocab_size=256, dropout=0.0)
#: N = 512 and 1024: every sharded dimension divides by the dp sizes used (no padding), built on meta (no memory).
LARGE = GPTConfig(n_layer=4, n_head=16, n_embd=1024, block_size=1024, vocab_size=32768, dropout=0.0)
MOE_SMALL = GPTConfig(**{**SMALL.__dict__, "num_experts": 8, "moe_every": 2})
#: 1024 experts: each rank's experts (``E / ep``) split evenly over the ranks sharding them (``edp_shard``); with fewer
#: (64 at ep 64, edp_shard 16) dim-0 sharding gives one rank a whole expert and the others none: 13x the formula.
MOE_LARGE = GPTConfig(**{**LARGE.__dict__, "num_experts": 1024, "moe_every": 2, "moe_hidden": 64})


def _module(config: GPTConfig):
    return lambda: GPTLightningModule(config)


def _layout(dims: ParallelDims, mode: str, micro: int) -> Layout:
    pp = dims.pp_size
    return Layout(dp_size=dims.dp_size, tp_size=dims.tp_size, pp_size=pp, dp_mode=mode if dims.dp_size * dims.cp_size
                  > 1 else "ddp", schedule="1f1b" if pp > 1 else "none", num_microbatches=micro,
                  cp_size=dims.cp_size, dp_replicate_size=dims.dp_replicate_size, ep_size=dims.ep_size)


def _predicted(config: GPTConfig, dims: ParallelDims, mode: str, pp_rank: int, micro: int) -> float:
    """The planner's model state of pipeline rank ``pp_rank``; for HSDP and ep layouts, of its fullest rank."""
    spec, layout = model_spec(config), _layout(dims, mode, micro)
    if dims.dp_replicate_size > 1 or dims.ep_size > 1:
        return predict_memory(spec, layout, FP32).max_model_state_bytes
    return model_state_bytes(rank_params(spec, layout, pp_rank), layout.dp_mode, dims.dp_size * dims.cp_size, FP32)


def _check(config: GPTConfig, world: int, mode: str, **sizes: int) -> list[float]:
    dims = ParallelDims(world_size=world, **sizes)
    micro = max(1, dims.pp_size)
    # The planner assumes L / pp layers per stage; the runtime's default split balances parameters instead (the
    # embedding's stage gets fewer layers), so the layers are given evenly here.
    even = {"num_microbatches": micro, "split": [config.n_layer // dims.pp_size] * dims.pp_size}
    options = ParallelOptions.build(dp_mode=mode, **(even if dims.pp_size > 1 else {}))
    states = dry_run_ranks(_module(config), dims, options, stage_ranks(dims))
    assert [s.pp_rank for s in states] == list(range(dims.pp_size))
    assert all(s.optimizers == ("AdamW",) for s in states)
    ratios = []
    for s in states:
        ratios.append(s.model_state_bytes / _predicted(config, dims, mode, s.pp_rank, micro))
    if dims.dp_replicate_size > 1 or dims.ep_size > 1:  # the planner's fullest rank against the worst rank
        ratios = [worst_rank(states).model_state_bytes / _predicted(config, dims, mode, 0, micro)]
    return ratios


N8 = [
    ("ddp", dict(tp_size=2, pp_size=2)),
    ("zero1", dict(tp_size=2, pp_size=2)),
    ("zero2", dict(tp_size=2)),
    ("zero3", dict(pp_size=2)),
    ("zero1", dict(cp_size=2)),
    ("zero1", dict(dp_replicate_size=2, tp_size=2)),
    ("zero3", dict(dp_replicate_size=2, pp_size=2)),
]
N8_EP = [("ddp", dict(ep_size=2)), ("zero2", dict(ep_size=4, cp_size=2))]
LARGE_CASES = [
    (1024, "zero1", dict(tp_size=8, pp_size=4)),
    (1024, "zero3", dict()),
    (1024, "zero3", dict(tp_size=4, cp_size=2, pp_size=2)),
    (512, "ddp", dict(tp_size=4, cp_size=4)),
    (512, "zero2", dict(dp_replicate_size=4, tp_size=2, pp_size=2)),
]
LARGE_EP = [(1024, "zero3", dict(ep_size=64)), (512, "zero1", dict(ep_size=32, dp_replicate_size=4))]


def _ids(cases):
    return ["-".join([str(c[0]) if len(c) == 3 else "8", c[-2], *(f"{k[:-5]}{v}" for k, v in c[-1].items())])
            for c in cases]


@pytest.mark.parametrize("mode, sizes", N8 + N8_EP, ids=_ids(N8 + N8_EP))
def test_dry_run_bytes_match_the_analytic_prediction_at_8(mode, sizes):
    config = MOE_SMALL if sizes.get("ep_size", 1) > 1 else SMALL
    for ratio in _check(config, 8, mode, **sizes):
        assert ratio == pytest.approx(1.0, rel=0.01)


@pytest.mark.parametrize("world, mode, sizes", LARGE_CASES + LARGE_EP, ids=_ids(LARGE_CASES + LARGE_EP))
def test_dry_run_bytes_match_the_analytic_prediction_at_512_and_1024(world, mode, sizes):
    config = MOE_LARGE if sizes.get("ep_size", 1) > 1 else LARGE
    for ratio in _check(config, world, mode, **sizes):
        assert ratio == pytest.approx(1.0, rel=0.01)


def test_each_rank_reads_its_own_shards():
    """zero2 keeps only gradient chunks, zero3 shards parameters, a pipeline stage holds its own layers: the counts
    differ the way the runtime builds them (not a formula applied to one number)."""
    dims = ParallelDims(world_size=8, pp_size=2)
    build = _module(SMALL)
    ddp, zero2, zero3 = (dry_run(build, dims, ParallelOptions.build(dp_mode=m, num_microbatches=2), 0)
                         for m in ("ddp", "zero2", "zero3"))
    assert ddp.param_bytes == zero2.param_bytes == 4 * ddp.params
    assert zero2.grad_bytes == pytest.approx(ddp.grad_bytes / 4, rel=0.01)  # dp 4
    assert zero3.param_bytes == pytest.approx(ddp.param_bytes / 4, rel=0.01)
    last = dry_run(build, dims, ParallelOptions.build(dp_mode="ddp", num_microbatches=2), 7)
    assert last.pp_rank == 1 and last.params != ddp.params  # the head's stage, not the embedding's


def test_stage_ranks_and_worst_rank():
    dims = ParallelDims(world_size=16, tp_size=2, pp_size=4)
    assert stage_ranks(dims) == [0, 4, 8, 12]
    assert stage_ranks(dims, 5) == [1, 5, 9, 13]
    with pytest.raises(ValueError, match="rank=16 is not valid"):
        stage_ranks(dims, 16)
    with pytest.raises(ValueError, match="at least one RankState"):
        worst_rank([])


def test_bad_inputs_are_refused_before_building():
    dims = ParallelDims(world_size=8, tp_size=2)
    with pytest.raises(ValueError, match=r"rank=8 is not valid: expected 0 <= rank < world_size=8"):
        dry_run(_module(SMALL), dims, ParallelOptions.build(), 8)
    with pytest.raises(ValueError, match="n_head=4 is not divisible by tp_size=8"):
        dry_run(_module(SMALL), ParallelDims(world_size=8, tp_size=8), ParallelOptions.build(), 0)
    with fake_world(0, 2), pytest.raises(RuntimeError, match="already has one"):
        dry_run(_module(SMALL), ParallelDims(world_size=2), ParallelOptions.build(), 0)
    assert not torch.distributed.is_initialized()  # every fake world is torn down, also after an error


def test_a_user_model_and_its_optimizer_kind_are_read_from_what_was_built():
    """A user's network with its own tp plan (:class:`tests.support.user_models.ResidualMLP`, the model contract), zero1
    over dp 4: SGD with momentum keeps one buffer per parameter chunk (4 bytes), AdamW two (8 bytes) and a 4-byte
    step counter per tensor."""
    from tests.support.user_models import make_mlp

    dims = ParallelDims(world_size=8, tp_size=2)
    sgd, adamw = (dry_run(lambda o=o: make_mlp(optimizer=o), dims, ParallelOptions.build(dp_mode="zero1"), 3)
                  for o in ("sgd", "adamw"))
    assert sgd.optimizers == ("SGD",) and adamw.optimizers == ("AdamW",)
    assert sgd.param_bytes == adamw.param_bytes > 0
    assert sgd.optimizer_state_bytes == pytest.approx(sgd.param_bytes / 4, rel=0.02)  # a quarter of the chunks
    assert adamw.optimizer_state_bytes == pytest.approx(2 * sgd.optimizer_state_bytes, rel=0.02)


# ----------------------------------------------------------------------------------------------- will it fit
def test_layout_distance_and_the_nearest_fitting_layout():
    from lightning_par.planner.fit import layout_distance, memory_terms, nearest_fitting

    a = Layout(dp_size=8, tp_size=1, pp_size=1)
    assert layout_distance(a, a) == 0
    assert layout_distance(a, Layout(dp_size=2, tp_size=4, pp_size=1)) == 2
    assert layout_distance(a, Layout(dp_size=8, tp_size=1, pp_size=1, dp_mode="zero3")) == 1
    big = GPTConfig(n_layer=16, n_head=32, n_embd=4096, block_size=1024, vocab_size=50304)
    layout = Layout(dp_size=8, tp_size=1, pp_size=1, micro_batch_size=2)
    near = nearest_fitting(big, layout, "a100-40gb", 8, "32-true")
    assert near is not None and near.fits and near.layout.world_size == 8
    assert near.layout.dp_size * near.layout.micro_batch_size * near.layout.num_microbatches == 16  # same batch
    from lightning_par.planner import predict

    terms = memory_terms(predict(big, layout, device="a100-40gb", precision="32-true"), "32-true")
    assert [t[0] for t in terms][:2] == ["optimizer state", "activations"]
    assert terms == sorted(terms, key=lambda t: -t[1])
