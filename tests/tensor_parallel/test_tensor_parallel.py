"""Tensor parallelism on gloo ranks: layers against their one-process modules, and training parity.

Parity: K optimizer steps under ``TensorParallelStrategy`` against one process on the same global batch; losses
within ``rtol=1e-5`` and gathered (unpadded) parameters within ``assert_params_close``, at lr 3e-3 as the other
parity tests, but with ``adam_eps=1e-5`` instead of their 1e-6. Why: AdamW's first update ``lr * g / (|g| + eps)``
moves by up to ``lr * dg / eps`` when a gradient changes by ``dg``, and splitting the matrices changes the order of
the sums, so gradients differ by ~1e-6 of their scale (6e-8 absolute here). At eps=1e-6 one entry whose gradient
happened to be ~eps (``wte[58, 19]`` at tp 4, gradient 1.6e-6) ended 1.8e-5 away after 3 steps; at eps=1e-5 every
case stays below 1.6e-6, while one step still moves the parameters by ~lr = 3e-3, so a missing or doubled
collective fails by orders of magnitude. (The GPT's ``k_proj.bias`` is the extreme case: its true gradient is exactly
zero, a constant added to every key shifts all of a query's scores equally, so its gradient is pure rounding noise.)
The layer checks compare outputs and gradients directly, before any optimizer.
"""

from __future__ import annotations

import pytest
import torch

from lightning_par.launcher import run_distributed
from lightning_par.models import GPTConfig, GPTLightningModule
from lightning_par.strategies.tensor_parallel import TensorParallelStrategy
from tests.support.helpers import TIMEOUT_S, TokenDataset, assert_params_close, global_losses, reference_fit, run_fit
from tests.support.tensor_parallel import ToyLM, layer_checks_worker, unpadded_state

pytestmark = pytest.mark.distributed

STEPS, MICRO, LR, ADAM_EPS = 3, 4, 3e-3, 1e-5
BASE = dict(n_layer=2, n_head=4, n_embd=32, block_size=16, dropout=0.0)


def gpt_module(vocab: int):
    def make() -> GPTLightningModule:
        torch.manual_seed(0)
        return GPTLightningModule(GPTConfig(**BASE, vocab_size=vocab), learning_rate=LR, adam_eps=ADAM_EPS)

    return make


def tp_strategy(**kw):
    return lambda: TensorParallelStrategy(timeout_s=60, **kw)


# ------------------------------------------------------------------------------------------------ layers
@pytest.fixture(scope="module")
def layer_results() -> dict:
    results = run_distributed(layer_checks_worker, 4, timeout_s=TIMEOUT_S)
    return results[0]


LAYER_CASES = [f"{s}-tp{t}-sp{sp}" for s in ("colwise", "rowwise") for t in (2, 4) for sp in (0, 1)]


@pytest.mark.parametrize("case", LAYER_CASES)
def test_linear_layers_match_nn_linear(layer_results, case):
    """Column- and row-parallel layers: output, input gradient, weight and bias gradients equal nn.Linear's."""
    r = layer_results[case]
    assert set(r) == {"out", "input_grad", "weight_grad", "bias_grad"}
    for metric, err in r.items():
        assert err < 1e-6, (case, metric, err)


@pytest.mark.parametrize("case", [f"embedding-v{v}-tp{t}-sp{sp}" for v in (12, 10) for t in (2, 4) for sp in (0, 1)])
def test_vocab_embedding_matches_nn_embedding(layer_results, case):
    r = layer_results[case]
    assert r["out"] < 1e-6 and r["weight_grad"] < 1e-6, r
    assert r["padding_grad"] == 0.0
    assert r["grad_is_shard"] == 0.0  # each rank holds only its (padded_vocab / tp, d) gradient shard
    expected_pad = {"v12-tp2": 0, "v12-tp4": 0, "v10-tp2": 0, "v10-tp4": 2}["-".join(case.split("-")[1:3])]
    assert r["padded_rows"] == expected_pad


