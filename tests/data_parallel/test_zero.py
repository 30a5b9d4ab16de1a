"""ZeRO stages 1-3: parity with one process on the same global batch, and per-rank bytes against the paper's formula.

Two process-group launches (dp 2 and dp 4) run every case one after another; the tests then check the results.
"""

from __future__ import annotations

import pytest
import torch

from lightning_par.data_parallel.zero_memory import paper_state_bytes
from tests.support.helpers import assert_params_close, global_losses, reference_fit
from tests.support.zero import make_gpt, make_mlp, make_mlp_adamw, run_cases, token_dataset

pytestmark = pytest.mark.distributed

MICRO, STEPS = 4, 4
SMALL_BUCKETS = {"bucket_cap_mb": 0.02}  # several buckets for stages 1 and 2, so overlap and ordering are exercised


def _options(stage: int) -> dict:
    return dict(SMALL_BUCKETS) if stage in (0, 1, 2) else {}


CASES_DP2 = (
    [{"name": f"gpt-z{s}", "stage": s, "options": _options(s), "steps": STEPS, "micro_batch": MICRO}
     for s in (0, 1, 2, 3)]
    + [
        {"name": f"gpt-z{s}-acc-clip", "stage": s, "options": _options(s), "steps": 2, "micro_batch": MICRO,
         "accumulate": 2, "clip": 0.5}
        for s in (1, 2, 3)
    ]
    + [{"name": f"mlp-z{s}", "stage": s, "options": _options(s), "steps": STEPS, "micro_batch": MICRO, "module": "mlp"}
       for s in (1, 2, 3)]
    + [{"name": f"mlp-adamw-z{s}", "stage": s, "options": _options(s), "steps": STEPS, "micro_batch": MICRO,
        "module": "mlp-adamw"} for s in (1, 2)]
    + [{"name": f"mlp-z{s}-clip", "stage": s, "options": _options(s), "steps": STEPS, "micro_batch": MICRO,
        "module": "mlp", "clip": 0.05} for s in (1, 2)]
    + [
        {"name": "gpt-z1-options", "stage": 1, "steps": STEPS, "micro_batch": MICRO,
         "options": {"bucket_cap_mb": 0.05, "gradient_as_bucket_view": False, "static_graph": True}},
        {"name": "gpt-z3-keep-gathered", "stage": 3, "steps": STEPS, "micro_batch": MICRO,
         "options": {"reshard_after_forward": False}},
    ]
    + [{"name": f"gpt-z{s}-bf16", "stage": s, "options": {**_options(s), "mixed_precision": "bf16"}, "steps": STEPS,
        "micro_batch": MICRO} for s in (1, 2, 3)]
)
CASES_DP4 = [
    {"name": f"gpt-z{s}", "stage": s, "options": _options(s), "steps": STEPS, "micro_batch": 2} for s in (0, 1, 2, 3)
] + [{"name": "mlp-z2", "stage": 2, "options": _options(2), "steps": STEPS, "micro_batch": 2, "module": "mlp"},
     {"name": "mlp-z3", "stage": 3, "steps": STEPS, "micro_batch": 2, "module": "mlp"},
     {"name": "mlp-z1-clip", "stage": 1, "options": _options(1), "steps": STEPS, "micro_batch": 2, "module": "mlp",
      "clip": 0.05}]


@pytest.fixture(scope="module")
def dataset():
    return token_dataset(128)


@pytest.fixture(scope="module")
def dp2(dataset):
    return run_cases(2, CASES_DP2, dataset)


@pytest.fixture(scope="module")
def dp4(dataset):
    return run_cases(4, CASES_DP4, dataset)


def _assert_parity(results: list[dict], ref: tuple[list[float], dict], rtol: float = 1e-5) -> None:
    ref_losses, ref_params = ref
    torch.testing.assert_close(torch.tensor(global_losses(results)), torch.tensor(ref_losses), rtol=rtol, atol=0)
    for r in results:
        assert_params_close(r["state"], ref_params)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parity_dp2(dp2, dataset, stage):
    _assert_parity(dp2[f"gpt-z{stage}"], reference_fit(make_gpt, dataset, MICRO * 2, STEPS))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parity_dp4(dp4, dataset, stage):
    _assert_parity(dp4[f"gpt-z{stage}"], reference_fit(make_gpt, dataset, 2 * 4, STEPS))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parity_with_accumulation_and_global_norm_clipping(dp2, dataset, stage):
    ref = reference_fit(make_gpt, dataset, MICRO * 2, 2, accumulate=2, clip_norm=0.5)
    _, unclipped = reference_fit(make_gpt, dataset, MICRO * 2, 2, accumulate=2)
    # The clip is active, so a norm computed over one rank's shard only (a different factor per rank) would fail.
    assert any((unclipped[n] - ref[1][n]).abs().max() > 1e-4 for n in unclipped)
    _assert_parity(dp2[f"gpt-z{stage}-acc-clip"], ref)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_any_lightning_module(dp2, dataset, stage):
    """Not the GPT: SGD with momentum returned in a list, uneven chunks, parameters on the LightningModule itself."""
    _assert_parity(dp2[f"mlp-z{stage}"], reference_fit(make_mlp, dataset, MICRO * 2, STEPS))


