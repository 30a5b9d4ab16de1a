"""Parity of the pipeline strategy against one process on the same global batch.

Every schedule (gpipe, 1f1b, interleaved_1f1b) at pp 2 and pp 4, dp 2 x pp 2, gradient accumulation with norm
clipping, an ``nn.Sequential`` network, the measured-time split, validation, and checkpoint save + resume. Cases of the
same world size share one launch. Losses are compared with the one-process reference (no micro-batches) within
``rtol=1e-5`` and parameters (gathered from the stages) within ``assert_params_close``; also against a one-process
reference that sums the micro-batch gradients in the pipeline's order (``reference_fit_microbatched``).
"""

from __future__ import annotations

import pytest
import torch

from torch.distributed.checkpoint import FileSystemReader

from lightning_par.checkpoint import consolidate_checkpoint, load_model_weights
from lightning_par.launcher import run_distributed
from lightning_par.models import GPTConfig, GPTLightningModule
from lightning_par.strategies.pipeline import PipelineStrategy
from tests.support.helpers import TokenDataset, assert_params_close, global_losses, reference_fit
from tests.support.pipeline import (
    RegressionDataset,
    SequentialModule,
    checkpoint_worker,
    gathered_params,
    one_thread,
    reference_eval,
    reference_fit_microbatched,
    run_fit_cases,
    seeded,
)

pytestmark = pytest.mark.distributed

STEPS = 3


def gpt(n_layer: int):
    config = GPTConfig(n_layer=n_layer, n_head=2, n_embd=32, block_size=16, vocab_size=256, dropout=0.0)
    # adam_eps=1e-6 as in the project's other parity tests: see GPTLightningModule's docstring.
    return seeded(lambda: GPTLightningModule(config, learning_rate=3e-3, adam_eps=1e-6))


GPT4, GPT8 = gpt(4), gpt(8)
SEQUENTIAL = seeded(SequentialModule)


def strategy(**options):
    return lambda: PipelineStrategy(timeout_s=60, **options)


@pytest.fixture(autouse=True)
def _single_threaded_references():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def tokens() -> TokenDataset:
    return TokenDataset(n=128, seq=16)


@pytest.fixture(scope="module")
def regression() -> RegressionDataset:
    return RegressionDataset(n=64)


def check_parity(results, make_module, dataset, micro, steps, m, dp=1, accumulate=1, clip_norm=None):
    """Losses and parameters against the one-process reference on the same global batches, and against the one
    that also sums the micro-batch gradients in the pipeline's order (which agrees even more closely)."""
    plain_losses, plain_params = reference_fit(
        make_module, dataset, micro * dp, steps, accumulate=accumulate, clip_norm=clip_norm
    )
    mb_losses, mb_params = reference_fit_microbatched(make_module, dataset, micro, steps, m, dp, accumulate, clip_norm)
    losses = torch.tensor(global_losses(results))
    torch.testing.assert_close(losses, torch.tensor(plain_losses), rtol=1e-5, atol=0)
    torch.testing.assert_close(losses, torch.tensor(mb_losses), rtol=1e-5, atol=0)
    for r in results:
        assert_params_close(r["state"], plain_params)
        assert_params_close(r["state"], mb_params)
    return mb_params


# One launch of 2 ranks: (name, make_module, dataset fixture, micro-batch, m, strategy options, trainer kwargs).
WORLD2_CASES = [
    ("gpipe", GPT4, "tokens", 8, 4, dict(pp_size=2, schedule="gpipe", num_microbatches=4), {}),
    ("1f1b", GPT4, "tokens", 8, 4, dict(pp_size=2, schedule="1f1b", num_microbatches=4), {}),
    ("interleaved", GPT4, "tokens", 8, 4, dict(pp_size=2, schedule="interleaved_1f1b", num_microbatches=4), {}),
    (
        "accumulate+clip",
        GPT4,
        "tokens",
        4,
        2,
        dict(pp_size=2, schedule="1f1b", num_microbatches=2, split=[1, 3]),
        {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05},
    ),
    ("sequential", SEQUENTIAL, "regression", 8, 4, dict(pp_size=2, schedule="1f1b", num_microbatches=4), {}),
    (
        "split-by-time",
        SEQUENTIAL,
        "regression",
        8,
        2,
        dict(pp_size=2, schedule="gpipe", num_microbatches=2, split="time", split_timeout_s=0.02),
        {},
    ),
]

