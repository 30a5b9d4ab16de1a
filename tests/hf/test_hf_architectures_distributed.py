"""Hugging Face architectures whose own forward does more than a Llama's, against one process (issue 33).

Gemma's and Gemma3's scaled token embedding (``embed_scale``), Gemma2's eager attention with logit soft-capping and
final logit soft-capping, gpt-oss's attention sinks and MoE, Gemma3's hybrid sliding-window layers with a window (8)
shorter than the sequence (16), the fused or gathered projections of Phi-3 (fused qkv and gate_up), OLMo2 (q/k norms
over the whole hidden size) and GLM-4 (fused gate_up), and GPT-2's Conv1D layers (transposed weights, fused c_attn,
a reshape by the input's length after the last block), each under zero3, tp2, tp2 with sequence parallelism
and cp2 where the model's attention allows context parallelism (the others are refused before start:
``tests/hf/test_hf_architectures.py``). Tiny configs (hidden 64, 2 layers, 4 heads over 2 key/value heads, untied,
vocab 256), random weights, fp32. Parity: every step's global loss within ``rtol=1e-5`` of one process on the same
global batch, parameters within ``assert_params_close``; SGD with momentum and AdamW alternate over the cases. The
cases of one world size share one launch; the CI set covers each architecture once and each layout several times,
the rest is ``slow``.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from lightning_par.launcher import run_distributed
from lightning_par.parallel_dims import ParallelDims
from tests.support.helpers import LossRecorder, TokenDataset, assert_params_close, quiet_trainer, reference_fit
from tests.support.p3d import _loader, _strategy
from tests.support.pipeline import one_thread

pytest.importorskip("transformers")
pytestmark = pytest.mark.distributed

STEPS, GLOBAL_BATCH, SEQ = 2, 4, 16
BASE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256, "max_position_embeddings": 64,
        "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
#: model type -> config overrides (besides BASE).
ARCHS: dict[str, dict[str, Any]] = {
    "gemma": {},
    "gemma3_text": {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    "gemma3_text-wide": {"sliding_window": 64},  # the window never binds: cp allowed
    # vocab 257: padded to 258 at tp2; a final soft-cap of 2 brings a masked padded logit to -2, inside the real range
    "gemma2": {"sliding_window": 8, "vocab_size": 257, "final_logit_softcapping": 2.0},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 64,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "phi3": {},
    "olmo2": {},
    "glm4": {},
    "mistral": {"sliding_window": 8},
    "gpt2": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},  # Conv1D layers, fused c_attn
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    "deepseek_v3": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "q_lora_rank": 32, "kv_lora_rank": 16,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "head_dim": 8},
}
#: layout -> (strategy registry name, options).
LAYOUTS: dict[str, dict[str, Any]] = {
    "zero3": {"dp_mode": "zero3"},
    "tp2": {"tp_size": 2},
    "tp2sp": {"tp_size": 2, "sequence_parallel": True},
    "cp2": {"cp_size": 2},
}
#: (architecture, layout, optimizer) run in CI: every architecture, every layout several times.
CASES = [
    ("gemma", "tp2", "sgd"), ("gemma3_text", "tp2sp", "adamw"), ("gemma2", "tp2sp", "sgd"),
    ("gpt_oss", "zero3", "adamw"), ("phi3", "tp2sp", "sgd"), ("olmo2", "tp2sp", "sgd"), ("glm4", "tp2", "adamw"),
    ("mistral", "tp2sp", "adamw"), ("gemma3_text-wide", "cp2", "sgd"), ("gpt2", "tp2sp", "sgd"),
]
#: The rest of the matrix (``slow``).
SLOW_CASES = [
    ("gemma", "zero3", "adamw"), ("gemma", "tp2sp", "adamw"), ("gemma", "cp2", "sgd"),
    ("gemma3_text", "zero3", "sgd"), ("gemma3_text", "tp2", "sgd"), ("gemma3_text-wide", "tp2sp", "adamw"),
    ("gemma2", "zero3", "adamw"), ("gemma2", "tp2", "adamw"),
    ("gpt_oss", "tp2", "sgd"),
    ("phi3", "zero3", "adamw"), ("phi3", "tp2", "adamw"), ("phi3", "cp2", "adamw"),
    ("olmo2", "zero3", "sgd"), ("olmo2", "tp2", "adamw"), ("olmo2", "cp2", "sgd"),
    ("glm4", "zero3", "sgd"), ("glm4", "tp2sp", "sgd"), ("glm4", "cp2", "adamw"),
    ("mistral", "tp2", "sgd"),
    ("olmoe", "tp2", "adamw"), ("olmoe", "tp2sp", "sgd"), ("olmoe", "cp2", "sgd"),
    ("deepseek_v3", "tp2", "sgd"), ("deepseek_v3", "cp2", "adamw"),
    ("gpt2", "zero3", "adamw"), ("gpt2", "tp2", "adamw"), ("gpt2", "cp2", "sgd"),
]
#: AdamW's eps here: 1e-4, not the 1e-6 of ``assert_params_close``'s note. These models leave some weight gradients
#: near 1e-7 at initialisation (OLMo2's post-norm layers; the embedding rows Gemma scales by sqrt(hidden)), where
#: AdamW turns the fp32 rounding of a gradient (1e-9 to 1e-8) into a step difference of lr * rounding / eps. Measured at
#: tp2 (+SP): OLMo2's largest parameter difference 3.5e-5 at eps 1e-6, 5.5e-7 at 1e-4; Gemma3's 1.3e-4 and 7.2e-7; the
#: same cases with SGD 1e-8 and every loss within 9e-8. At 1e-4 a step is still about lr for every gradient entry above
#: 1e-4, so a missing or unaveraged reduction still moves parameters by about a step.
ADAM_EPS = 1e-4


def make_hf(arch: str, optimizer: str) -> Any:
    """The tiny model, seeded alike on every rank and in the reference."""
    from lightning_par.hf import HFCausalLM

    torch.manual_seed(0)
    lr = {"sgd": 0.05, "adamw": 3e-3}[optimizer]
    return HFCausalLM(model_type=arch.split("-")[0], config={**BASE, **ARCHS[arch]}, optimizer=optimizer,
                      learning_rate=lr, adam_eps=ADAM_EPS)


def _name(case: tuple[str, str, str]) -> str:
    return "-".join(case)


def _worker(cases: list[tuple[str, str, str]], data: TokenDataset) -> list[dict[str, Any]]:
    env = dict(os.environ)
    torch.set_num_threads(1)
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    out = []
    for arch, layout, optimizer in cases:
        os.environ.clear()
        os.environ.update(env)  # Lightning's teardown removes WORLD_SIZE and friends after each fit
        strategy = _strategy({"options": LAYOUTS[layout]})
        dims: ParallelDims = strategy.resolve_parallel_dims(world)
        recorder = LossRecorder()
        trainer = quiet_trainer(strategy, world, max_steps=STEPS, limit_val_batches=0, callbacks=[recorder])
        coords = dims.coordinates(rank)
        trainer.fit(make_hf(arch, optimizer), _loader(data, GLOBAL_BATCH // dims.dp_size, dims.dp_size, coords["dp"]))
        out.append({"losses": recorder.losses, "state": strategy.full_state_dict()})
    return out


def _run(cases: list[tuple[str, str, str]]) -> dict[str, list[dict[str, Any]]]:
    data = TokenDataset(n=GLOBAL_BATCH * STEPS, seq=SEQ)
    per_rank = run_distributed(_worker, 2, (cases, data), timeout_s=900)
    return {_name(case): [per_rank[r][i] for r in range(2)] for i, case in enumerate(cases)}


def _check(runs: list[dict[str, Any]], case: tuple[str, str, str]) -> None:
    """Every rank's losses (each the mean over the whole global batch: dp and cp average them) and parameters."""
    arch, _, optimizer = case
    with one_thread():
        ref_losses, ref_params = reference_fit(lambda: make_hf(arch, optimizer),
                                               TokenDataset(n=GLOBAL_BATCH * STEPS, seq=SEQ), GLOBAL_BATCH, STEPS)
    losses = [sum(step) / len(step) for step in zip(*(r["losses"] for r in runs))]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert_params_close(runs[0]["state"], ref_params)


@pytest.fixture(scope="module")
def world2() -> dict[str, list[dict[str, Any]]]:
    return _run(CASES)


@pytest.mark.parametrize("case", CASES, ids=_name)
def test_architecture_matches_one_process(world2, case):
    _check(world2[_name(case)], case)


@pytest.mark.slow
def test_the_rest_of_the_matrix_matches_one_process():
    results = _run(SLOW_CASES)
    failed = {}
    for case in SLOW_CASES:
        try:
            _check(results[_name(case)], case)
        except AssertionError as err:
            failed[_name(case)] = str(err)[:300]
    assert not failed, failed
