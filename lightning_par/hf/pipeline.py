"""Pipeline stages of a Hugging Face ``PreTrainedModel`` that run the model's own ``forward``.

``transformers`` ships, for every architecture it can pipeline, ``config.base_model_pp_plan``: the base model's
children in execution order with their input and output names, e.g. Llama's
``{"embed_tokens": (["input_ids"], ["inputs_embeds"]), "layers": (["hidden_states", "attention_mask"],
["hidden_states"]), "norm": (["hidden_states"], ["hidden_states"])}``, and the head class adds its own entries
(``LlamaForCausalLM._pp_plan = {"lm_head": (["hidden_states"], ["logits"])}``). :func:`read_plan` turns both into
paths relative to the network: what runs before the decoder layers (the first stage's), the ``nn.ModuleList`` of
decoder layers (the units a stage boundary falls between), and what runs after them (the last stage's). An
architecture without such a plan (GPT-2) has it read from its module tree: the base model's one ``nn.ModuleList`` of
``config.num_hidden_layers`` layers, the children holding parameters registered before it (embeddings) and after it
(final norm), and the head's; :func:`check_stages` then proves the plan on the model before it is used.

A stage (:class:`HFPipelineStage`) runs the model's own ``forward`` (the head class's: ``LlamaForCausalLM.forward``),
so the arithmetic an architecture does around its modules runs where the model does it: Granite's
``embedding_multiplier`` and ``logits_scaling``, Cohere's ``logit_scale``, Gemma's final logit soft-capping, GPT-2's
learned positions, Gemma-3's rotary embedding per layer type and its sliding-window masks. The stage calls it on a
*skeleton* of the network: copies of the network and of the modules down to the decoder layers, whose children are
this stage's modules, the parameter-free ones (rotary embedding, dropout) and stand-ins for what other stages hold:

* the decoder layers of other stages are :class:`_Skip`\ s that return their ``hidden_states`` unchanged (keeping the
  layer's plain attributes, such as ``attention_type``, that the loop reads);
* a stage other than the first calls the forward with ``inputs_embeds`` of zeros; the skip just before its first
  layer returns the hidden states it received instead, so the loop's own code around each layer call runs on the
  stage of that layer;
* a stage other than the last ends at its last layer's output (raised past the rest of the forward);
* the embeddings of the first stage are zeros elsewhere (GPT-2 embeds positions even when given ``inputs_embeds``);
  the final norm and head of the last stage are never reached elsewhere.

Only this stage's modules are held (the skeleton holds no other layer), registered under their paths in the network
(``model.layers.3.self_attn.q_proj.weight``), so a pipelined checkpoint's names are the plain model's.

What a stage-by-stage run cannot reproduce (a layer reading more than the hidden states of the layer before, an
architecture that always runs its embeddings on tokens) is detected from the model, not from a list of names:
:func:`check_stages` runs, on real weights before the first cut, 8 tokens through the model's forward and through a
chain of stages of one layer each, and refuses a model whose two logits differ. Padding masks are not passed (the
stages attend causally over the whole sequence, as training on packed windows does).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_par.compat import module_copy
from lightning_par.compat.transformers import pipeline_plan_of_class

__all__ = ["HFPipelineStage", "PipelinePlan", "check_stages", "pipeline_layers", "pipeline_stage", "read_plan"]


@dataclass(frozen=True)
class PipelinePlan:
    """Where a network's pipeline pieces are, as paths relative to the network.

    Attributes:
        before: modules with parameters run before the decoder layers, on the first stage (``["model.embed_tokens"]``).
        layers: the ``nn.ModuleList`` of decoder layers (``"model.layers"``).
        num_layers: decoder layers the model runs (``config.num_hidden_layers``).
        after: modules with parameters run after the layers, on the last stage (``["model.norm", "lm_head"]``).
        shared: parameter-free modules beside them, kept on every stage (``["model.rotary_emb"]``).
        spine: the modules from the network down to the layers' parent (``["", "model"]``), copied into each stage's
            skeleton.
        derived: read from the module tree (the config has no ``base_model_pp_plan``).
    """

    before: tuple[str, ...]
    layers: str
    num_layers: int
    after: tuple[str, ...]
    shared: tuple[str, ...] = ()
    spine: tuple[str, ...] = ("",)
    derived: bool = False


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


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _derived_entries(network: nn.Module, base: str) -> list[str]:
    """The base model's children in registration order and the head's, for a model without a pipeline plan; the one
    ``nn.ModuleList`` of ``config.num_hidden_layers`` layers among them.

    Raises:
        ValueError: no such list, or more than one.
    """
    name, config = type(network).__name__, network.config
    count = getattr(config, "num_hidden_layers", None)
    base_module = network.get_submodule(base)
    children = [(_join(base, n), m) for n, m in base_module.named_children()]
    lists = [p for p, m in children if isinstance(m, nn.ModuleList) and len(m) == count]
    if len(lists) != 1:
        raise ValueError(
            f"pipeline parallelism (pp_size > 1) is not valid for {name} "
            f"(model_type={getattr(config, 'model_type', None)!r}): its config has no base_model_pp_plan and its base "
            f"model has {len(lists)} nn.ModuleList(s) of num_hidden_layers={count} layers {lists} (expected exactly "
            f"one to cut between). Use pp_size=1."
        )
    entries = [p for p, m in children if _holds_parameters(m) or p in lists]
    entries += [n for n, m in network.named_children() if n != base and _holds_parameters(m)]
    return entries


def read_plan(network: nn.Module) -> PipelinePlan:
    """The pipeline plan of a ``PreTrainedModel`` from ``config.base_model_pp_plan`` and its class's ``_pp_plan``, or
    from its module tree when it has none (see the module docstring).

    Raises:
        ValueError: the plan names no ``nn.ModuleList`` of layers, or more than one; a plan entry other than the
            layers does not map one input to one output, or names no module of the network; a module holding
            parameters (or parameters held directly by the network or its base model) that the plan places on no
            stage; the input and output embeddings are tied (one weight cannot live on both the first and the last
            stage).
    """
    name = type(network).__name__
    config = getattr(network, "config", None)
    base_plan = dict(getattr(config, "base_model_pp_plan", None) or {})
    base = _base_path(network)
    derived = not base_plan
    if derived:
        entries = [(path, (["x"], ["y"])) for path in _derived_entries(network, base)]
    else:
        entries = [(_join(base, key), value) for key, value in base_plan.items()]
        head_plan = pipeline_plan_of_class(type(network)) or {}
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
            f"{name}'s pipeline plan {[p for p, _ in entries]} names {len(lists)} nn.ModuleList(s) of layers {lists}: "
            f"expected exactly one (the decoder layers a stage boundary falls between)."
        )
    embeddings = network.get_input_embeddings() if hasattr(network, "get_input_embeddings") else None
    head = network.get_output_embeddings() if hasattr(network, "get_output_embeddings") else None
    if embeddings is not None and head is not None and head.weight is embeddings.weight:
        raise ValueError(
            f"pipeline parallelism (pp_size > 1) is not valid for {name} with tie_word_embeddings=True: the input "
            f"embedding (first stage) and the output head (last stage) share one weight. Build the model with "
            f"config tie_word_embeddings=False, or use pp_size=1."
        )
    layers = lists[0]
    parent = layers.rpartition(".")[0]
    spine = tuple(p for p in ("", *_prefixes(parent)))
    placed = {*before, *after, layers, *spine}
    shared = []
    for path in spine:
        module = network.get_submodule(path)
        if any(True for _ in module.parameters(recurse=False)):
            raise ValueError(
                f"pipeline parallelism (pp_size > 1) is not valid for {name}: {path or 'the network'!r} "
                f"({type(module).__name__}) holds parameters of its own "
                f"{[n for n, _ in module.named_parameters(recurse=False)]}, which no stage would hold. Use pp_size=1."
            )
        for child_name, child in module.named_children():
            child_path = _join(path, child_name)
            if child_path in placed:
                continue
            if _holds_parameters(child):
                raise ValueError(
                    f"pipeline parallelism (pp_size > 1) is not valid for {name}: its module {child_path!r} "
                    f"({type(child).__name__}) holds parameters, but its pipeline plan "
                    f"{[p for p, _ in entries]} places it on no stage. Use pp_size=1."
                )
            shared.append(child_path)
    layer_list = network.get_submodule(layers)
    num_layers = min(len(layer_list), int(getattr(config, "num_hidden_layers", len(layer_list))))
    return PipelinePlan(tuple(before), layers, num_layers, tuple(after), tuple(shared), spine, derived)


def _prefixes(path: str) -> list[str]:
    """``"a.b.c"`` -> ``["a", "a.b", "a.b.c"]``; ``""`` -> ``[]``."""
    parts = path.split(".") if path else []
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


_CHECKED: "weakref.WeakKeyDictionary[nn.Module, PipelinePlan]" = weakref.WeakKeyDictionary()


def pipeline_layers(network: nn.Module) -> list[str]:
    """The decoder layers, in order, as paths relative to ``network`` (``["model.layers.0", ...]``), once the plan
    has passed :func:`check_stages` (run once per network).

    Raises:
        ValueError: see :func:`read_plan` and :func:`check_stages`.
    """
    plan = _CHECKED.get(network)
    if plan is None:
        plan = read_plan(network)
        check_stages(network, plan)
        _CHECKED[network] = plan
    return [f"{plan.layers}.{i}" for i in range(plan.num_layers)]


def _attach(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register ``module`` under ``path`` (dotted) in ``root``, creating plain containers on the way."""
    *parents, leaf = path.split(".")
    node = root
    for part in parents:
        child = getattr(node, part, None)
        if not isinstance(child, nn.Module):
            child = nn.Module()
            node.add_module(part, child)
        node = child
    node.add_module(leaf, module)


