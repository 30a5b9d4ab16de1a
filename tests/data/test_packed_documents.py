"""A packed, document-masked block trains exactly as each of its documents alone in one process, under every axis.

Blocks of 16 tokens, each exactly filled by 1 to 5 documents (:func:`tests.support.docs.packed_blocks`); the reference
runs every document alone (one sequence, positions from 0, plain causal attention) and divides the summed token losses
by the global batch's tokens (:func:`tests.support.docs.reference_run`). Per layout: every step's loss (rel 1e-5) and
the summed parameter updates (SGD, so the gradients; rel 1e-5 over all parameters, and per parameter) against it.
Models: the reference GPT (4 heads), a tiny Hugging Face llama (4 query heads over 2 key/value heads), and a user's
model through the contract (:class:`tests.support.docs.PackedUserLM`: its step reads ``input_ids``/``position_ids``/
``labels`` and never sees ``document_ids``; the strategy masks its attention).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.docs import (
    MICRO,
    make_model,
    packed_blocks,
    padded_blocks,
    reference_run,
    run_cases,
    update_rel_error,
)

pytestmark = pytest.mark.distributed

STEPS = 2
LAYOUTS2 = {
    "cp2-ring": dict(cp_size=2, method="ring"),
    "cp2-all_to_all": dict(cp_size=2, method="all_to_all"),
    "pp2-1f1b": dict(pp_size=2, schedule="1f1b", num_microbatches=2),
    "tp2-sp": dict(tp_size=2, sequence_parallel=True),
    "tp2": dict(tp_size=2),
    "zero3-dp2": dict(dp_size=2, dp_mode="zero3"),
}
LAYOUTS4 = {"hsdp2x2-zero3": dict(dp_size=4, dp_replicate_size=2, dp_shard_size=2, dp_mode="zero3")}
LAYOUTS8 = {"dp2cp2tp2-zero3": dict(dp_size=2, cp_size=2, tp_size=2, sequence_parallel=True, dp_mode="zero3")}
#: what CI runs (the rest is marked slow): the GPT under every world-2 layout, the llama at cp2 (both methods) and
#: pp2, the user's model at cp2 ring and pp2
FAST = {("gpt", n) for n in LAYOUTS2} | {("llama", "cp2-ring"), ("llama", "cp2-all_to_all"), ("llama", "pp2-1f1b"),
                                         ("user", "cp2-ring"), ("user", "pp2-1f1b")} - {("gpt", "pp2-ac")}
MODELS = ("gpt", "llama", "user")
#: the user's plan has no sequence-parallel norms (refused before start under SP); the others run SP
SKIP = {("gpt", "tp2"), ("llama", "tp2"), ("user", "tp2-sp"), ("user", "dp2-ac"), ("user", "pp2-ac")}
CELLS = [(m, n) for m in MODELS for n in LAYOUTS2 if (m, n) not in SKIP]


def _cases(layouts: dict, models=MODELS, fast: bool | None = None) -> list[dict]:
    return [{"name": f"{m}-{name}", "model": m, "options": options, "steps": STEPS}
            for m in models for name, options in layouts.items()
            if (m, name) not in SKIP and (fast is None or ((m, name) in FAST) == fast)]


def _dp(options: dict) -> int:
    return options.get("dp_size", 1)


@pytest.fixture(scope="module")
def blocks():
    return packed_blocks(MICRO * 2 * STEPS)


@pytest.fixture(scope="module")
def world2_fast(blocks) -> dict:
    return run_cases(2, _cases(LAYOUTS2, fast=True), blocks)


@pytest.fixture(scope="module")
def world2_slow(blocks) -> dict:
    return run_cases(2, _cases(LAYOUTS2, fast=False), blocks)


@pytest.fixture(scope="module")
def blocks4():
    return packed_blocks(MICRO * 4 * STEPS, seed=2)


@pytest.fixture(scope="module")
def world4(blocks4) -> dict:
    return run_cases(4, _cases(LAYOUTS4, models=("gpt", "llama")), blocks4)


@pytest.fixture(scope="module")
def world8(blocks) -> dict:
    return run_cases(8, _cases(LAYOUTS8, models=("gpt", "llama")), blocks)


@pytest.fixture(scope="module")
def padded():
    return padded_blocks(MICRO * 2 * STEPS)


#: blocks with padding (labels -100): the blocks of a step, its micro-batches and its cp pieces count different tokens
PADDED = {n: LAYOUTS2[n] for n in ("cp2-ring", "cp2-all_to_all", "pp2-1f1b", "tp2-sp", "zero3-dp2")}


@pytest.fixture(scope="module")
def world2_padded(padded) -> dict:
    return run_cases(2, _cases(PADDED, models=("gpt",)), padded)


def _check(results: list[dict], model: str, options: dict, blocks) -> None:
    dp = _dp(options)
    ref_losses, ref_params = reference_run(model, blocks, MICRO * dp, STEPS)
    initial = {n: p.detach().clone() for n, p in make_model(model).named_parameters()}
    per_replica: dict[int, list[float]] = {}
    for r in results:
        per_replica.setdefault(r["dp_rank"], r["losses"])
    # each replica returns its own token mean (as under Lightning's DDPStrategy); the global batch's loss weighs them by
    # their counted tokens. Replica r's step k holds blocks r + dp (k MICRO + j) (DistributedSampler, no shuffle).
    counted = {r: [sum(int((blocks[r + dp * (k * MICRO + j)]["labels"] != -100).sum()) for j in range(MICRO))
                   for k in range(STEPS)] for r in per_replica}
    losses = [sum(per_replica[r][k] * counted[r][k] for r in per_replica) / sum(counted[r][k] for r in per_replica)
              for k in range(STEPS)]
    for got, want in zip(losses, ref_losses):
        assert math.isclose(got, want, rel_tol=1e-5), (losses, ref_losses)
    state = results[0]["state"]
    assert set(state) == set(ref_params), sorted(set(state) ^ set(ref_params))
    rel = update_rel_error(state, ref_params, initial)
    assert rel <= 1e-5, rel
    scale = max(float((ref_params[n] - initial[n]).abs().max()) for n in ref_params)
    for n in ref_params:  # and parameter by parameter (entries at 1e-5 of the largest update)
        torch.testing.assert_close(state[n].float() - initial[n], ref_params[n] - initial[n], rtol=1e-5,
                                   atol=1e-5 * scale, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("model,layout", [
    pytest.param(m, n, marks=() if (m, n) in FAST else pytest.mark.slow) for m, n in CELLS
])
def test_packed_documents_match_each_document_alone_world2(request, blocks, model, layout):
    results = request.getfixturevalue("world2_fast" if (model, layout) in FAST else "world2_slow")
    _check(results[f"{model}-{layout}"], model, LAYOUTS2[layout], blocks)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_packed_documents_match_each_document_alone_hsdp(world4, blocks4, model):
    _check(world4[f"{model}-hsdp2x2-zero3"], model, LAYOUTS4["hsdp2x2-zero3"], blocks4)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_packed_documents_match_each_document_alone_world8(world8, blocks, model):
    _check(world8[f"{model}-dp2cp2tp2-zero3"], model, LAYOUTS8["dp2cp2tp2-zero3"], blocks)


@pytest.mark.parametrize("layout", list(PADDED))
def test_padded_blocks_match_each_document_alone(world2_padded, padded, layout):
    """With padding the loss is the mean over the tokens that count: exact under cp (token-weighted over the cp
    ranks), pp (micro-batches weighed by their tokens), tp and dp (replicas weighed by their counted tokens)."""
    _check(world2_padded[f"gpt-{layout}"], "gpt", PADDED[layout], padded)
