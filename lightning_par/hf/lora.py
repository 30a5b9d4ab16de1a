"""The model contract for PEFT models (``peft.get_peft_model`` around a Hugging Face causal LM): LoRA adapters under
tensor and pipeline parallelism through the wrapped model's own plans.

A ``PeftModel`` hides the ``PreTrainedModel`` it wraps at ``base_model.model`` (the ``LoraModel`` tuner, then the
model), and replaces each targeted ``nn.Linear`` by a LoRA layer holding the original at ``base_layer`` and the
adapter's two small matrices at ``lora_A.<adapter>`` ``(r, in)`` and ``lora_B.<adapter>`` ``(out, r)``; its forward is
``base_layer(x) + lora_B(lora_A(dropout(x))) * scaling`` (Hu et al. 2021, "LoRA", eq. 3). :class:`PeftAdapter`
answers the contract from the wrapped model's answers (:class:`lightning_par.hf.adapter.HFAdapter`) with every path
prefixed by ``base_model.model.``, so checkpoints keep the ``PeftModel``'s own parameter names:

* **tensor parallelism**: the model's plan (``base_model_tp_plan``) is read on the wrapped model and each planned
  LoRA layer gets LoRA-aware styles (:func:`lora_tp_plan`): for a column-parallel base layer, ``lora_A`` whole on every
  rank (``replicate``: its input is the replicated one of the base layer, and the gradient of its ``(..., r)`` output
  comes back whole, all-reduced at ``lora_B``'s input by the column-parallel style) and ``lora_B`` split on its output
  features (``colwise``); for a row-parallel base layer, ``lora_A`` split on its input features
  (``rowwise``: its partial ``(..., r)`` outputs summed, or reduce-scattered over the sequence under sequence
  parallelism, as the base layer's) and ``lora_B`` whole (a per-token module on the residual stream:
  ``sequence_parallel``). The dropout and the scaling run inside the LoRA layer's own forward, unchanged; with a
  dropout probability above 0 the tp ranks draw the same mask only if their generators agree (Lightning seeds every
  rank alike). Variants no split applies to (DoRA's magnitude vector, normalised over the whole weight; LoRA on an
  embedding or on a layer the plan gathers) are refused before start, naming the variant, the module and the layout.
* **pipeline parallelism**: the wrapped model's stages (:mod:`lightning_par.hf.pipeline`: its own forward over the
  stage's decoder layers), registered under the ``base_model.model.`` prefix.
* **activation checkpointing, context and expert parallelism**: the wrapped model's, prefixed. Adapters on the experts
  of a mixture-of-experts layer are refused under expert parallelism (the experts module's call is replaced there).

QLoRA (Dettmers et al. 2023): with ``quantize_base="nf4"`` the base's linear weights are torchao ``NF4Tensor`` s
(:func:`quantize_base_nf4`), which FSDP2 shards and gathers (zero3, HSDP) and the data-parallel engines broadcast
through their inner tensors; the layouts that split or cut the model refuse them.

Only LoRA (``peft_type == "LORA"``) is read through; another PEFT method (prompt tuning, IA3...) is refused under the
layouts that split the model, and trains under the data-parallel ones as any module does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from lightning_par.contract import register_adapter

__all__ = [
    "LORA_DEFAULTS",
    "PEFT_PREFIX",
    "PeftAdapter",
    "apply_lora",
    "cast_frozen_base",
    "check_lora_layout",
    "inner_model",
    "is_peft_network",
    "lora_layers",
    "lora_options",
    "lora_tp_plan",
    "nf4_parameters",
    "quantize_base_nf4",
]

#: ``HFCausalLM(lora=...)`` / ``model.lora.*`` fields and their defaults. ``r``: the adapters' rank (0: no LoRA);
#: ``alpha``: LoRA's ``lora_alpha`` (scaling ``alpha / r``; null: ``2 * r``); ``dropout``: on the adapters' input;
#: ``target_modules``: names of the ``nn.Linear`` layers that get adapters; ``adapter_only_checkpoint``: checkpoints
#: hold the trainable parameters only (the base comes from ``pretrained`` or the seeded build);
#: ``quantize_base``: null, or ``"nf4"`` (QLoRA, Dettmers et al. 2023: the base's linear weights stored as torchao
#: ``NF4Tensor`` s, computed in bf16; :func:`quantize_base_nf4`).
#: Values of ``lora.quantize_base``.
QUANTIZE_BASE = (None, "nf4")

LORA_DEFAULTS: dict[str, Any] = {
    "r": 0,
    "alpha": None,
    "dropout": 0.0,
    "target_modules": ["q_proj", "v_proj"],
    "adapter_only_checkpoint": True,
    "quantize_base": None,
}

#: Where a ``PeftModel`` holds the wrapped ``PreTrainedModel``: its ``LoraModel`` tuner, then the model.
PEFT_PREFIX = "base_model.model."


def lora_options(lora: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``lora`` checked and completed with :data:`LORA_DEFAULTS`; ``None`` when LoRA is off (``None`` or ``r == 0``).

    Raises:
        ValueError: an unknown field, ``r`` not a non-negative int, ``alpha`` not positive, ``dropout`` outside
            ``[0, 1)``, ``target_modules`` not a non-empty list of names, or ``quantize_base`` set; the message names
            the field, the value and what is valid.
    """
    if lora is None:
        return None
    given = dict(lora.items()) if hasattr(lora, "items") else lora
    if not isinstance(given, dict):
        raise ValueError(f"lora={lora!r} is not valid: expected a mapping with fields {sorted(LORA_DEFAULTS)}.")
    unknown = sorted(set(given) - set(LORA_DEFAULTS))
    if unknown:
        raise ValueError(f"lora field(s) {unknown} are not valid: expected fields among {sorted(LORA_DEFAULTS)}.")
    out = {**LORA_DEFAULTS, **given}
    r = out["r"]
    if isinstance(r, bool) or not isinstance(r, int) or r < 0:
        raise ValueError(f"lora.r={r!r} is not valid: expected the adapters' rank, a positive int (0: no LoRA).")
    if r == 0:
        return None
    alpha = out["alpha"]
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0):
        raise ValueError(f"lora.alpha={alpha!r} is not valid: expected a positive number (scaling alpha / r), or null "
                         f"for 2 * r.")
    dropout = out["dropout"]
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"lora.dropout={dropout!r} is not valid: expected a probability in [0, 1).")
    targets = out["target_modules"]
    if not isinstance(targets, str) and hasattr(targets, "__iter__"):  # a list, tuple or OmegaConf ListConfig
        targets = list(targets)
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise ValueError(f"lora.target_modules={out['target_modules']!r} is not valid: expected a non-empty list of "
                         f"layer names such as [q_proj, v_proj].")
    out["target_modules"] = targets
    if out["quantize_base"] not in QUANTIZE_BASE:
        raise ValueError(
            f"lora.quantize_base={out['quantize_base']!r} is not valid: expected one of {list(QUANTIZE_BASE)} (null: "
            f"the base in the model's dtype; 'nf4': QLoRA's 4-bit NormalFloat base, bf16 compute)."
        )
    if out["quantize_base"] == "nf4":
        try:
            import torchao  # noqa: F401
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ValueError("lora.quantize_base='nf4' is not valid here: it needs torchao (pip install "
                             "'lightning-par[float8]').") from err
    if not isinstance(out["adapter_only_checkpoint"], bool):
        raise ValueError(f"lora.adapter_only_checkpoint={out['adapter_only_checkpoint']!r} is not valid: expected "
                         f"true or false.")
    return out


