"""The generated Hugging Face matrix's own machinery: the tiny config read from each config's names, and verdicts that
can fail (a cell that trains and differs is FAIL, a ValueError after the first batch is not a refusal)."""

from __future__ import annotations

import pytest
import torch

from tests.support import hf_matrix as M

pytest.importorskip("transformers")


def test_the_rows_are_the_registry() -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert M.registry() == sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert len(M.registry()) > 100


def test_tiny_config_uses_each_config_class_names() -> None:
    from transformers import AutoConfig

    gpt2 = AutoConfig.for_model("gpt2", **M.tiny_config("gpt2"))  # n_embd, n_layer, n_head through attribute_map
    assert (gpt2.n_embd, gpt2.n_layer, gpt2.n_head, gpt2.n_inner, gpt2.vocab_size) == (64, 4, 4, 128, 256)
    assert gpt2.resid_pdrop == gpt2.embd_pdrop == gpt2.attn_pdrop == 0.0
    assert gpt2.bos_token_id == gpt2.eos_token_id == 255 and gpt2.tie_word_embeddings is False
    llama = AutoConfig.for_model("llama", **M.tiny_config("llama"))
    assert (llama.hidden_size, llama.num_attention_heads, llama.num_key_value_heads, llama.head_dim) == (64, 4, 2, 16)
    moe = AutoConfig.for_model("qwen3_moe", **M.tiny_config("qwen3_moe"))
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (4, 2, 64)
    mla = AutoConfig.for_model("deepseek_v3", **M.tiny_config("deepseek_v3"))  # head_dim is the rotary width
    assert (mla.kv_lora_rank, mla.qk_rope_head_dim, mla.head_dim, mla.qk_head_dim) == (16, 8, 8, 16)
    gemma3 = AutoConfig.for_model("gemma3_text", **M.tiny_config("gemma3_text"))
    assert len(gemma3.layer_types) == 4


def test_probe_records_why_an_architecture_cannot_be_built() -> None:
    with M.quiet():
        llama = M.probe("llama")
        unknown = M.probe("no_such_model_type")
    assert llama == {"claims": ["zero3", "tp2", "tp2sp", "pp2", "cp2"]}
    assert unknown["cannot"].startswith("config: ValueError")


def _runs(losses: list[float], state: dict[str, torch.Tensor]) -> list[dict]:
    return [{"losses": losses, "dp": 1, "state": state}, {"losses": None, "dp": 1, "state": state}]


def test_judge_fails_a_cell_that_trains_and_differs(monkeypatch) -> None:
    ref_losses, ref_params = [5.0, 4.0, 3.0, 2.0], {"w": torch.ones(4, 4)}
    monkeypatch.setattr(M, "reference", lambda *a: (ref_losses, ref_params))
    assert M.judge("llama", "pp2", _runs(ref_losses, {"w": torch.ones(4, 4)}))["status"] == "PASS"
    off_loss = M.judge("llama", "pp2", _runs([5.0, 4.0, 3.0001, 2.0], {"w": torch.ones(4, 4)}))
    assert off_loss["status"] == "FAIL" and "loss rel 3.3e-05" in off_loss["detail"]
    moved = torch.ones(4, 4)
    moved[1, 2] += 1e-3
    off_param = M.judge("llama", "pp2", _runs(ref_losses, {"w": moved}))
    assert off_param["status"] == "FAIL" and "params max abs diff 1.0e-03 (w)" in off_param["detail"]
    renamed = M.judge("llama", "pp2", _runs(ref_losses, {"v": torch.ones(4, 4)}))
    assert renamed["status"] == "FAIL" and "names differ" in renamed["detail"]


def test_judge_refusal_only_before_the_first_batch() -> None:
    error = {"error": "ValueError: tp_size=2 is not valid for X", "value_error": True, "started": False}
    ok = {"losses": [1.0], "dp": 1, "state": {}}
    assert M.judge("llama", "tp2", [error, error]) == {"status": "refused", "detail": error["error"]}
    late = {**error, "started": True}
    assert M.judge("llama", "tp2", [late, ok])["status"] == "FAIL"
    crash = {"error": "RuntimeError: shapes", "value_error": False, "started": False}
    assert M.judge("llama", "tp2", [crash, crash])["status"] == "FAIL"
