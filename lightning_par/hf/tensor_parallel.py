"""Tensor parallelism and activation checkpointing of any ``transformers.PreTrainedModel``, from its own plan.

A Hugging Face model carries its tensor-parallel plan: ``network.tp_plan`` (a dict property in transformers 5.x: the
head's ``_tp_plan``, e.g. ``{"lm_head": "colwise_gather_output"}``, plus ``config.base_model_tp_plan`` under the base
model's prefix ``model.``). :func:`hf_tp_plan` translates its style names into ours
(:mod:`lightning_par.tensor_parallel.plan`) and adds what transformers leaves to its own per-layer styles:

* a ``colwise_input`` on the module holding each group of column-parallel layers (``self_attn``, ``mlp``): one
  collective per sub-block (Megatron's ``f``/``g``) instead of one per layer;
* ``sequence_parallel`` on the norms of the residual stream (any module class named ``...Norm``, outside the split
  attention/MLP regions): transformers' own norm classes (``LlamaRMSNorm``...) are per-token modules;
* a hook on the network that passes ``position_ids`` (``0..seq-1``) when the caller gives none, so that under sequence
  parallelism the rotary embedding is computed for the whole sequence, not from the length of a sequence shard;
* the token embedding as ``vocab_embedding_full`` (its output the whole sequence) and a ``sequence_scatter`` on the
  first decoder layer: the model's own code between the two (its attention masks, built from the embeddings' length:
  causal, sliding-window, per layer type; its scalings) sees the whole sequence under sequence parallelism, as in one
  process, and only the decoder layers run on sequence shards;
* Hugging Face's gathered styles (``colwise_gather_output`` inside a layer, ``rowwise_split_input``) as
  ``colwise_gather``/``rowwise_split``: fused projections (Phi-3's ``qkv_proj``, GLM-4's ``gate_up_proj``) and norms
  over the whole hidden size (OLMo2's ``q_norm``/``k_norm``, planned ``replicate``) then run on replicated
  activations, which is right whatever the packing of the fused weight.

* ``replicate_grad_sum`` on every module holding parameters that the plan leaves out inside a split attention or MLP
  (Apertus' xIELU activation with its learned scalars, a per-head norm such as Sarvam's ``q_norm``): it runs on this
  rank's part of the heads or features, so its parameters' gradients are partial sums over the tp ranks. That the
  region's own forward is right on a part is checked before any split, in one process
  (:func:`check_hf_tensor_parallel`, :mod:`lightning_par.tensor_parallel.regions`): Doge's attention, which builds a
  mask for every key/value head, is refused naming the module;
* a mixture-of-experts block (``moe_tp_experts``: experts whole on every tp rank, the block a per-token module) keeps
  its shared experts whole too: the plan's column/row entries inside it are dropped. Under sequence parallelism the
  block runs on this rank's tokens (often flattened to ``(tokens, hidden)``), which split shared experts would gather
  as if they were the sequence.

An ``nn.Embedding`` subclass (Gemma's scaled embedding) keeps its own ``forward`` around the vocab-parallel lookup
(:class:`~lightning_par.tensor_parallel.styles.VocabParallelEmbedding`).

:data:`HF_STYLES` is the translation table; a style name not in it, or one used where it does not apply, is refused
with a message naming the module and the Hugging Face style.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_par.compat.transformers import tensor_plan_of_model
from lightning_par.tensor_parallel.plan import STYLE_NAMES

__all__ = [
    "HF_STYLES",
    "GlobalPositions",
    "hf_checkpoint_modules",
    "hf_raw_tp_plan",
    "hf_tp_plan",
    "check_hf_tensor_parallel",
]

#: Hugging Face style name -> our style name (``None``: refused, with the reason). ``colwise_gather_output`` and
#: ``embedding_rowwise`` translate only on the model's output/input embeddings; ``moe_tp_experts`` keeps the experts
#: whole on every tp rank and plans the block that holds them as a per-token module, and the entries on the experts'
#: own parameters (``packed_colwise``, ``rowwise``, ``grouped_gemm``) are then covered by it.
HF_STYLES: dict[str, tuple[str | None, str]] = {
    "colwise": ("colwise", "nn.Linear split by output features"),
    "rowwise": ("rowwise", "nn.Linear split by input features"),
    "local_colwise": ("colwise", "our column-parallel layers already return local tensors"),
    "local_rowwise": ("rowwise", "our row-parallel layers already return local tensors"),
    "colwise_gather_output": ("colwise_gather", "split by output features, output gathered (on the LM head: "
                              "'vocab_head', split over the vocabulary with a vocab-parallel loss)"),
    "colwise_rep": ("colwise_gather", "as colwise_gather_output"),
    "rowwise_split_input": ("rowwise_split", "split by input features, replicated input sliced on each rank"),
    "rowwise_rep": ("rowwise_split", "as rowwise_split_input"),
    "embedding_rowwise": ("vocab_embedding_full", "the token embedding, split over the vocabulary"),
    "replicated_with_grad_allreduce": ("replicate_grad_sum", "per-head norm on the local heads"),
    "replicate": ("replicate", "whole on every tp rank"),
    "sequence_parallel": ("sequence_parallel", "per-token module"),
    "moe_tp_experts": ("sequence_parallel", "experts whole on every tp rank; their block is a per-token module"),
    "moe_identity_expert": ("replicate", "whole on every tp rank"),
    "embedding_colwise": (None, "an embedding split over the hidden size is not supported; plan it 'vocab_embedding'"),
    "packed_colwise": (None, "packed (fused) weights need an interleaved split, supported only inside experts"),
    "packed_rowwise": (None, "packed (fused) weights need an interleaved split, supported only inside experts"),
    "local_packed_rowwise": (None, "packed (fused) weights need an interleaved split, supported only inside experts"),
    "grouped_gemm": (None, "expert-parallel weights: use the ep axis, not the tp plan"),
    "ep_dispatch_experts": (None, "expert-parallel dispatch: use the ep axis, not the tp plan"),
    "mla_kv_a_proj": ("replicate", "multi-head latent attention: the attention holding it runs whole on every tp "
                      "rank"),
    "all_reduce": (None, "a bare all-reduce style is not supported"),
    "local_params": (None, "parameters kept as local shards are not supported"),
    "local": (None, "modules running on local shards without layouts are not supported"),
    "gather": (None, "a gathered output inside the model is not supported"),
    "isolated": (None, "isolated sub-meshes are not supported"),
}

#: Styles valid only on a parameter of an experts module (dropped: the experts module's entry covers them).
_EXPERT_PARAM_STYLES = {
    "packed_colwise", "packed_rowwise", "local_packed_rowwise", "rowwise", "colwise", "grouped_gemm",
}


#: Plans, in Hugging Face style names, for families whose transformers config has none (``base_model_tp_plan``
#: empty), keyed by ``config.model_type``. GPT-2: its ``Conv1D`` layers are transposed linear layers (weight
#: ``(in, out)``, split on the matching dim by our linear styles); ``c_attn`` is a fused q/k/v projection split by
#: ``attn.split(split_size)`` into whole-hidden thirds, so it is gathered (each rank then runs every head) and
#: ``c_proj`` splits its replicated input; the MLP is plain column/row parallel. The learned position table runs on
#: the whole sequence, before the first block.
_FAMILY_PLANS: dict[str, dict[str, str]] = {
    "gpt2": {
        "lm_head": "colwise_gather_output",
        "transformer.wte": "embedding_rowwise",
        "transformer.wpe": "replicate",
        "transformer.h.*.attn.c_attn": "colwise_gather_output",
        "transformer.h.*.attn.c_proj": "rowwise_split_input",
        "transformer.h.*.mlp.c_fc": "colwise",
        "transformer.h.*.mlp.c_proj": "rowwise",
    },
}


class GlobalPositions(ParallelStyle):
    """A forward pre-hook on the network: ``position_ids = arange(seq)`` when the caller passes none and no cache.

    transformers computes default positions from the length of the embeddings, which under sequence parallelism is a
    sequence shard's; passing the global positions keeps the rotary embedding of the whole sequence (what every rank
    gathers before attention). With ``position_ids`` given (context parallelism, generation) nothing changes. Holds
    no parameters (``covers_parameters = False``).
    """

    covers_parameters = False

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(_fill_positions, with_kwargs=True)
        return module


def _fill_positions(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if kwargs.get("position_ids") is not None or any(kwargs.get(k) is not None for k in ("cache", "past_key_values")):
        return None
    ids = args[0] if args else kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return None
    positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand(ids.shape[0], -1)
    return args, {**kwargs, "position_ids": positions}


def hf_raw_tp_plan(network: nn.Module) -> dict[str, str]:
    """The model's own plan with paths relative to ``network``: ``network.tp_plan`` (transformers 5.x), else its
    ``_tp_plan`` plus ``config.base_model_tp_plan`` under the base model's prefix; with the experts of its
    expert-parallel plan added as ``moe_tp_experts`` entries where the tp plan does not name them
    (transformers >= 5.25, :func:`_experts_from_ep_plan`).

    Raises:
        ValueError: the model has no plan (its ``config.base_model_tp_plan`` is empty).
    """
    plan = getattr(network, "tp_plan", None)
    if isinstance(plan, Mapping) and plan:
        return {**plan, **_experts_from_ep_plan(network, plan)}
    out = dict(tensor_plan_of_model(network) or {})
    prefix = getattr(network, "base_model_prefix", "")
    prefix = f"{prefix}." if prefix and isinstance(getattr(network, prefix, None), nn.Module) else ""
    base = getattr(getattr(network, "config", None), "base_model_tp_plan", None) or {}
    out.update({f"{prefix}{k}": v for k, v in base.items()})
    out.update(_experts_from_ep_plan(network, out))
    if not out and getattr(getattr(network, "config", None), "model_type", None) in _FAMILY_PLANS:
        out = dict(_FAMILY_PLANS[network.config.model_type])
    if not out:
        transposed = sorted({type(m).__name__ for m in network.modules()
                             if type(m).__name__ == "Conv1D" and not isinstance(m, nn.Linear)})
        why = (f" Its layers are {transposed[0]} modules (GPT-2's transposed-weight linear layers, weight (in, out), "
               f"c_attn a fused q/k/v), which the column/row-parallel styles (nn.Linear) do not split." if transposed
               else "")
        raise ValueError(
            f"tensor parallelism needs a plan for {type(network).__name__}: its config.base_model_tp_plan is empty."
            f"{why} Use tp_size=1 (zero3, pipeline or context parallelism), or pass strategy.tensor_parallel.plan="
            f"{{module path: style}} with styles {list(STYLE_NAMES)}."
        )
    return out


def _experts_from_ep_plan(network: nn.Module, tp_plan: Mapping[str, str]) -> dict[str, str]:
    """The experts of the model's expert-parallel plan, as tensor-parallel entries: every module its ``ep_plan`` marks
    ``ep_dispatch_experts`` becomes ``moe_tp_experts`` (experts whole on every tp rank, the block holding them a
    per-token module), and the ``grouped_gemm`` entries on its weights are kept (covered by it).

    transformers up to 5.24 put these entries in ``base_model_tp_plan`` itself (``moe_tp_experts``, with
    ``packed_colwise``/``rowwise`` on the weights); 5.25 deprecated that style and lists the experts only in
    ``base_model_ep_plan``, so a tensor-parallel plan read from the tp plan alone would leave the experts uncovered.
    Reading both keeps one translation for either layout. Keys the tp plan already holds are not repeated.
    """
    ep_plan = getattr(network, "ep_plan", None)
    if not isinstance(ep_plan, Mapping):
        prefix = getattr(network, "base_model_prefix", "")
        prefix = f"{prefix}." if prefix and isinstance(getattr(network, prefix, None), nn.Module) else ""
        base = getattr(getattr(network, "config", None), "base_model_ep_plan", None) or {}
        ep_plan = {f"{prefix}{k}": v for k, v in base.items()}
    experts = [k for k, v in ep_plan.items() if v == "ep_dispatch_experts"]
    covered = [k for k, v in tp_plan.items() if v == "moe_tp_experts"]
    out: dict[str, str] = {}
    for key in experts:
        if key in covered:
            continue
        out[key] = "moe_tp_experts"
        out.update({k: v for k, v in ep_plan.items() if k.startswith(key + ".") and k not in tp_plan})
    return out


def _targets(network: nn.Module, key: str) -> list[tuple[str, Any]]:
    """``(exact path, module or parameter)`` for every match of an HF plan key (``*`` = any child); none if absent."""
    found: list[tuple[str, Any]] = [("", network)]
    for segment in key.split("."):
        nxt = []
        for prefix, obj in found:
            if not isinstance(obj, nn.Module):
                continue
            if segment == "*":
                nxt.extend((f"{prefix}{n}.", c) for n, c in obj.named_children())
            elif isinstance(child := getattr(obj, segment, None), (nn.Module, nn.Parameter)):
                nxt.append((f"{prefix}{segment}.", child))
        found = nxt
    return [(p[:-1], o) for p, o in found]


def _refuse(network: nn.Module, path: str, hf_style: str, reason: str) -> ValueError:
    return ValueError(
        f"the tensor-parallel plan of {type(network).__name__} gives {path!r} the Hugging Face style {hf_style!r}, "
        f"which lightning_par does not translate here: {reason}. Pass strategy.tensor_parallel.plan={{module path: "
        f"style}} with styles {list(STYLE_NAMES)} to plan this model yourself."
    )


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower() and any(True for _ in module.parameters(recurse=False))


def hf_tp_plan(network: nn.Module) -> dict[str, Any]:
    """Our plan (exact module path -> style, see :mod:`lightning_par.tensor_parallel.plan`) from the model's own.

    One plan for both modes: with and without sequence parallelism the style names mean the same.

    Raises:
        ValueError: a style name :data:`HF_STYLES` refuses or does not know, or one used where it does not apply
            (``colwise_gather_output`` on a module that is not the output embeddings, ``embedding_rowwise`` on one
            that is not the input embeddings, an expert-parameter style outside an experts module). The message names
            the path and the style.
    """
    raw = hf_raw_tp_plan(network)
    inputs = network.get_input_embeddings() if hasattr(network, "get_input_embeddings") else None
    outputs = network.get_output_embeddings() if hasattr(network, "get_output_embeddings") else None
    plan: dict[str, Any] = {}
    experts: list[str] = []
    whole: list[str] = []  # attention modules kept whole (multi-head latent attention)
    params: list[tuple[str, str]] = []
    for key, hf_style in raw.items():
        if hf_style not in HF_STYLES:
            raise _refuse(network, key, hf_style, f"an unknown style (known: {sorted(HF_STYLES)})")
        ours, reason = HF_STYLES[hf_style]
        for path, target in _targets(network, key):
            if isinstance(target, nn.Parameter):
                params.append((path, hf_style))
                continue
            if ours is None:
                raise _refuse(network, path, hf_style, reason)
            if ours == "colwise_gather" and target is outputs:
                ours = "vocab_head"
            if ours == "vocab_embedding_full" and target is not inputs:
                raise _refuse(network, path, hf_style, "supported only on the model's input embeddings")
            if hf_style == "mla_kv_a_proj":
                whole.append(path.rpartition(".")[0])
            if hf_style == "moe_tp_experts":
                experts.append(path)
                path = path.rpartition(".")[0]  # the block holding router and experts: one per-token module
            plan[path] = ours
    for path, hf_style in params:  # entries on the experts' own weights: covered by their module's entry
        if hf_style not in _EXPERT_PARAM_STYLES or not any(path.startswith(e + ".") for e in experts):
            raise _refuse(network, path, hf_style, "a parameter, not a module, outside an experts module")
    blocks = [e.rpartition(".")[0] for e in experts]
    for path in [p for p in plan if any(p.startswith(b + ".") for b in blocks if b)]:
        # Inside a mixture-of-experts block (a per-token module, experts whole on every tp rank) a split shared expert
        # would run on this rank's tokens only under sequence parallelism (its column layers gathering them as if the
        # sequence, from a flattened (tokens, hidden) input): it is kept whole too, and its parameters' gradients,
        # from this rank's tokens, are summed over the tp ranks with the block's.
        del plan[path]
    for path in [p for p in plan if any(p == w or p.startswith(w + ".") for w in whole)]:
        # Multi-head latent attention (DeepSeek-V2/V3; transformers >= 5.25 plans it with 'mla_kv_a_proj'): the shared
        # down-projection kv_a_proj_with_mqa feeds a column-parallel layer (its k_pass part, whose gradient comes back
        # whole) and the attention directly (its rope part, whose gradient would be one rank's heads only), and the
        # query's q_a_proj runs on replicated activations before q_b_proj; no style of ours splits that. The attention
        # runs whole on every tp rank, as transformers <= 5.24 planned it (its parameters then uncovered under
        # sequence parallelism, which validate_plan refuses naming them).
        del plan[path]
    for path in [p for p, s in plan.items() if s in ("colwise", "colwise_gather")]:
        parent = path.rpartition(".")[0]
        plan.setdefault(parent, "colwise_input")
    regions = [p for p, s in plan.items() if s != "colwise_input"]
    gathered = [p for p, s in plan.items() if s == "colwise_input"]
    for group in gathered:
        inner = [p for p in plan if p.startswith(group + ".")]
        # A group whose column layers all gather their output runs on replicated activations: a module inside runs as
        # in one process (a norm over the whole hidden size, OLMo2's q_norm/k_norm). In any other group a module the
        # plan leaves out runs on this rank's part of the split features or heads (an activation with learned
        # parameters, Apertus' xIELU; a per-head norm, Sarvam's q_norm): its parameters' gradients come from this
        # rank's part only, partial sums over the tp ranks, which 'replicate_grad_sum' sums. That its forward is
        # right on a part is checked on the model before any split (check_hf_tensor_parallel).
        gathers = all(plan[p] in ("colwise_gather", "rowwise_split") for p in inner)
        for name, module in network.get_submodule(group).named_modules(prefix=group):
            owns = any(True for _ in module.parameters(recurse=False))
            if owns and name != group and not any(name == p or name.startswith(p + ".") for p in inner):
                plan[name] = "replicate" if gathers else "replicate_grad_sum"
    for name, module in network.named_modules():
        inside = any(name == r or name.startswith(r + ".") for r in regions + gathered if r)
        if _is_norm(module) and name not in plan and not inside:
            plan[name] = "sequence_parallel"
    layers = _layers(network)
    if "vocab_embedding_full" in plan.values() and len(layers) > 1:
        # Only the decoder layers run on sequence shards: the model's own code before the first (its attention masks
        # from the embeddings' length, scalings) and after the last (a final norm, reshapes by the input's length)
        # sees the whole sequence, as in one process.
        plan[layers[0]], plan[layers[-1]] = "sequence_scatter", "sequence_gather"
        for path, style in list(plan.items()):
            outside = not any(path == f or path.startswith(f + ".") for f in layers)
            if style == "sequence_parallel" and outside:
                plan[path] = "replicate"
            elif style == "vocab_head":
                plan[path] = "vocab_head_full"
    else:
        plan = {p: "vocab_embedding" if s == "vocab_embedding_full" else s for p, s in plan.items()}
    plan[""] = GlobalPositions()
    return plan


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_hf_tensor_parallel(network: nn.Module, tp_size: int, sequence_parallel: bool,
                             plan: Mapping[str, Any] | None = None) -> None:
    """Check that a Hugging Face model can be split over ``tp_size`` ranks by its plan.

    Args:
        network: the ``PreTrainedModel``.
        tp_size: tensor-parallel size.
        sequence_parallel: whether sequence parallelism is on.
        plan: the plan the run uses (default: the model's own, :func:`hf_tp_plan`).

    Raises:
        ValueError: ``config.num_attention_heads`` or ``config.num_key_value_heads`` not divisible by ``tp_size``
            (whole heads, and whole key/value heads under grouped-query attention, go to each rank), or tied input
            and output embeddings (``config.tie_word_embeddings=True``: one weight cannot be split twice). The message
            names the config field, its value and what would be valid. Or, on real weights, a split region of the
            plan (an attention or MLP planned ``colwise_input``) whose own forward is not right on one rank's part of
            its heads or features, checked in one process on 8 tokens
            (:func:`lightning_par.tensor_parallel.regions.check_split_regions`): the message names the module.
    """
    config = network.config
    name = type(network).__name__
    for field in ("num_attention_heads", "num_key_value_heads"):
        value = getattr(config, field, None)
        if isinstance(value, int) and value % tp_size:
            raise ValueError(
                f"{name}.config.{field}={value} is not divisible by tp_size={tp_size}: tensor parallelism gives each "
                f"rank whole heads; choose tp_size in {_divisors(value)} or change {field}."
            )
    inputs = network.get_input_embeddings() if hasattr(network, "get_input_embeddings") else None
    outputs = network.get_output_embeddings() if hasattr(network, "get_output_embeddings") else None
    if inputs is not None and outputs is not None and inputs.weight is outputs.weight and tp_size > 1:
        raise ValueError(
            f"{name}.config.tie_word_embeddings=True is not valid with tensor parallelism (tp_size={tp_size}): the "
            f"embedding and the LM head share one weight, which the vocab-parallel styles would split twice. Build "
            f"the model with config tie_word_embeddings=False (+model.config.tie_word_embeddings=false)."
        )
    if tp_size > 1:
        _check_regions(network, tp_size, hf_tp_plan(network) if plan is None else plan)


def _check_regions(network: nn.Module, tp_size: int, plan: Mapping[str, Any]) -> None:
    from lightning_par.tensor_parallel.plan import expand_plan
    from lightning_par.tensor_parallel.regions import check_split_regions

    if any(p.is_meta for p in network.parameters()):
        return
    vocab = int(getattr(network.config, "vocab_size", 2) or 2)
    device = next(network.parameters()).device
    ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(0)).to(device)
    model = f"{type(network).__name__} (model_type={getattr(network.config, 'model_type', None)!r})"
    check_split_regions(network, expand_plan(network, plan), tp_size,
                        lambda: network(input_ids=ids, use_cache=False), model)


def _layers(network: nn.Module) -> list[str]:
    """Paths of the outermost ``GradientCheckpointingLayer`` modules: transformers' own checkpointing units."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    found: list[str] = []
    for name, module in network.named_modules():
        if isinstance(module, GradientCheckpointingLayer) and not any(name.startswith(f + ".") for f in found):
            found.append(name)
    return found


def hf_checkpoint_modules(network: nn.Module, mode: str) -> list[str]:
    """Modules activation checkpointing recomputes: ``"full"``: every decoder layer (the model's
    ``GradientCheckpointingLayer`` modules, ``model.layers.N``); ``"selective"``: the attention of each (its child
    whose class name ends with ``Attention``, ``model.layers.N.self_attn``).

    Raises:
        ValueError: an unknown mode, a model with no decoder layers, or (``"selective"``) a layer with no attention
            child. The message is about activation checkpointing and names the model.
    """
    name = type(network).__name__
    if mode not in ("full", "selective"):
        raise ValueError(f"activation_checkpointing={mode!r} is not valid: expected 'full' or 'selective'.")
    layers = _layers(network)
    if not layers:
        raise ValueError(
            f"activation_checkpointing={mode!r} is not valid for {name}: it has no decoder layers "
            f"(transformers GradientCheckpointingLayer modules) to recompute."
        )
    if mode == "full":
        return layers
    out = []
    for path in layers:
        attention = [n for n, c in network.get_submodule(path).named_children()
                     if type(c).__name__.endswith("Attention")]
        if not attention:
            raise ValueError(
                f"activation_checkpointing='selective' is not valid for {name}: layer {path!r} has no attention "
                f"child (a module whose class name ends with 'Attention'); use activation_checkpointing='full'."
            )
        out.append(f"{path}.{attention[0]}")
    return out