@pytest.mark.parametrize("stage", [2, 3])
def test_any_lightning_module_dp4_with_empty_shards(dp4, dataset, stage):
    _assert_parity(dp4[f"mlp-z{stage}"], reference_fit(make_mlp, dataset, 2 * 4, STEPS))


@pytest.mark.parametrize("stage", [1, 2])
def test_any_lightning_module_with_adamw(dp2, dataset, stage):
    """The optimizer steps plain local shards: AdamW's decoupled weight decay and moments match one process too."""
    _assert_parity(dp2[f"mlp-adamw-z{stage}"], reference_fit(make_mlp_adamw, dataset, MICRO * 2, STEPS))


@pytest.mark.parametrize(("stage", "dp"), [(1, 2), (2, 2), (1, 4)])
def test_sgd_clipping_by_the_whole_model_norm(dp2, dp4, dataset, stage, dp):
    """SGD with momentum feels the clip coefficient directly: a norm of one rank's shards (torch's clip_grad_norm_ on
    the optimizer's local shards) would clip each rank differently and fail; at dp 4 some shards are empty."""
    ref = reference_fit(make_mlp, dataset, (MICRO if dp == 2 else 2) * dp, STEPS, clip_norm=0.05)
    _, unclipped = reference_fit(make_mlp, dataset, (MICRO if dp == 2 else 2) * dp, STEPS)
    assert any((unclipped[n] - ref[1][n]).abs().max() > 1e-3 for n in unclipped)  # the clip is active
    _assert_parity((dp2 if dp == 2 else dp4)[f"mlp-z{stage}-clip"], ref)


@pytest.mark.parametrize("name", ["gpt-z1-options", "gpt-z3-keep-gathered"])
def test_option_parity(dp2, dataset, name):
    _assert_parity(dp2[name], reference_fit(make_gpt, dataset, MICRO * 2, STEPS))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_mixed_precision(dp2, dataset, stage):
    """bf16 parameters and reductions, fp32 master shards: within bf16's precision of the fp32 run (8 significant
    bits; the loss is an average, so it is much closer than one bf16 ulp)."""
    results = dp2[f"gpt-z{stage}-bf16"]
    ref_losses, ref_params = reference_fit(make_gpt, dataset, MICRO * 2, STEPS)
    torch.testing.assert_close(torch.tensor(global_losses(results)), torch.tensor(ref_losses), rtol=5e-3, atol=0)
    for r in results:
        assert all(t.dtype == torch.float32 for t in r["state"].values())  # the gathered fp32 masters
        for name, ref in ref_params.items():
            torch.testing.assert_close(r["state"][name], ref, rtol=0, atol=2e-2)
    # Stages 1 and 2 compute with bf16 copies of the parameters; FSDP2 keeps fp32 shards and casts when gathering.
    expected = ["torch.bfloat16"] if stage < 3 else ["torch.float32"]
    assert results[0]["param_dtypes"] == expected
    torch.testing.assert_close(results[0]["state"], results[1]["state"], rtol=0, atol=0)


def _expected_bytes(stage: int, numel: int, dp: int) -> dict[str, float]:
    """Paper §5 split: parameters, gradients, Adam state (fp32)."""
    params = 4 * numel / (dp if stage == 3 else 1)
    grads = 4 * numel / (dp if stage >= 2 else 1)
    state = 8 * numel / (dp if stage >= 1 else 1)
    return {"param_bytes": params, "grad_bytes": grads, "optimizer_state_bytes": state}


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bytes_per_rank_match_the_formula(dp2, dp4, stage, dp):
    """Counted from the local shards (storages): exactly the paper's figures, plus Adam's 4-byte step counter per
    tensor (the GPT's dims divide by 2 and 4, so there is no padding)."""
    results = (dp2 if dp == 2 else dp4)[f"gpt-z{stage}"]
    for r in results:
        numel, steps = r["numel"], 4 * r["num_tensors"]
        expected = _expected_bytes(stage, numel, dp)
        expected["optimizer_state_bytes"] += steps
        assert r["bytes"] == pytest.approx(expected, abs=0), (stage, dp, r["bytes"], expected)
        total = sum(r["bytes"].values())
        assert total == paper_state_bytes(stage, numel, dp) + steps
        assert total / paper_state_bytes(stage, numel, dp) <= 1.02
        # The metrics callback (lightning_par.memory.model_state_bytes) counts the same bytes.
        cb = r["callback_bytes"]
        assert cb["param_bytes"] == r["bytes"]["param_bytes"]
        assert cb["optimizer_state_bytes"] == r["bytes"]["optimizer_state_bytes"]
        assert cb["grad_bytes"] == r["bytes"]["grad_bytes"]


