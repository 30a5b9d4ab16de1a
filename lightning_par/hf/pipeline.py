"""Pipeline stages of a Hugging Face ``PreTrainedModel``, read from its own pipeline plan.

``transformers`` ships, for every architecture it can pipeline, ``config.base_model_pp_plan``: the base model's
children in execution order with their input and output names, e.g. Llama's
``{"embed_tokens": (["input_ids"], ["inputs_embeds"]), "layers": (["hidden_states", "attention_mask"],
["hidden_states"]), "norm": (["hidden_states"], ["hidden_states"])}``, and the head class adds its own entries
(``LlamaForCausalLM._pp_plan = {"lm_head": (["hidden_states"], ["logits"])}``). :func:`read_plan` turns both into
paths relative to the network: what runs before the decoder layers (the first stage's), the ``nn.ModuleList`` of
decoder layers (the units a stage boundary falls between), and what runs after them (the last stage's).

A stage (:class:`HFPipelineStage`) re-runs the base model's decoder loop as ``transformers`` 5.24 writes it
(``LlamaModel.forward``), for any architecture with such a plan: the rotary embedding (``<base>.rotary_emb``) is
computed on every stage from ``position_ids``, every decoder layer is called as
``layer(hidden_states, attention_mask=None, position_ids=, position_embeddings=)``, and attention is causal through
``scaled_dot_product_attention``'s ``is_causal`` (``sdpa_attention_forward`` sets it when no mask is given), which is
also what context parallelism intercepts. The stage registers the network's own modules under their paths in the
network (``model.layers.3.self_attn.q_proj.weight``), so a pipelined checkpoint's names are the plain model's.

Not covered: sliding-window attention over sequences longer than the window (refused), padding masks (the stage
attends causally over the whole sequence, as training on packed windows does), and heads that do more than their
modules (logit soft-capping or scaling in ``forward``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["HFPipelineStage", "PipelinePlan", "pipeline_layers", "pipeline_stage", "read_plan"]


@dataclass(frozen=True)
class PipelinePlan:
    """Where a network's pipeline pieces are, as paths relative to the network.

    Attributes:
        before: modules run in order before the decoder layers, on the first stage (``["model.embed_tokens"]``).
        layers: the ``nn.ModuleList`` of decoder layers (``"model.layers"``).
        num_layers: decoder layers the model runs (``config.num_hidden_layers``).
        after: modules run in order after the layers, on the last stage (``["model.norm", "lm_head"]``).
        rotary: the rotary embedding module computing ``(cos, sin)`` from ``position_ids``, or ``None``.
    """

    before: tuple[str, ...]
    layers: str
    num_layers: int
    after: tuple[str, ...]
    rotary: str | None


def _base_path(network: nn.Module) -> str:
    """Path of the base model inside ``network`` (``"model"`` for ``LlamaForCausalLM``, ``""`` for ``LlamaModel``)."""
    base = getattr(network, "base_model", network)
    if base is network:
        return ""
    for name, module in network.named_modules():
        if module is base:
            return name
    return ""


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def read_plan(network: nn.Module) -> PipelinePlan:
    """The pipeline plan of a ``PreTrainedModel`` from ``config.base_model_pp_plan`` and its class's ``_pp_plan``.

    Raises:
        ValueError: the architecture has no ``base_model_pp_plan``; the plan names no ``nn.ModuleList`` of layers, or
            more than one; a plan entry other than the layers does not map one input to one output, or names no
            module of the network; the input and output embeddings are tied (one weight cannot live on both the
            first and the last stage).
    """
    name = type(network).__name__
    config = getattr(network, "config", None)
    base_plan = dict(getattr(config, "base_model_pp_plan", None) or {})
    if not base_plan:
        raise ValueError(
            f"pipeline parallelism (pp_size > 1) is not valid for {name} "
            f"(model_type={getattr(config, 'model_type', None)!r}): its config has no base_model_pp_plan, so "
            f"transformers does not say how to cut it into stages. Use an architecture that ships one (llama, "
            f"mistral, qwen2, qwen3, qwen3_moe, ...) or pp_size=1."
        )
    base = _base_path(network)
    entries = [(_join(base, key), value) for key, value in base_plan.items()]
    head_plan = getattr(type(network), "_pp_plan", None) or {}
    entries += [(key, value) for key, value in head_plan.items() if key not in dict(entries)]
    lists, before, after = [], [], []
    for path, io in entries:
        try:
            module = network.get_submodule(path)
        except AttributeError as err:
            raise ValueError(f"{name}'s pipeline plan names {path!r}, which is not a submodule of it.") from err
        if isinstance(module, nn.ModuleList):
            lists.append(path)
            continue
        inputs, outputs = io
        if len(inputs) != 1 or len(outputs) != 1:
            raise ValueError(
                f"{name}'s pipeline plan entry {path!r} maps {list(inputs)} to {list(outputs)}: expected one input and "
                f"one output for a module outside the decoder layers (an embedding, a norm, a head)."
            )
        (after if lists else before).append(path)
    if len(lists) != 1:
        raise ValueError(
            f"{name}'s pipeline plan {list(base_plan)} names {len(lists)} nn.ModuleList(s) of layers {lists}: expected "
            f"exactly one (the decoder layers a stage boundary falls between)."
        )
    embeddings = network.get_input_embeddings() if hasattr(network, "get_input_embeddings") else None
    head = network.get_output_embeddings() if hasattr(network, "get_output_embeddings") else None
    if embeddings is not None and head is not None and head.weight is embeddings.weight:
        raise ValueError(
            f"pipeline parallelism (pp_size > 1) is not valid for {name} with tie_word_embeddings=True: the input "
            f"embedding (first stage) and the output head (last stage) share one weight. Build the model with "
            f"config tie_word_embeddings=False, or use pp_size=1."
        )
    rotary = _join(base, "rotary_emb")
    try:
        network.get_submodule(rotary)
    except AttributeError:
        rotary = None
    layer_list = network.get_submodule(lists[0])
    num_layers = min(len(layer_list), int(getattr(config, "num_hidden_layers", len(layer_list))))
    return PipelinePlan(tuple(before), lists[0], num_layers, tuple(after), rotary)


def pipeline_layers(network: nn.Module) -> list[str]:
    """The decoder layers, in order, as paths relative to ``network`` (``["model.layers.0", ...]``).

    Raises:
        ValueError: see :func:`read_plan`.
    """
    plan = read_plan(network)
    return [f"{plan.layers}.{i}" for i in range(plan.num_layers)]


def _attach(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register ``module`` under ``path`` (dotted) in ``root``, creating plain containers on the way."""
    *parents, leaf = path.split(".")
    node = root
    for part in parents:
        child = node._modules.get(part)
        if child is None:
            child = nn.Module()
            node.add_module(part, child)
        node = child
    node.add_module(leaf, module)