class _StageOutput(Exception):
    """Raised past the rest of the model's forward with the hidden states a stage ends on."""

    def __init__(self, hidden: Tensor) -> None:
        super().__init__("pipeline stage output")
        self.hidden = hidden


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[0] if args else kwargs.get("hidden_states")


class _Skip(nn.Module):
    """A decoder layer held by another stage: returns its ``hidden_states`` (or, as the slot just before this stage's
    first layer, the hidden states this stage received). Keeps the layer's scalar attributes (``attention_type``,
    ``layer_idx``...) that a model's loop may read."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        for key, value in vars(layer).items():  # scalars only: nothing that would keep the layer's tensors alive
            if not key.startswith("_") and key != "training" and isinstance(value, (str, int, float, bool)):
                self.__dict__.setdefault(key, value)
        self.received: Tensor | None = None
        self.stop = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = _first_tensor(args, kwargs)
        if self.stop:  # a stage with no layers ends where the layers begin
            raise _StageOutput(hidden)
        return hidden if self.received is None else self.received


class _Last(nn.Module):
    """This stage's last layer on a stage that is not the last: the stage ends on its output."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("layer"), name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.layer(*args, **kwargs)
        raise _StageOutput(out[0] if isinstance(out, tuple) else out)


class _Elsewhere(nn.Module):
    """A module with parameters held by another stage. An embedding gives zeros of its output's shape (GPT-2 embeds
    positions on every call); anything else refuses to run."""

    def __init__(self, module: nn.Module, path: str) -> None:
        super().__init__()
        self.path, self.kind = path, type(module).__name__
        self.dim = module.embedding_dim if isinstance(module, nn.Embedding) else None
        self.dtype = next(module.parameters()).dtype

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if self.dim is None:
            raise ValueError(
                f"pipeline stage: the model's forward ran {self.path!r} ({self.kind}) on a stage that does not hold it."
            )
        return torch.zeros(*x.shape, self.dim, dtype=self.dtype, device=x.device)