@pytest.mark.parametrize("case", [f"head_loss-v{v}-tp{t}-sp{sp}" for v in (12, 10) for t in (2, 4) for sp in (0, 1)])
def test_vocab_parallel_loss_matches_cross_entropy(layer_results, case):
    """Loss, logits and gradients equal F.cross_entropy on the full logits, padded vocabulary included."""
    r = layer_results[case]
    assert r["loss"] < 1e-6, r
    assert r["logits"] < 1e-6 and r["input_grad"] < 1e-6 and r["weight_grad"] < 1e-6, r
    assert r["padding_grad"] == 0.0
    assert r["padded_logits_are_min"] == 1.0
    expected_pad = {"v12-tp2": 0, "v12-tp4": 0, "v10-tp2": 0, "v10-tp4": 2}["-".join(case.split("-")[1:3])]
    assert r["padded_rows"] == expected_pad


@pytest.mark.parametrize("case", [f"comm-tp{t}-sp{sp}" for t in (2, 4) for sp in (0, 1)])
def test_bytes_per_layer_match_megatron(layer_results, case):
    """Per layer per step, the tp collectives send 8*b*s*h*(t-1)/t elements per rank (Narayanan et al. 2021, §3.2),
    plus, with sequence parallelism, the all-reduce of the LayerNorm gradients (4 * n_embd elements)."""
    r = layer_results[case]
    assert r["measured"] == pytest.approx(r["theory"], rel=1e-9), r


@pytest.mark.parametrize("t", [2, 4])
def test_padded_checkpoint_state_round_trips(layer_results, t):
    r = layer_results[f"state_dict-tp{t}"]
    assert r["keys_match"] == 1.0 and r["unpadded"] == 1.0
    assert r["model"] == 0.0 and r["optimizer"] == 0.0, r


# ------------------------------------------------------------------------------------------------ parity
PARITY = [
    # (id, world, strategy options, vocab, accumulate)
    ("tp2", 2, dict(tp_size=2), 256, 1),
    ("tp4", 4, dict(tp_size=4), 255, 1),
    ("tp2-sp", 2, dict(tp_size=2, sequence_parallel=True), 255, 1),
    ("tp4-sp", 4, dict(tp_size=4, sequence_parallel=True), 256, 1),
    ("dp2xtp2", 4, dict(tp_size=2, dp_size=2, bucket_cap_mb=0.02), 255, 1),
    ("dp2xtp2-sp-accumulate", 4, dict(tp_size=2, dp_size=2, sequence_parallel=True, bucket_cap_mb=0.02), 255, 2),
]


@pytest.mark.parametrize("case", PARITY, ids=[c[0] for c in PARITY])
def test_gpt_parity_with_one_process(case):
    _, world, options, vocab, accumulate = case
    dp = options.get("dp_size", 1)
    dataset = TokenDataset(n=64, seq=BASE["block_size"], vocab=vocab)
    ref_losses, ref_params = reference_fit(gpt_module(vocab), dataset, MICRO * dp, STEPS, accumulate=accumulate)
    trainer_kwargs = {"accumulate_grad_batches": accumulate} if accumulate > 1 else None
    results = run_fit(world, tp_strategy(**options), gpt_module(vocab), dataset, MICRO, STEPS, trainer_kwargs,
                      unpadded_state)
    torch.testing.assert_close(torch.tensor(global_losses(results)), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for r in results:
        assert_params_close(r["state"], ref_params)
    extras = results[0]["extras"]
    assert extras["tp_size"] == options["tp_size"] and extras["dp_size"] == dp
    assert ("vocab_padding" in extras) == (vocab % options["tp_size"] != 0)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_user_model_with_its_own_plan(sequence_parallel):
    """A model that is not our GPT trains at parity with the plan it passes (its vocabulary 37 is padded to 38)."""
    dataset = TokenDataset(n=64, seq=8, vocab=37)

    def make():
        torch.manual_seed(0)
        return ToyLM()

    ref_losses, ref_params = reference_fit(make, dataset, MICRO, STEPS)
    strategy = tp_strategy(tp_size=2, plan=ToyLM.PLAN, sequence_parallel=sequence_parallel)
    results = run_fit(2, strategy, make, dataset, MICRO, STEPS, None, unpadded_state)
    torch.testing.assert_close(torch.tensor(global_losses(results)), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for r in results:
        assert_params_close(r["state"], ref_params)
    assert results[0]["extras"]["vocab_padding"] == {"embed": "37 -> 38", "head": "37 -> 38"}