class HFPipelineStage(nn.Module):
    """One pipeline stage of a ``PreTrainedModel``: the network's own modules, under their paths in the network.

    Called as ``stage(input_ids)`` (first stage) or ``stage(hidden_states)`` (``(batch, seq, hidden)``), each
    optionally followed by ``position_ids`` ``(batch, seq)`` int64 (context parallelism: the global positions of the
    tokens a rank holds; default ``0 .. seq-1``). Returns the logits ``(batch, seq, vocab)`` on the last stage; else
    the hidden states, with the ``position_ids`` when given (the next stage's rotary embedding needs them).

    Args:
        network: the whole ``PreTrainedModel``; shared, not copied.
        plan: its :class:`PipelinePlan`.
        layers: paths of the decoder layers this stage runs (from :func:`pipeline_layers`), in order.
        first: run the modules before the layers (the embedding).
        last: run the modules after the layers (the final norm and the head).

    Raises:
        ValueError: a name in ``layers`` is not one of the network's decoder layers.
    """

    def __init__(self, network: nn.Module, plan: PipelinePlan, layers: Sequence[str], *, first: bool,
                 last: bool) -> None:
        super().__init__()
        valid = [f"{plan.layers}.{i}" for i in range(plan.num_layers)]
        unknown = [n for n in layers if n not in valid]
        if unknown:
            raise ValueError(
                f"pipeline stage layers {unknown} are not valid for {type(network).__name__}: expected names from "
                f"{valid[:2] + ['...'] if len(valid) > 2 else valid}."
            )
        self.first, self.last = first, last
        self.config = network.config
        paths = [*(plan.before if first else ()), *layers, *(plan.after if last else ())]
        if plan.rotary is not None:
            paths.append(plan.rotary)
        for path in paths:
            _attach(self, path, network.get_submodule(path))
        # Run order, kept outside the module tree (the modules are registered above, once).
        self._run_before = [network.get_submodule(p) for p in (plan.before if first else ())]
        self._run_layers = [network.get_submodule(p) for p in layers]
        self._run_after = [network.get_submodule(p) for p in (plan.after if last else ())]
        self._rotary = network.get_submodule(plan.rotary) if plan.rotary is not None else None

    def _check_window(self, seq: int, positions: Tensor | None) -> None:
        window = getattr(self.config, "sliding_window", None)
        if not window or not self._run_layers:
            return
        layer_types = getattr(self.config, "layer_types", None)
        if layer_types is not None and "sliding_attention" not in layer_types:
            return
        if getattr(self.config, "use_sliding_window", True) is False:
            return
        span = int(positions.max()) + 1 if positions is not None else seq
        if span > window:
            raise ValueError(
                f"sequence length {span} is not valid for a pipelined {type(self.config).__name__} with "
                f"sliding_window={window}: pipeline stages attend causally over the whole sequence (no sliding-window "
                f"mask); use sequences of at most {window} tokens or pp_size=1."
            )

    def forward(self, x: Tensor, position_ids: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Run this stage (see the class docstring).

        Raises:
            ValueError: ``x`` is not token ids ``(batch, seq)`` on the first stage or hidden states
                ``(batch, seq, hidden)`` on the others; a sequence longer than a sliding window.
        """
        want = 2 if self.first else 3
        if x.dim() != want:
            what = "token ids (batch, seq)" if self.first else "hidden states (batch, seq, hidden)"
            raise ValueError(f"pipeline stage input of shape {tuple(x.shape)} is not valid: expected {what}.")
        hidden = x
        for module in self._run_before:
            hidden = module(hidden)
        batch, seq = hidden.shape[:2]
        self._check_window(seq, position_ids)
        if position_ids is None:
            positions = torch.arange(seq, device=hidden.device).unsqueeze(0)
        else:
            positions = position_ids if position_ids.dim() == 2 else position_ids.unsqueeze(0)
        if self._run_layers:
            kwargs = {"attention_mask": None, "position_ids": positions, "use_cache": False}
            if self._rotary is not None:
                kwargs["position_embeddings"] = self._rotary(hidden, position_ids=positions)
            for layer in self._run_layers:
                hidden = layer(hidden, **kwargs)
                if isinstance(hidden, tuple):  # architectures whose layers still return (hidden_states, ...)
                    hidden = hidden[0]
        for module in self._run_after:
            hidden = module(hidden)
        if self.last or position_ids is None:
            return hidden
        return hidden, position_ids


def pipeline_stage(network: nn.Module, layers: Sequence[str], *, first: bool, last: bool) -> HFPipelineStage:
    """A :class:`HFPipelineStage` of ``network`` running ``layers`` (plus the embedding if ``first``, the final norm
    and head if ``last``), sharing the network's parameters under their names.

    Raises:
        ValueError: see :func:`read_plan` and :class:`HFPipelineStage`.
    """
    return HFPipelineStage(network, read_plan(network), list(layers), first=first, last=last)