class HFPipelineStage(nn.Module):
    """One pipeline stage of a ``PreTrainedModel``: the model's own ``forward`` over this stage's modules (see the
    module docstring), which are registered under their paths in the network.

    Called as ``stage(input_ids)`` (first stage) or ``stage(hidden_states)`` (``(batch, seq, hidden)``), each
    optionally followed by ``position_ids`` ``(batch, seq)`` int64 (context parallelism: the global positions of the
    tokens a rank holds; default ``0 .. seq-1``). Returns the logits ``(batch, seq, vocab)`` on the last stage (what
    the model's forward returns as ``logits``); else the hidden states after this stage's last layer, with the
    ``position_ids`` when given.

    Under sequence parallelism the hidden states between stages are this rank's share of the sequence
    (``seq / sequence_shards`` tokens, set by the tp axis); the model's forward then runs on a placeholder of the whole
    sequence, so that its positions, rotary embedding and mask cover every token, as the first stage's do.

    Args:
        network: the whole ``PreTrainedModel``; shared, not copied; only this stage's modules are kept.
        plan: its :class:`PipelinePlan`.
        layers: paths of the decoder layers this stage runs (from :func:`pipeline_layers`), contiguous, in order.
        first: run the modules before the layers (the embedding).
        last: run the modules after the layers (the final norm and the head).

    Raises:
        ValueError: a name in ``layers`` is not one of the network's decoder layers, or they are not contiguous.
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
        index = [valid.index(n) for n in layers]
        if index and index != list(range(index[0], index[0] + len(index))):
            raise ValueError(
                f"pipeline stage layers {list(layers)} are not valid: expected contiguous layers in order."
            )
        self.first, self.last = first, last
        #: Ranks the sequence of the hidden states between stages is split over (sequence parallelism's tp size).
        self.sequence_shards = 1
        self.config = network.config
        own = [*(plan.before if first else ()), *layers, *(plan.after if last else ())]
        for path in [*own, *plan.shared]:
            _attach(self, path, network.get_submodule(path))
        start = index[0] if index else (0 if first else plan.num_layers)
        end = start + len(index)
        # The skeleton: copies of the spine whose children are this stage's modules and stand-ins (outside the module
        # tree: its modules are registered above, once).
        copies: dict[str, nn.Module] = {}
        for path in plan.spine:
            original = network.get_submodule(path)
            skeleton = module_copy(original)
            for child_name, child in original.named_children():
                child_path = _join(path, child_name)
                if child_path in plan.spine:
                    continue  # filled below, once copied
                if child_path == plan.layers:
                    child = self._slots(child, plan, start, end)
                elif child_path not in own and child_path not in plan.shared:
                    child = _Elsewhere(child, child_path)
                skeleton.add_module(child_name, child)
            copies[path] = skeleton
        for path in plan.spine[1:]:
            parent, _, leaf = path.rpartition(".")
            copies[parent].add_module(leaf, copies[path])
        self._skeleton = [copies[""]]  # a list: not a submodule
        self._spine = list(copies.values())
        receiver = self._slot_list[start - 1] if not first and start > 0 else None
        self._receivers = [receiver] if isinstance(receiver, _Skip) else []  # a list: not a submodule

    def _slots(self, original: nn.ModuleList, plan: PipelinePlan, start: int, end: int) -> nn.ModuleList:
        slots: list[nn.Module] = []
        for i, layer in enumerate(original):
            if start <= i < end:
                slots.append(_Last(layer) if i == end - 1 and not self.last else layer)
            else:
                slots.append(_Skip(layer))
        if start == end and self.first and not self.last:  # no layers: the first stage ends before layer 0
            slots[0].stop = True  # type: ignore[union-attr]
        self._slot_list = slots
        return nn.ModuleList(slots)

    def forward(self, x: Tensor, position_ids: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Run this stage (see the class docstring).

        Raises:
            ValueError: ``x`` is not token ids ``(batch, seq)`` on the first stage or hidden states
                ``(batch, seq, hidden)`` on the others.
        """
        want = 2 if self.first else 3
        if x.dim() != want:
            what = "token ids (batch, seq)" if self.first else "hidden states (batch, seq, hidden)"
            raise ValueError(f"pipeline stage input of shape {tuple(x.shape)} is not valid: expected {what}.")
        kwargs: dict[str, Any] = {"use_cache": False}
        if position_ids is not None:  # else the model's own default, 0 .. seq-1
            batch = x.shape[0]
            kwargs["position_ids"] = position_ids if position_ids.dim() == 2 else position_ids.expand(batch, -1)
        for module in self._spine:
            module.training = self.training
        if self.first:
            kwargs["input_ids"] = x
        else:
            # (batch, seq, hidden): the whole sequence (this rank's x holds seq / sequence_shards tokens under SP)
            kwargs["inputs_embeds"] = x.new_zeros(x.shape[0], x.shape[1] * self.sequence_shards, *x.shape[2:])
            for receiver in self._receivers:
                receiver.received = x
        try:
            out = self._skeleton[0](**kwargs)
        except _StageOutput as stop:
            hidden = stop.hidden
        else:
            if not self.last:
                raise RuntimeError("pipeline stage: the model's forward returned before this stage's last layer")
            hidden = out.logits if hasattr(out, "logits") else out[0]
        finally:
            for receiver in self._receivers:
                receiver.received = None
        if self.last or position_ids is None:
            return hidden
        return hidden, position_ids