def apply_lora(model: nn.Module, options: Mapping[str, Any]) -> nn.Module:
    """``peft.get_peft_model(model, LoraConfig(...))`` from checked :func:`lora_options` (PEFT's initialisation:
    ``lora_A`` Kaiming-uniform, ``lora_B`` zero, so the wrapped model starts as the base).

    Raises:
        ImportError: ``peft`` is not installed (``pip install 'lightning-par[lora]'``).
        ValueError: a ``target_modules`` name that matches no layer of the model (PEFT's message, naming them).
    """
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("LoRA (lora.r > 0) needs peft: pip install 'lightning-par[lora]'") from err
    r = int(options["r"])
    alpha = options["alpha"] if options["alpha"] is not None else 2 * r
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=float(options["dropout"]),
                        target_modules=list(options["target_modules"]), bias="none")
    return get_peft_model(model, config)


def _nf4_blocks(numel: int) -> tuple[int, int] | None:
    """``(block_size, scaler_block_size)`` for torchao's ``to_nf4`` of a weight of ``numel`` elements split in two
    along dim 0 (FSDP2 over 2-8 ranks): blocks of 64 values (QLoRA's), and the largest scaler block up to 256 (QLoRA's)
    that divides the number of blocks of an eighth of the weight (torchao splits an NF4 weight only on scaler-block
    boundaries). ``None``: too small to quantize."""
    if numel % 64:
        return None
    blocks = numel // 64
    per_shard = blocks // 8 if blocks % 8 == 0 else blocks
    scaler = max(d for d in range(1, min(256, per_shard) + 1) if per_shard % d == 0)
    return 64, scaler


