"""The register's transformers part: the private names of ``transformers`` the package uses (its Hugging Face
support, :mod:`lightning_par.hf`), each behind a helper of ours. transformers is imported only when a helper runs.

Checked on transformers 5.24 and 5.25. Each entry of :data:`PRIVATE_USES` is looked up by the canary in
tests/compat/test_private_api.py, which fails naming the entry when upstream moves it.
"""

from __future__ import annotations

from typing import Any

from lightning_par.compat.register import PrivateName

__all__ = [
    "PRIVATE_USES",
    "attention_implementation",
    "chosen_attention_implementation",
    "experts_gate_function",
    "has_attention_function",
    "model_class_for_config",
    "pipeline_plan_of_class",
    "set_attention_implementation",
    "supports_sdpa",
    "tensor_plan_of_model",
]

_CHECKED = "transformers 5.24, 5.25"


def has_attention_function(name: str) -> bool:
    """Whether ``name`` is registered in transformers' ``AttentionInterface`` (its global mapping)."""
    from transformers import AttentionInterface

    return name in AttentionInterface._global_mapping


def attention_implementation(config: Any) -> Any:
    """The attention implementation a model's config selects now (``config._attn_implementation``)."""
    return config._attn_implementation


def set_attention_implementation(config: Any, name: Any) -> None:
    """Select attention implementation ``name`` on a live model's config (``config._attn_implementation``), as
    transformers' own ``set_attn_implementation`` does without its checks (restored by the caller)."""
    config._attn_implementation = name


def chosen_attention_implementation(config: Any) -> Any:
    """The attention implementation the user asked for in ``config``, ``None`` when left to transformers
    (``_attn_implementation_internal``)."""
    return getattr(config, "_attn_implementation_internal", None)


def model_class_for_config(config: Any) -> Any:
    """The causal-LM class ``AutoModelForCausalLM`` builds for ``config`` (``None``: none registered)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM._model_mapping.get(type(config), None)


def supports_sdpa(model_class: Any) -> Any:
    """Whether transformers runs this model class's attention through SDPA: its ``_supports_sdpa`` as declared
    (``True`` when unset)."""
    return getattr(model_class, "_supports_sdpa", True)


def pipeline_plan_of_class(model_class: Any) -> Any:
    """The head's pipeline plan a causal-LM class declares (``_pp_plan``), or ``None``."""
    return getattr(model_class, "_pp_plan", None)


def tensor_plan_of_model(network: Any) -> Any:
    """The tensor-parallel plan transformers gathered on a built model (``_tp_plan``), or ``None``."""
    return getattr(network, "_tp_plan", None)


def experts_gate_function(experts: Any) -> Any:
    """The gating function ``act(gate) * up`` of an experts module whose class defines one (``_apply_gate``, on the
    experts classes of some architectures, e.g. ``BeamExperts``), else ``None``."""
    apply = getattr(experts, "_apply_gate", None)
    return apply if callable(apply) else None


PRIVATE_USES: tuple[PrivateName, ...] = (
    PrivateName("transformers", "transformers.models.beam.modeling_beam.BeamExperts", "_apply_gate", "attribute",
                _CHECKED, "experts_gate_function"),
    PrivateName("transformers", "transformers.AttentionInterface", "_global_mapping", "attribute", _CHECKED,
                "has_attention_function"),
    PrivateName("transformers", "transformers.PretrainedConfig", "_attn_implementation", "attribute", _CHECKED,
                "attention_implementation, set_attention_implementation"),
    PrivateName("transformers", "transformers.PretrainedConfig", "_attn_implementation_internal", "instance",
                _CHECKED, "chosen_attention_implementation"),
    PrivateName("transformers", "transformers.AutoModelForCausalLM", "_model_mapping", "attribute", _CHECKED,
                "model_class_for_config"),
    PrivateName("transformers", "transformers.PreTrainedModel", "_supports_sdpa", "attribute", _CHECKED,
                "supports_sdpa"),
    PrivateName("transformers", "transformers.PreTrainedModel", "_pp_plan", "attribute", _CHECKED,
                "pipeline_plan_of_class"),
    PrivateName("transformers", "transformers.PreTrainedModel", "_tp_plan", "attribute", _CHECKED,
                "tensor_plan_of_model"),
)