def pipeline_stage(network: nn.Module, layers: Sequence[str], *, first: bool, last: bool) -> HFPipelineStage:
    """A :class:`HFPipelineStage` of ``network`` running ``layers`` (plus the embedding if ``first``, the final norm
    and head if ``last``), sharing the network's parameters under their names.

    Raises:
        ValueError: see :func:`read_plan` and :class:`HFPipelineStage`.
    """
    plan = _CHECKED.get(network) or read_plan(network)
    return HFPipelineStage(network, plan, list(layers), first=first, last=last)


@torch.no_grad()
def check_stages(network: nn.Module, plan: PipelinePlan | None = None) -> None:
    """Check that stages of ``network`` compose to its own forward: 8 tokens (2 sequences, fixed ids, eval mode)
    through ``network(input_ids=...)`` and through a chain of stages of one layer each (every boundary a split can
    use). Skipped on ``meta`` weights (nothing to run; the ranks check again on real weights before the first cut).

    Raises:
        ValueError: the stages fail to run or give other logits than the model (more than ``1e-4`` of the largest
            logit), naming the model and what differs.
    """
    plan = plan or read_plan(network)
    if any(p.is_meta for p in network.parameters()):
        return
    name = type(network).__name__
    device = next(network.parameters()).device
    vocab = int(getattr(network.config, "vocab_size", 2) or 2)
    ids = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(0)).to(device)
    modes = {m: m.training for m in network.modules()}
    network.eval()
    try:
        ref = network(input_ids=ids, use_cache=False)
        ref = ref.logits if hasattr(ref, "logits") else ref[0]
        names = [f"{plan.layers}.{i}" for i in range(plan.num_layers)]
        out: Any = ids
        try:
            for i, layer in enumerate(names):
                stage = HFPipelineStage(network, plan, [layer], first=i == 0, last=i == len(names) - 1)
                stage.eval()
                out = stage(out)
        except Exception as err:  # noqa: BLE001 - any failure of the stage path is the model's refusal
            raise ValueError(
                f"pipeline parallelism (pp_size > 1) is not valid for {name} "
                f"(model_type={getattr(network.config, 'model_type', None)!r}): its forward cannot be run stage by "
                f"stage ({type(err).__name__}: {err}). Use pp_size=1."
            ) from err
    finally:
        for module, mode in modes.items():
            module.training = mode
    gap = float((out.float() - ref.float()).abs().max())
    scale = float(ref.float().abs().max())
    if not gap <= 1e-4 * max(scale, 1e-30):
        raise ValueError(
            f"pipeline parallelism (pp_size > 1) is not valid for {name} "
            f"(model_type={getattr(network.config, 'model_type', None)!r}): its forward run stage by stage gives other "
            f"logits than in one piece (largest difference {gap:.3g} of logits up to {scale:.3g} on a probe of 8 "
            f"tokens): it computes something across its decoder layers that a stage boundary cuts. Use pp_size=1."
        )