# One launch of 4 ranks.
WORLD4_CASES = [
    ("gpipe-pp4", GPT8, "tokens", 8, 8, dict(pp_size=4, schedule="gpipe", num_microbatches=8), {}),
    ("1f1b-pp4", GPT8, "tokens", 8, 8, dict(pp_size=4, schedule="1f1b", num_microbatches=8), {}),
    ("interleaved-pp4", GPT8, "tokens", 8, 4, dict(pp_size=4, schedule="interleaved_1f1b", num_microbatches=4), {}),
    (
        "dp2xpp2",
        GPT4,
        "tokens",
        4,
        2,
        dict(pp_size=2, dp_size=2, schedule="1f1b", num_microbatches=2, bucket_cap_mb=0.01),
        {},
    ),
    (
        "dp2xpp2-bucket-view",
        GPT4,
        "tokens",
        4,
        2,
        dict(
            pp_size=2, dp_size=2, schedule="gpipe", num_microbatches=2, gradient_as_bucket_view=True,
            measure_bubble=False,
        ),
        {},
    ),
    ("dp2xpp2-fp16", GPT4, "tokens", 4, 2, dict(pp_size=2, dp_size=2, num_microbatches=2, comm_hook="fp16"), {}),
    (
        "dp2xpp2-powersgd",
        GPT4,
        "tokens",
        4,
        2,
        dict(pp_size=2, dp_size=2, num_microbatches=2, comm_hook="powersgd", powersgd_rank=2, powersgd_start_iter=2),
        {},
    ),
]


def _run(world, cases, datasets):
    args = [
        (strategy(**options), make, datasets[data], micro, STEPS, kwargs, gathered_params)
        for _, make, data, micro, _, options, kwargs in cases
    ]
    return dict(zip([c[0] for c in cases], run_fit_cases(world, args)))


@pytest.fixture(scope="module")
def world2(tokens, regression):
    return _run(2, WORLD2_CASES, {"tokens": tokens, "regression": regression})


@pytest.fixture(scope="module")
def world4(tokens, regression):
    return _run(4, WORLD4_CASES, {"tokens": tokens, "regression": regression})


def _case(cases, name):
    return next(c for c in cases if c[0] == name)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "sequential"])
def test_parity_pp2(world2, tokens, regression, name):
    _, make, data, micro, m, _, _ = _case(WORLD2_CASES, name)
    check_parity(world2[name], make, {"tokens": tokens, "regression": regression}[data], micro, STEPS, m)


@pytest.mark.parametrize("name", ["gpipe-pp4", "1f1b-pp4", "interleaved-pp4"])
def test_parity_pp4(world4, tokens, name):
    _, make, _, micro, m, _, _ = _case(WORLD4_CASES, name)
    check_parity(world4[name], make, tokens, micro, STEPS, m)


def test_parity_dp2_pp2(world4, tokens):
    results = world4["dp2xpp2"]
    check_parity(results, GPT4, tokens, 4, STEPS, 2, dp=2)
    assert sorted({r["dp_rank"] for r in results}) == [0, 1]


