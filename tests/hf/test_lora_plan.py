"""The LoRA-aware tensor-parallel plan of a PEFT model, read through the wrapper (no process group)."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

from lightning_par import contract  # noqa: E402
from tests.support.lora import PeftLlama  # noqa: E402

P = "base_model.model.model.layers.0."


def test_plan_is_the_wrapped_models_with_lora_aware_styles():
    network = PeftLlama("sgd").model
    plan = contract.tp_plan(network, network, None)
    # colwise base layer: lora_A whole, lora_B split on its output
    assert plan[P + "self_attn.q_proj.base_layer"] == "colwise"
    assert plan[P + "self_attn.q_proj.lora_A.default"] == "replicate"
    assert plan[P + "self_attn.q_proj.lora_B.default"] == "colwise"
    assert P + "self_attn.q_proj" not in plan
    # rowwise base layer: lora_A split on its input, lora_B whole (per token)
    assert plan[P + "mlp.down_proj.base_layer"] == "rowwise"
    assert plan[P + "mlp.down_proj.lora_A.default"] == "rowwise"
    assert plan[P + "mlp.down_proj.lora_B.default"] == "sequence_parallel"
    # the rest of the model's own plan, prefixed
    assert plan[P + "self_attn.k_proj"] == "colwise"
    assert plan[P + "self_attn"] == "colwise_input"
    assert plan["base_model.model.lm_head"] in ("vocab_head", "vocab_head_full")
    from lightning_par.tensor_parallel.plan import validate_plan

    validate_plan(network, plan, 2, True)  # every parameter covered under sequence parallelism


def test_pipeline_layers_are_the_wrapped_models_prefixed():
    network = PeftLlama("sgd").model
    layers = contract.pipeline_layers(network)
    assert layers == ["base_model.model.model.layers.0", "base_model.model.model.layers.1"]
    stage = contract.pipeline_stage(network, layers[1:], first=False, last=True)
    names = {n for n, _ in stage.named_parameters()}
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.default.weight" in names
    assert not any(".layers.0." in n for n in names)
    assert names <= {n for n, _ in network.named_parameters()}


def test_dora_is_refused_under_tensor_parallelism():
    network = PeftLlama("sgd", lora={"use_dora": True}).model
    with pytest.raises(ValueError, match=r"DoRA \(use_dora=True, on 'model.layers.0.self_attn.q_proj'\).*tensor"):
        contract.tp_plan(network, network, None)


def test_another_peft_method_is_refused_under_tensor_parallelism():
    from peft import IA3Config, get_peft_model

    base = PeftLlama("sgd").model.get_base_model()
    network = get_peft_model(base, IA3Config(target_modules=["k_proj", "down_proj"],
                                             feedforward_modules=["down_proj"]))
    with pytest.raises(ValueError, match=r"PEFT method \['IA3'\].*tensor parallelism"):
        contract.tp_plan(network, network, None)


def test_bf16_frozen_base_changes_nothing_under_autocast():
    """``cast_frozen_base`` stores the copy autocast makes of each frozen linear weight at every call: under autocast
    to bf16, three steps give bitwise the same losses and adapters as the fp32 base, with the frozen linear bytes
    halved and the embeddings, norms and adapters kept fp32."""
    import torch

    from lightning_par.hf.lora import cast_frozen_base
    from tests.support.lora import GLOBAL_BATCH, SEQ, STEPS, TokenDataset, _plain_fit, make_module

    data = TokenDataset(n=GLOBAL_BATCH * STEPS, seq=SEQ)
    kept, cast = make_module("hflora-adamw"), make_module("hflora-adamw")
    layers = cast_frozen_base(cast.model, torch.bfloat16)
    assert any(n.endswith("q_proj.base_layer") for n in layers) and "lm_head" in {n.rsplit(".", 1)[-1] for n in layers}
    dtypes = {n: p.dtype for n, p in cast.named_parameters()}
    assert {dtypes[n] for n in dtypes if "lora_" in n or "norm" in n or "embed_tokens" in n} == {torch.float32}
    assert {dtypes[n] for n in dtypes if "base_layer" in n} == {torch.bfloat16}
    assert cast_frozen_base(cast.model, torch.bfloat16) == []  # already bf16: left as they are
    losses_kept, params_kept = _plain_fit(kept, data, autocast=True)
    losses_cast, params_cast = _plain_fit(cast, data, autocast=True)
    assert losses_cast == losses_kept
    for name, value in params_kept.items():
        if "lora_" in name:
            assert torch.equal(params_cast[name], value), name
