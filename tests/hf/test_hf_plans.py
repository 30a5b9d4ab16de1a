"""Hugging Face models' own tensor-parallel plans in our style names, their checks, activation checkpointing of their
decoder layers, and the ``model=hf`` recipe entry. No processes; tiny configs built here."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from hydra import compose, initialize_config_dir  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from lightning_par import activation_checkpointing, contract  # noqa: E402
from lightning_par.config.build import build_datamodule, build_module  # noqa: E402
from lightning_par.config.schema import register_configs  # noqa: E402
from lightning_par.hf import HFCausalLM  # noqa: E402
from lightning_par.hf.tensor_parallel import HF_STYLES, GlobalPositions, hf_raw_tp_plan  # noqa: E402
from lightning_par.tensor_parallel.plan import STYLE_NAMES, validate_plan  # noqa: E402
from lightning_par.tensor_parallel.styles import _FirstInput  # noqa: E402
from tests.support.compose import Composer  # noqa: E402

CONF = Path(__file__).resolve().parents[2] / "conf"
BASE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "tie_word_embeddings": False}
ARCHS = {
    "llama": {}, "qwen2": {}, "qwen3": {"head_dim": 8}, "mistral": {},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 8},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
}


def _model(arch: str = "llama", **overrides) -> nn.Module:
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **{**BASE, **ARCHS[arch], **overrides}))


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch_model(request):
    return request.param, _model(request.param)


# ------------------------------------------------------------------------------------------------ plan translation
def test_every_style_name_of_the_architectures_translates(arch_model):
    arch, model = arch_model
    raw = hf_raw_tp_plan(model)
    assert raw["lm_head"] == "colwise_gather_output" and raw["model.embed_tokens"] == "embedding_rowwise"
    assert set(raw.values()) <= set(HF_STYLES), set(raw.values()) - set(HF_STYLES)
    plan = contract.tp_plan(model, model, None)  # through the adapter: the model's tp_plan is a dict, not a method
    assert all(s in STYLE_NAMES for p, s in plan.items() if p), plan
    assert isinstance(plan[""], GlobalPositions)
    assert plan["lm_head"] == "vocab_head_full" and plan["model.embed_tokens"] == "vocab_embedding_full"
    # only the decoder layers run on sequence shards: the model's own code around them sees the whole sequence
    assert plan["model.layers.0"] == "sequence_scatter" and plan["model.layers.1"] == "sequence_gather"
    assert plan["model.norm"] == "replicate" and plan["model.layers.1.input_layernorm"] == "sequence_parallel"
    assert plan["model.layers.0.self_attn"] == "colwise_input"
    assert plan["model.layers.0.self_attn.q_proj"] == "colwise" and plan["model.layers.0.self_attn.o_proj"] == "rowwise"
    if arch.startswith("qwen3"):  # per-head norms on the local heads: replicated, gradients summed over tp
        norms = (plan["model.layers.0.self_attn.q_norm"], plan["model.layers.1.self_attn.k_norm"])
        assert norms == ("replicate_grad_sum", "replicate_grad_sum")
    if arch in ("qwen3_moe", "mixtral"):  # experts whole on every tp rank, the block a per-token module
        assert plan["model.layers.0.mlp"] == "sequence_parallel" and "model.layers.0.mlp.experts" not in plan
    else:
        assert plan["model.layers.0.mlp"] == "colwise_input" and plan["model.layers.0.mlp.down_proj"] == "rowwise"
    for sequence_parallel in (False, True):  # every parameter covered, HF's norm classes accepted
        validate_plan(model, plan, 2, sequence_parallel)


#: The experts entries transformers <= 5.24 kept in ``base_model_tp_plan`` (5.25 moved them to ``base_model_ep_plan``).
_TP_PLAN_EXPERTS_5_24 = {
    "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
    "layers.*.mlp.experts.down_proj": "rowwise",
    "layers.*.mlp.experts": "moe_tp_experts",
}


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_experts_are_read_from_either_plan_layout_into_one_translation(monkeypatch, arch):
    """transformers 5.25 lists the experts only in the expert-parallel plan (``ep_dispatch_experts`` and
    ``grouped_gemm``); up to 5.24 the tensor-parallel plan held them (``moe_tp_experts``). Both give the same plan."""
    model = _model(arch)
    ep_plan = model.ep_plan
    assert ep_plan["model.layers.*.mlp.experts"] == "ep_dispatch_experts", ep_plan
    own = contract.tp_plan(model, model, None)
    raw_now = hf_raw_tp_plan(model)
    assert raw_now["model.layers.*.mlp.experts"] == "moe_tp_experts"
    assert raw_now["model.layers.*.mlp.experts.gate_up_proj"] == "grouped_gemm"
    old_tp_plan = {**model.tp_plan, **{f"model.{k}": v for k, v in _TP_PLAN_EXPERTS_5_24.items()}}
    monkeypatch.setattr(type(model), "tp_plan", property(lambda self: old_tp_plan))
    raw_old = hf_raw_tp_plan(model)
    assert raw_old["model.layers.*.mlp.experts.gate_up_proj"] == "packed_colwise"  # the tp plan's own entry wins
    old = contract.tp_plan(model, model, None)
    assert {k: v for k, v in old.items() if k} == {k: v for k, v in own.items() if k}
    # without an ep plan either, the experts' weights are left uncovered and the plan check names them
    monkeypatch.setattr(type(model), "tp_plan", property(lambda self: {
        k: v for k, v in old_tp_plan.items() if ".experts" not in k}))
    monkeypatch.setattr(type(model), "ep_plan", property(lambda self: {}))
    bare = contract.tp_plan(model, model, None)
    with pytest.raises(ValueError, match=re.escape("mlp.experts.gate_up_proj")):
        validate_plan(model, bare, 2, True)


@pytest.mark.parametrize("hf_style", sorted(s for s, (ours, _) in HF_STYLES.items() if ours is None))
def test_untranslated_style_names_are_refused_naming_module_and_style(monkeypatch, hf_style):
    model = _model()
    monkeypatch.setattr(type(model), "tp_plan", property(lambda self: {"model.layers.*.mlp.up_proj": hf_style}))
    with pytest.raises(ValueError, match=re.escape(f"gives 'model.layers.0.mlp.up_proj' the Hugging Face style "
                                                   f"{hf_style!r}")):
        contract.tp_plan(model, model, None)


@pytest.mark.parametrize("entry, message", [
    ({"model.layers.*.mlp.up_proj": "fancy"}, "an unknown style"),
    ({"lm_head": "embedding_rowwise"}, "supported only on the model's input embeddings"),
    ({"model.layers.*.mlp.up_proj.weight": "rowwise"}, "a parameter, not a module, outside an experts module"),
])
def test_styles_used_where_they_do_not_apply_are_refused(monkeypatch, entry, message):
    model = _model()
    monkeypatch.setattr(type(model), "tp_plan", property(lambda self: entry))
    with pytest.raises(ValueError, match=re.escape(message)):
        contract.tp_plan(model, model, None)


def test_heads_kv_heads_and_tied_embeddings_are_checked_naming_the_config_field():
    model = _model()
    contract.check_tensor_parallel(model, 2, True)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM.config.num_key_value_heads=2 is not divisible by "
                                         r"tp_size=4: .* choose tp_size in \[1, 2\]"):
        contract.check_tensor_parallel(model, 4, False)
    with pytest.raises(ValueError, match=r"config.num_attention_heads=6 is not divisible by tp_size=4"):
        contract.check_tensor_parallel(_model(hidden_size=48, num_attention_heads=6, num_key_value_heads=6), 4, False)
    with pytest.raises(ValueError, match=r"config.tie_word_embeddings=True is not valid with tensor parallelism"):
        contract.check_tensor_parallel(_model(tie_word_embeddings=True), 2, False)


def test_global_positions_are_passed_only_when_the_caller_gives_none():
    from lightning_par.hf.tensor_parallel import _fill_positions

    ids = torch.zeros(2, 6, dtype=torch.long)
    args, kwargs = _fill_positions(None, (), {"input_ids": ids})
    assert torch.equal(kwargs["position_ids"], torch.arange(6).expand(2, 6))
    assert _fill_positions(None, (ids,), {"position_ids": torch.ones(1, 6)}) is None
    assert _fill_positions(None, (ids,), {"past_key_values": object()}) is None


def test_colwise_input_takes_the_first_input_by_keyword_and_names_the_module_without_it():
    hook = _FirstInput("hidden_states", None, None)
    with pytest.raises(ValueError, match="style 'colwise_input' on a LlamaAttention: it was called without its first "
                                         "input 'hidden_states'"):
        hook(_model().model.layers[0].self_attn, (), {"attention_mask": None})


# ------------------------------------------------------------------------------------------ activation checkpointing
def test_checkpoint_modules_of_decoder_layers_without_methods_on_hf_classes():
    model = _model("qwen3")
    assert contract.checkpoint_modules(model, "full") == ["model.layers.0", "model.layers.1"]
    assert contract.checkpoint_modules(model, "selective") == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    with pytest.raises(ValueError, match="activation_checkpointing='some' is not valid"):
        contract.checkpoint_modules(model, "some")
    assert not hasattr(type(model), "checkpoint_modules")


def test_activation_checkpointing_error_speaks_of_activation_checkpointing_only():
    options = SimpleNamespace(activation_checkpointing="full")
    with pytest.raises(ValueError, match="activation_checkpointing='full' is not valid") as info:
        activation_checkpointing._check(nn.Linear(2, 2), nn.Linear(2, 2), None, options)
    assert info.value.__cause__ is None and "pipeline" not in str(info.value).replace("pipeline_layers", "")


# ------------------------------------------------------------------------------------------------ model=hf entry
def _hydra_compose(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


#: ``hydra.compose`` with ``model=hf`` composed once for the module (tests/support/compose.py)
_COMPOSER = Composer(CONF)


def _compose(*overrides: str):
    register_configs()
    return _COMPOSER(list(overrides))


def test_model_hf_alone_builds_a_tiny_llama_matching_the_byte_data():
    cfg = _compose("model=hf", "data=synthetic")
    with torch.device("meta"):
        module = build_module(cfg)
    assert isinstance(module, HFCausalLM) and type(module.model).__name__ == "LlamaForCausalLM"
    assert module.hf_config.vocab_size == 256 and module.hf_config.hidden_size == 64
    assert build_datamodule(cfg, module).block_size == module.block_size == 64
    cfg = _compose("model=hf", "model.model_type=qwen3", "+model.config.hidden_size=32", "model.optimizer=sgd")
    with torch.device("meta"):
        module = build_module(cfg)
    assert type(module.model).__name__ == "Qwen3ForCausalLM" and module.hf_config.hidden_size == 32
    assert module.hf_config.num_hidden_layers == 2 and module.hparams.optimizer == "sgd"
    assert _compose("model=hf", "model.pretrained=/some/dir").model.model_type is None


@pytest.mark.parametrize("overrides, message", [
    (["model.model_type=gpt5"], "HFCausalLM model_type='gpt5' is not valid: expected a transformers model type"),
    (["model.model_type=null"], "HFCausalLM model_type=None is not valid: expected exactly one of model_type and "
                                "pretrained"),
    (["model.pretrained=/some/dir", "model.model_type=llama"], "HFCausalLM model_type='llama' is not valid: expected "
                                                               "exactly one of model_type and pretrained"),
    (["model.optimizer=lamb"], "HFCausalLM optimizer='lamb' is not valid"),
])
def test_bad_model_hf_values_are_named_before_any_process(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)), torch.device("meta"):
        build_module(_compose("model=hf", *overrides))


def test_model_hf_typo_fails_at_compose_time():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="model_typ"):
        _hydra_compose("model=hf", "model.model_typ=llama")