def test_dp_axis_options(world4, tokens):
    """The dp-axis options of ddp_overlap: bucket views (and no bubble barrier) are exact; fp16 on the wire is within
    fp16's precision; PowerSGD is exact during its plain warm-up and keeps replicas identical after."""
    check_parity(world4["dp2xpp2-bucket-view"], GPT4, tokens, 4, STEPS, 2, dp=2)
    assert "pp_bubble" in world4["dp2xpp2-bucket-view"][0]["extras"]  # timings are kept, without the barrier
    plain_losses, _ = reference_fit(GPT4, tokens, 8, STEPS)
    fp16 = torch.tensor(global_losses(world4["dp2xpp2-fp16"]))
    torch.testing.assert_close(fp16, torch.tensor(plain_losses), rtol=1e-3, atol=0)
    powersgd = world4["dp2xpp2-powersgd"]
    # Iterations 0 and 1 reduce exactly, so the losses of steps 0-2 are exact; step 2's update is compressed.
    torch.testing.assert_close(torch.tensor(global_losses(powersgd)), torch.tensor(plain_losses), rtol=1e-5, atol=0)
    by_stage = {}
    for r in powersgd:  # ranks 0, 1 are stage 0 (dp 0, 1); ranks 2, 3 stage 1
        by_stage.setdefault(r["rank"] // 2, []).append(r["state"])
    _, exact = reference_fit(GPT4, tokens, 8, STEPS)
    for a, b in by_stage.values():
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert max((powersgd[0]["state"][n] - exact[n]).abs().max().item() for n in exact) > 1e-5


def test_accumulation_and_global_norm_clipping(world2, tokens):
    check_parity(world2["accumulate+clip"], GPT4, tokens, 4, STEPS, 2, accumulate=2, clip_norm=0.05)
    # The clip is active (a per-stage clip or none at all would not match the reference): without it, the result
    # differs from the clipped reference.
    _, clipped = reference_fit_microbatched(GPT4, tokens, 4, STEPS, 2, 1, 2, 0.05)
    _, unclipped = reference_fit_microbatched(GPT4, tokens, 4, STEPS, 2, 1, 2, None)
    assert max((clipped[n] - unclipped[n]).abs().max().item() for n in clipped) > 1e-3
    assert world2["accumulate+clip"][0]["extras"]["pp_layers_per_stage"] == [1, 3]


def test_split_by_time_agrees_on_every_rank_and_trains_exactly(world2, regression):
    results = world2["split-by-time"]
    counts = [r["extras"]["pp_layers_per_stage"] for r in results]
    assert counts[0] == counts[1] and sum(counts[0]) == 6
    check_parity(results, SEQUENTIAL, regression, 8, STEPS, 2)


@pytest.mark.parametrize("name,stages", [("gpipe", 2), ("1f1b", 2), ("gpipe-pp4", 4), ("1f1b-pp4", 4)])
def test_bubble_report_and_activation_peaks(world2, world4, name, stages):
    results = (world2 if name in world2 else world4)[name]
    extras = results[0]["extras"]
    m = extras["num_microbatches"]
    assert extras["pp_bubble_formula"] == pytest.approx((stages - 1) / (m + stages - 1))
    assert len(extras["pp_bubble_per_stage"]) == stages
    for busy, idle in zip(extras["pp_busy_s"], extras["pp_idle_s"]):
        assert busy > 0 and idle >= 0
        assert busy + idle == pytest.approx(extras["pp_step_window_s"])
    peaks = extras["pp_peak_microbatches_in_flight"]
    if name.startswith("1f1b"):
        assert peaks == [min(stages - s, m) for s in range(stages)]
    else:
        assert peaks == [m] * stages
    assert all(r["extras"]["pp_bubble_per_stage"] == extras["pp_bubble_per_stage"] for r in results)


def test_validation_and_checkpoint_resume(tokens, tmp_path):
    """Validation runs forward-only through the stages; a checkpoint holds the whole model under its usual names
    and the optimizer state by name, and resuming from it continues exactly."""
    micro, dataset = 8, TokenDataset(n=8 * STEPS, seq=16)  # one epoch = STEPS steps: the checkpoint ends an epoch
    path = str(tmp_path / "pp.ckpt")
    results = run_distributed(
        checkpoint_worker,
        2,
        (strategy(pp_size=2, schedule="1f1b", num_microbatches=4), GPT4, dataset, micro, STEPS, path),
        timeout_s=240,
    )
    plain_losses, _ = reference_fit(GPT4, dataset, micro, STEPS)
    mb_losses, mb_params = reference_fit_microbatched(GPT4, dataset, micro, 2 * STEPS, 4)
    _, params_first = reference_fit_microbatched(GPT4, dataset, micro, STEPS, 4)
    val = reference_eval(GPT4, params_first, dataset, micro, 1, 2)
    for r in results:
        assert r["val_loss"] == pytest.approx(val, rel=1e-5)
        torch.testing.assert_close(torch.tensor(r["first_losses"]), torch.tensor(plain_losses), rtol=1e-5, atol=0)
        resumed = torch.tensor(r["resumed_losses"])
        torch.testing.assert_close(resumed, torch.tensor(mb_losses[STEPS:]), rtol=1e-5, atol=0)
        assert_params_close(r["first_state"], params_first)
        assert_params_close(r["resumed_state"], mb_params)
    # The checkpoint is a sharded directory of the whole model under its usual names: one process loads it strictly,
    # directly and, consolidated into one file, through Lightning's own load_from_checkpoint.
    whole = GPT4()
    load_model_weights(path, whole, strict=True)
    assert_params_close(dict(whole.named_parameters()), params_first)
    single = consolidate_checkpoint(path, tmp_path / "pp-single.ckpt")
    loaded = GPTLightningModule.load_from_checkpoint(single)
    assert_params_close(dict(loaded.named_parameters()), params_first)
    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    names = {k[len("optimizer_0.state."):].rsplit(".", 1)[0] for k in saved if k.startswith("optimizer_0.state.")}
    assert names == set(params_first)
