"""Context parallelism for Hugging Face models: their attention reaches ``scaled_dot_product_attention`` unmasked.

Under context parallelism a rank holds two non-adjacent chunks of each sequence and the model receives their global
``position_ids`` (``0..3, 12..15`` of 16 tokens at cp 2). ``transformers`` 5.24 builds the attention mask from
``position_ids`` (``masking_utils.create_causal_mask``): it reads the jump as the start of a second packed sequence
and materialises a block mask, which would cut attention between the chunks (and which
:class:`~lightning_par.context_parallel.attention.CPAttentionMode` refuses: the mask comes from the positions).

:func:`mask_free_attention` switches the model, for one step, to the attention implementation registered here
(:data:`ATTENTION`): ``transformers``' own ``sdpa_attention_forward`` under a name that has no mask function, so
``create_causal_mask`` returns ``None`` (its path for backends "without equivalent mask creation") and the attention
calls ``F.scaled_dot_product_attention(q, k, v, is_causal=True)``, which the cp mode turns into ring or all-to-all
attention over the global positions. No padding mask is applied meanwhile (training on packed windows has none).

That path computes plain causal softmax attention over the whole sequence, whatever attention implementation the
model was built with. :func:`check_hf_context_parallel` refuses, before start, models whose attention is something
else, read from the model itself: logit soft-capping (Gemma2), attention sinks (gpt-oss), an architecture transformers
marks as not expressible by SDPA (``_supports_sdpa = False``), and a sliding window shorter than the sequences the
model takes (``config.max_position_embeddings``): the ring and all-to-all attention have no window. It also runs the
model once on a short sequence with attention cut to each position alone (:func:`check_sequence_mixing`) and refuses
what a split sequence would change outside the attention it replaces: positions the model derives itself when given
none (RoBERTa's), layers that mix the sequence outside attention (Mamba, short convolutions, linear attention,
recurrent blocks), a mask the model builds for its attention (Doge's).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

__all__ = [
    "ATTENTION", "attention_windows", "check_hf_context_parallel", "check_sequence_mixing", "mask_free_attention",
]

#: The name of the attention implementation used under context parallelism.
ATTENTION = "lightning_par_cp_sdpa"

#: Set while :func:`check_sequence_mixing` runs the model: a mask the model passes its attention is refused then too.
_PROBING: ContextVar[bool] = ContextVar("lightning_par_cp_probing", default=False)


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """``sdpa_attention_forward`` without a mask; refuses a sliding window shorter than the sequence.

    Raises:
        ValueError: the layer has a sliding window shorter than the global sequence held by the cp ranks; or the
            model passes an attention mask of its own (``create_causal_mask`` returns none under :data:`ATTENTION`,
            so a mask here was built by the model: Doge's learned dynamic mask), which would be dropped.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from lightning_par.context_parallel.sequence import active_sequence_shard

    for name in ("softcap", "s_aux"):  # checked before start (check_hf_context_parallel); never dropped silently
        if kwargs.get(name) is not None:
            raise ValueError(f"context parallelism cannot compute attention with {name}: {type(module).__name__}.")
    window = kwargs.get("sliding_window")
    shard = active_sequence_shard()
    if window and shard is not None and shard.positions is not None:
        span = int(shard.positions.max()) + 1
        if span > window:
            raise ValueError(
                f"context parallelism is not valid for {type(module).__name__} with sliding_window={window} on "
                f"sequences of {span} tokens: cp attention is causal over the whole sequence; use sequences of at "
                f"most {window} tokens or cp_size=1."
            )
    if attention_mask is not None and (shard is not None or _PROBING.get()):
        # Measured (transformers 5.24, doge at cp 2): dropping it trained with equal losses and a wrong gradient of the
        # mask's parameter (A), 2.6 AdamW steps off after 4 steps.
        raise ValueError(
            f"context parallelism is not valid for {type(module).__name__}: the model passes its own attention mask "
            f"of shape {tuple(attention_mask.shape)} (a learned or data-dependent bias, not the causal mask), which "
            f"ring and all-to-all attention cannot split; use cp_size=1."
        )
    return sdpa_attention_forward(module, query, key, value, None, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface

    from lightning_par.compat.transformers import has_attention_function

    if not has_attention_function(ATTENTION):
        AttentionInterface.register(ATTENTION, _attention)


@contextmanager
def mask_free_attention(network: nn.Module) -> Generator[None, None, None]:
    """While active, ``network`` (a ``PreTrainedModel``) attends through :data:`ATTENTION` (see the module
    docstring); its previous attention implementation is restored on exit."""
    _register()
    from lightning_par.compat.transformers import attention_implementation, set_attention_implementation

    config = network.config
    previous = attention_implementation(config)
    set_attention_implementation(config, ATTENTION)
    try:
        yield
    finally:
        set_attention_implementation(config, previous)


def attention_windows(network: nn.Module) -> dict[str, int]:
    """The sliding windows of ``network``'s attention, in tokens: ``{attention module path: window}`` for every
    attention module with an integer ``sliding_window`` attribute (transformers sets it per layer type); a model whose
    attention modules have no such attribute but whose ``config.sliding_window`` is a positive integer (Mistral) gets
    ``{"config.sliding_window": window}``, unless the config turns the window off: ``use_sliding_window=False``, or
    ``layer_types`` without a sliding layer (Qwen2-MoE keeps ``sliding_window=0`` then, and its attention modules get
    no window attribute)."""
    found: dict[str, int] = {}
    has_attribute = False
    for name, module in network.named_modules():
        if "sliding_window" in vars(module):
            has_attribute = True
            if isinstance(module.sliding_window, int) and not isinstance(module.sliding_window, bool):
                found[name] = module.sliding_window
    config = getattr(network, "config", None)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    used = getattr(config, "use_sliding_window", True) is not False and (
        not isinstance(layer_types, (list, tuple)) or any("sliding" in str(kind) for kind in layer_types))
    if not has_attribute and used and isinstance(window, int) and not isinstance(window, bool) and window > 0:
        found["config.sliding_window"] = window
    return found


def check_hf_context_parallel(network: nn.Module, cp_size: int) -> None:
    """Refuse, before start, a Hugging Face model whose attention the context-parallel path cannot compute (see the
    module docstring).

    Raises:
        ValueError: an attention module with logit soft-capping (``attn_logit_softcapping``) or sinks (a ``sinks``
            parameter), an architecture transformers does not run with SDPA, a sliding window shorter than
            ``config.max_position_embeddings``, or what :func:`check_sequence_mixing` refuses. The message names the
            module or config field and the value.
    """
    name = type(network).__name__
    intro = f"context parallelism (cp_size={cp_size}) is not valid for {name}"
    for path, module in network.named_modules():
        cap = getattr(module, "attn_logit_softcapping", None)
        if "attn_logit_softcapping" in vars(module) and cap is not None:
            raise ValueError(
                f"{intro}: {path} caps its attention logits (attn_logit_softcapping={cap}), which the "
                f"context-parallel attention (plain softmax over ring or all-to-all pieces) does not compute. Use "
                f"cp_size=1 (tensor or data parallelism split this model)."
            )
        sinks = dict(module.named_parameters(recurse=False)).get("sinks")
        if sinks is not None:
            raise ValueError(
                f"{intro}: {path} has attention sinks ({path}.sinks, shape {tuple(sinks.shape)}), which the "
                f"context-parallel attention does not compute. Use cp_size=1."
            )
    from lightning_par.compat.transformers import supports_sdpa

    if supports_sdpa(type(network)) is False:
        raise ValueError(
            f"{intro}: transformers does not run its attention with SDPA ({type(network).__name__}._supports_sdpa is "
            f"False), and context-parallel attention computes what SDPA does. Use cp_size=1."
        )
    longest = getattr(network.config, "max_position_embeddings", None)
    if longest is None and hasattr(network.config, "get_text_config"):  # a multimodal model's text part (Gemma 3)
        longest = getattr(network.config.get_text_config(), "max_position_embeddings", None)
    windows = attention_windows(network)
    for path, window in windows.items():
        if not isinstance(longest, int) or window < longest:
            raise ValueError(
                f"{intro}: {path} attends within a sliding window of {window} tokens (config.sliding_window), shorter "
                f"than the sequences the model takes (config.max_position_embeddings={longest}); context-parallel "
                f"attention is causal over the whole sequence and has no window. Use cp_size=1, or a config with "
                f"sliding_window >= max_position_embeddings (or null) if your sequences never exceed the window."
            )
    check_sequence_mixing(network, intro)


#: Tokens of the probe sequence of :func:`check_sequence_mixing`: odd and prime, so that no other dim of a tiny
#: model's activations (heads, head width, kernel sizes, hidden sizes) is mistaken for the sequence dim.
PROBE_TOKENS = 11


class _DiagonalAttention(torch.overrides.TorchFunctionMode):
    """``F.scaled_dot_product_attention`` with each query attending to its own key only: every exchange between
    positions that the context-parallel attention would carry is cut, so what still mixes positions is outside it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.scaled_dot_product_attention:
            bound = {**dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal"), args)),
                     **(kwargs or {})}
            query, key = bound["query"], bound["key"]
            bound["is_causal"] = False
            bound["attn_mask"] = torch.eye(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device)
            return func(**bound)
        return func(*args, **(kwargs or {}))


def _sequence_dim(tensor: Any, length: int) -> int | None:
    if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
        return None
    return next((d for d in range(1, tensor.dim()) if tensor.shape[d] == length), None)


def _first_tensor(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((v for v in value if isinstance(v, torch.Tensor)), None)
    if isinstance(value, dict):
        return next((v for v in value.values() if isinstance(v, torch.Tensor)), None)
    for name in ("last_hidden_state", "logits"):  # a ModelOutput
        if isinstance(getattr(value, name, None), torch.Tensor):
            return getattr(value, name)
    return None


def _differs(a: Any, b: Any, keep: int | None) -> bool:
    """Whether tensors ``a`` and ``b`` (same shape) differ anywhere but at index ``keep`` of their sequence dim."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.shape != b.shape:
        return False
    if not a.is_floating_point():  # token ids, positions, masks: compared whole (the changed token is an input)
        return keep is None and not torch.equal(a, b)
    if keep is not None:
        dim = _sequence_dim(a, PROBE_TOKENS)
        if dim is None:
            return False
        others = [i for i in range(PROBE_TOKENS) if i != keep]
        a, b = a.index_select(dim, torch.tensor(others, device=a.device)), b.index_select(
            dim, torch.tensor(others, device=b.device))
    scale = float(b.abs().max()) if b.numel() else 0.0
    return bool((a - b).abs().max() > 1e-5 * max(scale, 1e-3)) if a.numel() else False


def _record(network: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> tuple[Any, list]:
    """The logits of one forward of ``network`` under :data:`ATTENTION` with diagonal attention, and every module's
    ``(path, module, first input tensor, first output tensor)`` in the order their forwards end."""
    calls: list[tuple[str, nn.Module, Any, Any]] = []
    handles = []
    for path, module in network.named_modules():
        if module is network:
            continue

        def hook(mod: nn.Module, args: Any, kwargs: Any, out: Any, path: str = path) -> None:
            first = _first_tensor(args) if args else None
            if first is None:
                first = next((v for v in kwargs.values() if isinstance(v, torch.Tensor) and v.is_floating_point()),
                             None)
            calls.append((path, mod, first, _first_tensor(out)))

        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        with mask_free_attention(network), _DiagonalAttention():
            out = network(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return _first_tensor(out), calls


def _culprit(first: list, second: list, keep: int | None) -> str:
    """The first module (in the order forwards end: the innermost) whose input agrees between two probe runs and whose
    output does not, as ``"path (Class)"``; the network itself when none is found."""
    if len(first) == len(second):
        for (path, module, in_a, out_a), (_, _, in_b, out_b) in zip(first, second):
            if _differs(out_a, out_b, keep) and not _differs(in_a, in_b, keep):
                return f"{path} ({type(module).__name__})"
    return "its forward"


def check_sequence_mixing(network: nn.Module, intro: str) -> None:
    """Run ``network`` (a ``PreTrainedModel``) on a short sequence (:data:`PROBE_TOKENS` tokens, eval mode, no
    gradient, the random state and buffers restored) with attention that lets each position see only itself, and
    refuse what a split sequence would change:

    * positions: the logits with ``position_ids=None`` differ from those with ``position_ids = 0..seq-1``: the model
      derives its own positions otherwise (RoBERTa's start at ``padding_idx + 1`` and skip padding tokens), while
      the context-parallel path passes each shard's global positions ``0..``;
    * mixing outside attention: changing one token changes the logits at other positions, so a layer other than
      attention mixes the sequence (a state-space or recurrent layer, a convolution over time, linear attention),
      which would see only its rank's pieces;
    * a mask the model builds for its attention itself (Doge's learned dynamic mask), which the ring or all-to-all
      attention cannot take.

    Nothing is run for a model on the ``meta`` device (a check before the weights exist); each rank checks the built
    model before its first step.

    Raises:
        ValueError: one of the above, naming the module (``path (Class)``) whose output the change first reaches.
    """
    tensors = [*network.parameters(), *network.buffers()]
    if not tensors or any(t.is_meta for t in tensors):
        return
    device = tensors[0].device
    vocab = int(getattr(network.config, "vocab_size", 0) or 0)
    if vocab < 8:
        return
    special: set[Any] = set()
    for kind in ("pad", "bos", "eos"):  # an id or a list of ids
        ids = getattr(network.config, f"{kind}_token_id", None)
        special.update(ids if isinstance(ids, (list, tuple)) else [ids])
    tokens = [t for t in range(3, vocab) if t not in special][:PROBE_TOKENS + 1]
    input_ids = torch.tensor([tokens[:PROBE_TOKENS]], device=device)
    changed = input_ids.clone()
    keep = PROBE_TOKENS // 2
    changed[0, keep] = tokens[PROBE_TOKENS]
    arange = torch.arange(PROBE_TOKENS, device=device)[None]
    buffers = {name: b.detach().clone() for name, b in network.named_buffers()}
    training = {m: m.training for m in network.modules()}
    token = _PROBING.set(True)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            network.eval()
            try:
                logits, calls = _record(network, input_ids, arange)
                own_logits, own_calls = _record(network, input_ids, None)
                moved_logits, moved_calls = _record(network, changed, arange)
            except ValueError:
                raise
            except Exception as err:  # noqa: BLE001 - a model the check cannot run is not trained unchecked
                raise ValueError(
                    f"{intro}: the check of what a split sequence changes could not run the model on "
                    f"{PROBE_TOKENS} tokens ({type(err).__name__}: {err}). Use cp_size=1."
                ) from err
    finally:
        _PROBING.reset(token)
        for module, mode in training.items():
            module.training = mode
        with torch.no_grad():
            for name, value in network.named_buffers():
                if name in buffers and value.shape == buffers[name].shape:
                    value.copy_(buffers[name])
    if _differs(own_logits, logits, None):
        raise ValueError(
            f"{intro}: the model derives its own position ids when given none, and they are not 0..seq-1 "
            f"({_culprit(own_calls, calls, None)} differs given position_ids=0..seq-1); the context-parallel path "
            f"passes each shard's global positions 0..seq-1, which would train other position embeddings than one "
            f"process does. Use cp_size=1 (data, tensor or pipeline parallelism split this model)."
        )
    if _differs(moved_logits, logits, keep):
        raise ValueError(
            f"{intro}: {_culprit(calls, moved_calls, keep)} mixes the tokens of a sequence outside attention (a "
            f"state-space, recurrent, convolution-over-time or linear-attention layer): with attention cut to each "
            f"position alone, changing one token still changes the others' outputs. Context parallelism splits only "
            f"attention over the cp ranks; this layer would see only its rank's pieces of each sequence. Use "
            f"cp_size=1."
        )