def quantize_base_nf4(model: nn.Module) -> list[str]:
    """QLoRA's base (Dettmers et al. 2023, §3): every ``nn.Linear`` of the model but the LM head gets its weight as a
    frozen torchao ``NF4Tensor`` (4-bit NormalFloat, blocks of 64 with double-quantized scales), the rest of the model
    bf16. torchao's tensor runs ``F.linear`` in bf16 (dequantizing on the fly, forward and backward) and implements
    FSDP2's all-gather and split of its shards. Call before the adapters are added (they stay fp32).

    Returns:
        The paths of the quantized layers.

    Raises:
        ValueError: a linear layer's weight does not split into NF4 blocks (elements not a multiple of 64).
    """
    import torch

    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    model.to(torch.bfloat16)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    done = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or module is head:
            continue
        blocks = _nf4_blocks(module.weight.numel())
        if blocks is None:
            raise ValueError(
                f"lora.quantize_base='nf4' is not valid for {name!r}: its weight {tuple(module.weight.shape)} has "
                f"{module.weight.numel()} elements, not a multiple of NF4's blocks of 64."
            )
        module.weight = nn.Parameter(to_nf4(module.weight.detach(), *blocks), requires_grad=False)
        done.append(name)
    return done


def cast_frozen_base(model: nn.Module, dtype: Any) -> list[str]:
    """Store the frozen weights (and biases) of ``model``'s ``nn.Linear`` layers in ``dtype`` (bf16 under Lightning's
    ``"bf16-mixed"``), the trainable ones (LoRA's adapters) staying in theirs (fp32 masters).

    Autocast computes every linear layer in bf16 from a bf16 copy of its fp32 weight, remade at each call; a frozen
    weight never changes, so storing that copy once gives the same products with half the bytes (the frozen base is
    most of a LoRA run's parameters). Embeddings and norms keep their dtype: autocast does not cast them, and a bf16
    embedding would make the residual stream bf16. A linear layer whose weight is also an embedding's (tied LM head)
    is left as it is. Weights already in another dtype (NF4, bf16) are left as they are.

    Returns:
        The paths of the layers whose weights were cast.
    """
    import torch

    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    done = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or id(module.weight) in embeddings:
            continue
        cast = False
        for param in (module.weight, module.bias):
            if param is not None and not param.requires_grad and param.dtype == torch.float32:
                param.data = param.data.to(dtype)
                cast = True
        if cast:
            done.append(name)
    return done


def nf4_parameters(model: nn.Module) -> list[str]:
    """Names of the parameters of ``model`` stored as torchao ``NF4Tensor`` s."""
    return [n for n, p in model.named_parameters() if type(p).__name__ == "NF4Tensor"
            or type(getattr(p, "data", None)).__name__ == "NF4Tensor"]