def test_step_peak_memory_is_measured_for_every_stage(dp2):
    """The metrics callback's peak of a step (tensor storages counted as they are created and freed) holds the
    model state and more (activations); sharding gradients (stage 2) and parameters (stage 3) lowers it below
    stage 1's, whose full gradients (the reducer's buckets) stay alive."""
    peaks = {}
    for stage in (0, 1, 2, 3):
        for r in dp2[f"gpt-z{stage}"]:
            m = r["step_memory"]
            assert m["step_model_state_bytes"] == sum(r["bytes"].values())  # what the storage probe counted
            assert m["step_peak_bytes"] > m["step_model_state_bytes"]
        peaks[stage] = max(r["step_memory"]["step_peak_bytes"] for r in dp2[f"gpt-z{stage}"])
    assert peaks[2] < peaks[1] < peaks[0]
    assert peaks[3] < peaks[1]


def test_stage2_frees_full_gradients_and_stage3_shards_parameters(dp2):
    numel = dp2["gpt-z2"][0]["numel"]
    assert dp2["gpt-z2"][0]["bytes"]["grad_bytes"] == 4 * numel // 2
    assert dp2["gpt-z3"][0]["bytes"]["param_bytes"] == 4 * numel // 2


@pytest.mark.parametrize("dp", [2, 4])
def test_communication_volume(dp2, dp4, dp):
    """Bytes sent per rank in one step, counted at the collectives, against the ring volumes of each design."""
    res = dp2 if dp == 2 else dp4
    numel = res["gpt-z0"][0]["numel"]
    ring = 4 * numel * (dp - 1) / dp
    sent = {s: res[f"gpt-z{s}"][0]["comm_bytes"] for s in (0, 1, 2, 3)}
    assert sent[0] == pytest.approx(2 * ring, rel=1e-3)  # all-reduce
    assert sent[1] == pytest.approx(3 * ring, rel=1e-3)  # all-reduce + all-gather
    assert sent[2] == pytest.approx(2 * ring, rel=1e-3)  # reduce-scatter + all-gather
    # all-gather forward + backward + reduce-scatter, minus the root unit's backward gather (FSDP2 keeps it).
    root = 256 * 32 * 2 + 16 * 32 + 2 * 32  # wte, lm_head, wpe, ln_f
    assert sent[3] == pytest.approx(ring * (3 * numel - root) / numel, rel=1e-3)
    if dp == 2:  # reshard_after_forward=False: one all-gather per step, FSDP2's "ZeRO-2-like" mode
        assert res["gpt-z3-keep-gathered"][0]["comm_bytes"] == pytest.approx(2 * ring, rel=1e-3)


def test_composes_with_tensor_parallel():
    """Every stage on the dp sub-mesh of a dp 2 x tp 2 mesh whose model holds DTensor (TP) and plain parameters: the
    same functions the 3-D strategy calls, against one process."""
    from lightning_par.launcher import run_distributed
    from tests.support.zero import tensor_parallel_worker, two_layer_reference

    expected = two_layer_reference(3, clip=0.1)
    for rank_result in run_distributed(tensor_parallel_worker, 4, (3, 0.1), timeout_s=120):
        for stage, params in rank_result.items():
            assert_params_close(params, expected, rtol=1e-5, atol=1e-6)


def test_stage2_gradient_memory_stays_within_two_buckets():
    """ZeRO-2's gradient memory during backward, measured storage by storage (the shard, the bucket buffers and the
    gradient autograd has just produced, each counted until it is freed): at most the shard plus
    ``max_buckets_in_flight + 1`` buckets plus one parameter's gradient, far below the full gradients (4 Psi)."""
    from lightning_par.launcher import run_distributed
    from tests.support.zero import grad_memory_worker

    for r in run_distributed(grad_memory_worker, 2, timeout_s=120):
        assert r["num_buckets"] >= 6
        for in_flight, peak in r["peaks"].items():
            buckets = sorted(r["bucket_bytes"], reverse=True)[: in_flight + 1]
            bound = r["shard_bytes"] + sum(buckets) + r["largest_grad_bytes"]
            assert r["shard_bytes"] < peak <= bound, (in_flight, peak, bound)
            assert peak < 0.75 * r["full_grad_bytes"]
        assert r["peaks"][0] < r["peaks"][1]


def test_parameter_gather_overlapped_with_the_next_forward():
    """``overlap_param_gather``: the all-gathers are still in flight when the next step begins and each bucket is
    waited for by the first module that uses it; the parameters match the synchronous gather exactly, and one
    process."""
    from lightning_par.launcher import run_distributed
    from tests.support.zero import overlap_gather_worker

    dataset = token_dataset(4 * 2 * 3)
    _, expected = reference_fit(make_mlp, dataset, 8, 3)
    for r in run_distributed(overlap_gather_worker, 2, (3,), timeout_s=120):
        for stage in (1, 2):
            sync, deferred = r[f"z{stage}-overlap0"], r[f"z{stage}-overlap1"]
            assert sync["pending"] == [False, False, False]
            assert deferred["pending"] == [False, True, True]
            torch.testing.assert_close(deferred["state"], sync["state"], rtol=0, atol=0)
            assert_params_close(deferred["state"], expected)