def is_peft_network(module: nn.Module) -> bool:
    """Whether ``module`` is or holds a ``peft.PeftModel`` (without importing peft when it is not loaded)."""
    import sys

    if "peft" not in sys.modules:
        return False
    return any(_is_peft(m) for m in module.modules())


def _is_peft(network: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - the adapter is imported only for classes from peft
        return False
    return isinstance(network, PeftModel)


def inner_model(network: nn.Module) -> nn.Module:
    """The ``PreTrainedModel`` a ``PeftModel`` wraps (``network.base_model.model``)."""
    return network.get_submodule(PEFT_PREFIX[:-1])


def _prefixed(path: str) -> str:
    return PEFT_PREFIX + path if path else PEFT_PREFIX[:-1]


def _unprefixed(network: nn.Module, path: str, what: str) -> str:
    if path == PEFT_PREFIX[:-1]:
        return ""
    if not path.startswith(PEFT_PREFIX):
        raise ValueError(
            f"{what} {path!r} is not valid for {type(network).__name__}: expected a path under {PEFT_PREFIX!r} (the "
            f"wrapped model)."
        )
    return path[len(PEFT_PREFIX):]


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """``{path relative to model: LoRA layer}`` for every PEFT LoRA layer in ``model`` (a module holding
    ``base_layer`` and ``lora_A``)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # pragma: no cover
        return {}
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def _peft_types(network: nn.Module) -> list[str]:
    configs = getattr(network, "peft_config", None) or {}
    return sorted({str(getattr(getattr(c, "peft_type", None), "value", getattr(c, "peft_type", None)))
                   for c in configs.values()})


def check_lora_layout(network: nn.Module, layout: str) -> None:
    """Refuse, before start, what ``layout`` (``"tensor parallelism (tp_size=2)"``...) cannot split: a PEFT method
    other than LoRA, DoRA (its magnitude vector normalises each output row over the whole weight, which no rank holds
    under tensor parallelism), LoRA on an embedding or a convolution.

    Raises:
        ValueError: naming the variant or the module, the layout, and what to use instead.
    """
    nf4 = nf4_parameters(network)
    if nf4 and any(word in layout for word in ("tensor", "pipeline", "context", "expert")):
        raise ValueError(
            f"lora.quantize_base='nf4' (QLoRA) is not supported under {layout}: the base's NF4 weights (e.g. "
            f"{nf4[0]!r}) have no column/row split or stage check here; torchao implements their all-gather and "
            f"split for FSDP2 only. Use zero3 or HSDP (dp_mode='zero3'), or quantize_base=null."
        )
    types = _peft_types(network)
    if types and types != ["LORA"]:
        raise ValueError(
            f"{type(network).__name__} uses the PEFT method {types}, which {layout} cannot split: only LoRA adapters "
            f"(peft_type 'LORA') are read through the wrapper. Use a data-parallel layout (ddp, zero1-3, HSDP), which "
            f"trains any PEFT method."
        )
    for path, layer in lora_layers(inner_model(network)).items():
        dora = getattr(layer, "lora_magnitude_vector", None)
        if dora is not None and len(dora) > 0:
            raise ValueError(
                f"LoRA variant DoRA (use_dora=True, on {path!r}) is not supported under {layout}: its magnitude vector "
                f"normalises every output row of base weight + B @ A over all input features, which the split gives "
                f"no rank whole. Use use_dora=False, or a data-parallel layout (ddp, zero1-3, HSDP) for DoRA."
            )
        if not isinstance(layer.get_base_layer(), nn.Linear):
            raise ValueError(
                f"LoRA on {path!r} ({type(layer.get_base_layer()).__name__}) is not supported under {layout}: only "
                f"LoRA on nn.Linear layers is split. Leave the module out of LoraConfig.target_modules."
            )


def lora_tp_plan(network: nn.Module, plan: Mapping[str, Any]) -> dict[str, Any]:
    """The LoRA-aware plan of a ``PeftModel`` from ``plan``, the wrapped model's (paths relative to it): every path
    prefixed with :data:`PEFT_PREFIX`, and each planned LoRA layer's style given to its ``base_layer`` with the
    adapter's matrices styled as the module docstring says.

    Raises:
        ValueError: see :func:`check_lora_layout`; a LoRA layer planned other than ``colwise``/``rowwise`` (a gathered
            or vocab-parallel layer), naming the module and the style.
    """
    model = inner_model(network)
    layers = lora_layers(model)
    out: dict[str, Any] = {}
    for path, style in plan.items():
        layer = layers.get(path)
        if layer is None:
            out[_prefixed(path)] = style
            continue
        if style not in ("colwise", "rowwise"):
            raise ValueError(
                f"LoRA on {path!r} is not supported under tensor parallelism: the model's plan gives it the style "
                f"{style!r}, and only column- and row-parallel layers ('colwise', 'rowwise') have LoRA-aware styles. "
                f"Leave the module out of LoraConfig.target_modules, or use a data-parallel layout."
            )
        out[_prefixed(f"{path}.base_layer")] = style
        for adapter in layer.lora_A:
            a, b = f"{path}.lora_A.{adapter}", f"{path}.lora_B.{adapter}"
            if style == "colwise":
                out[_prefixed(a)], out[_prefixed(b)] = "replicate", "colwise"
            else:
                out[_prefixed(a)], out[_prefixed(b)] = "rowwise", "sequence_parallel"
    return out


def _base_plan(network: nn.Module, plan: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`lora_tp_plan`, for the checks run on the wrapped model: paths relative to it, each LoRA
    layer's matrices dropped and its ``base_layer``'s style given back to the layer."""
    layers = lora_layers(inner_model(network))
    out: dict[str, Any] = {}
    for path, style in plan.items():
        rel = _unprefixed(network, path, "plan path")
        owner = next((p for p in layers if rel.startswith(p + ".")), None)
        if owner is None:
            out[rel] = style
        elif rel == f"{owner}.base_layer":
            out[owner] = style
    return out


class PeftAdapter:
    """Contract methods for a ``peft.PeftModel`` (see :mod:`lightning_par.contract` and the module docstring)."""

    @staticmethod
    def tp_plan(network: nn.Module) -> dict[str, Any]:
        """The wrapped model's plan (:func:`lightning_par.hf.tensor_parallel.hf_tp_plan`) made LoRA-aware
        (:func:`lora_tp_plan`)."""
        from lightning_par.hf.tensor_parallel import hf_tp_plan

        check_lora_layout(network, "tensor parallelism")
        return lora_tp_plan(network, hf_tp_plan(inner_model(network)))

    @staticmethod
    def check_tensor_parallel(network: nn.Module, tp_size: int, sequence_parallel: bool,
                              plan: dict[str, Any] | None = None) -> None:
        """:func:`check_lora_layout`, then the wrapped model's own checks (heads divisible, untied embeddings, its
        split regions right on a part) with the adapters disabled: a LoRA layer is linear, the regions' code around it
        is the model's."""
        from lightning_par.hf.tensor_parallel import check_hf_tensor_parallel

        check_lora_layout(network, f"tensor parallelism (tp_size={tp_size})")
        base = None if plan is None else _base_plan(network, plan)
        with network.disable_adapter():
            check_hf_tensor_parallel(inner_model(network), tp_size, sequence_parallel, plan=base)

    @staticmethod
    def checkpoint_modules(network: nn.Module, mode: str) -> list[str]:
        """The wrapped model's decoder layers (``"full"``) or their attention (``"selective"``), prefixed."""
        from lightning_par.hf.tensor_parallel import hf_checkpoint_modules

        return [_prefixed(p) for p in hf_checkpoint_modules(inner_model(network), mode)]

    @staticmethod
    def pipeline_layers(network: nn.Module) -> list[str]:
        """The wrapped model's decoder layers (:func:`lightning_par.hf.pipeline.pipeline_layers`), prefixed."""
        from lightning_par.hf.pipeline import pipeline_layers

        check_lora_layout(network, "pipeline parallelism")
        return [_prefixed(p) for p in pipeline_layers(inner_model(network))]

    @staticmethod
    def pipeline_stage(network: nn.Module, layers: list[str], *, first: bool, last: bool) -> nn.Module:
        """A stage of the wrapped model (:class:`lightning_par.hf.pipeline.HFPipelineStage`) registered under
        :data:`PEFT_PREFIX`: its parameters keep the ``PeftModel``'s names."""
        from lightning_par.hf.pipeline import pipeline_stage

        inner = [_unprefixed(network, p, "pipeline layer") for p in layers]
        return PrefixedStage(pipeline_stage(inner_model(network), inner, first=first, last=last))

    @staticmethod
    def pipeline_output(network: nn.Module, outputs: Any) -> Any:
        """As the wrapped model's (an output object with ``.logits``)."""
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(logits=outputs)

    @staticmethod
    def context_parallel_attention(network: nn.Module) -> Any:
        """The wrapped model's (:func:`lightning_par.hf.context.mask_free_attention`)."""
        from lightning_par.hf.context import mask_free_attention

        return mask_free_attention(inner_model(network))

    @staticmethod
    def check_context_parallel(network: nn.Module, cp_size: int) -> None:
        """The wrapped model's (:func:`lightning_par.hf.context.check_hf_context_parallel`)."""
        from lightning_par.hf.context import check_hf_context_parallel

        check_lora_layout(network, f"context parallelism (cp_size={cp_size})")
        check_hf_context_parallel(inner_model(network), cp_size)

    @staticmethod
    def takes_position_ids(network: nn.Module) -> bool:
        """Whether the wrapped model's ``forward`` takes ``position_ids`` (the ``PeftModel`` passes them on through
        its ``**kwargs``)."""
        import inspect

        return "position_ids" in inspect.signature(inner_model(network).forward).parameters

    @staticmethod
    def attention_heads(network: nn.Module) -> int:
        """Query heads per layer of the wrapped model."""
        return int(inner_model(network).config.num_attention_heads)

    @staticmethod
    def expert_modules(network: nn.Module) -> list[str]:
        """The wrapped model's experts modules, prefixed.

        Raises:
            ValueError: a LoRA adapter on (or inside) an experts module: the experts' call is replaced under expert
                parallelism, and the adapter would not run. The message names the module.
        """
        from lightning_par.hf.experts import expert_modules

        inner = inner_model(network)
        layers = lora_layers(inner)
        # an adapter wrapping the experts themselves (PEFT's target_parameters) hides their class from the check of
        # expert_modules: named here first
        wrapped = [p for p, m in layers.items() if type(m.get_base_layer()).__name__.lower().endswith("experts")]
        experts = wrapped or expert_modules(inner)
        for path in layers:
            hit = next((e for e in experts if path == e or path.startswith(e + ".")), None)
            if hit is not None:
                raise ValueError(
                    f"LoRA on {path!r}, inside the experts module {hit!r}, is not supported under expert parallelism: "
                    f"the experts run through the expert-parallel dispatch, not their own layers. Target the "
                    f"attention and the shared (non-expert) layers only in LoraConfig.target_modules, or use ep_size=1."
                )
        return [_prefixed(p) for p in experts]


class PrefixedStage(nn.Module):
    """A pipeline stage of the wrapped model, held at :data:`PEFT_PREFIX` so that its parameters are named as in the
    ``PeftModel`` (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``); calls run the stage."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        holder = nn.Module()
        holder.add_module(PEFT_PREFIX.split(".")[1], stage)
        self.add_module(PEFT_PREFIX.split(".")[0], holder)
        self._stage = [stage]  # a list: not registered twice

    @property
    def stage(self) -> nn.Module:
        """The wrapped model's stage."""
        return self._stage[0]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._stage[0](*args, **kwargs)


register_adapter(_is_peft, PeftAdapter())
