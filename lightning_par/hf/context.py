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
model takes (``config.max_position_embeddings``): the ring and all-to-all attention have no window.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["ATTENTION", "attention_windows", "check_hf_context_parallel", "mask_free_attention"]

#: The name of the attention implementation used under context parallelism.
ATTENTION = "lightning_par_cp_sdpa"


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
    if attention_mask is not None and shard is not None:
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

    if ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION, _attention)


@contextmanager
def mask_free_attention(network: nn.Module) -> Generator[None, None, None]:
    """While active, ``network`` (a ``PreTrainedModel``) attends through :data:`ATTENTION` (see the module
    docstring); its previous attention implementation is restored on exit."""
    _register()
    config = network.config
    previous = config._attn_implementation
    config._attn_implementation = ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = previous


def attention_windows(network: nn.Module) -> dict[str, int]:
    """The sliding windows of ``network``'s attention, in tokens: ``{attention module path: window}`` for every
    attention module with an integer ``sliding_window`` attribute (transformers sets it per layer type); a model whose
    attention modules have no such attribute but whose ``config.sliding_window`` is an integer (Mistral) gets
    ``{"config.sliding_window": window}``."""
    found: dict[str, int] = {}
    has_attribute = False
    for name, module in network.named_modules():
        if "sliding_window" in vars(module):
            has_attribute = True
            if isinstance(module.sliding_window, int) and not isinstance(module.sliding_window, bool):
                found[name] = module.sliding_window
    window = getattr(getattr(network, "config", None), "sliding_window", None)
    if not has_attribute and isinstance(window, int) and not isinstance(window, bool):
        found["config.sliding_window"] = window
    return found


def check_hf_context_parallel(network: nn.Module, cp_size: int) -> None:
    """Refuse, before start, a Hugging Face model whose attention the context-parallel path cannot compute (see the
    module docstring).

    Raises:
        ValueError: an attention module with logit soft-capping (``attn_logit_softcapping``) or sinks (a ``sinks``
            parameter), an architecture transformers does not run with SDPA, or a sliding window shorter than
            ``config.max_position_embeddings``. The message names the module or config field and the value.
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
        sinks = module._parameters.get("sinks")
        if sinks is not None:
            raise ValueError(
                f"{intro}: {path} has attention sinks ({path}.sinks, shape {tuple(sinks.shape)}), which the "
                f"context-parallel attention does not compute. Use cp_size=1."
            )
    if getattr(type(network), "_supports_sdpa", True) is False:
        raise ValueError(
            f"{intro}: transformers does not run its attention with SDPA ({type(network).__name__}._supports_sdpa is "
            f"False), and context-parallel attention computes what SDPA does. Use cp_size=1."
        )
    longest = getattr(network.config, "max_position_embeddings", None)
    for path, window in attention_windows(network).items():
        if not isinstance(longest, int) or window < longest:
            raise ValueError(
                f"{intro}: {path} attends within a sliding window of {window} tokens (config.sliding_window), shorter "
                f"than the sequences the model takes (config.max_position_embeddings={longest}); context-parallel "
                f"attention is causal over the whole sequence and has no window. Use cp_size=1, or a config with "
                f"sliding_window >= max_position_embeddings (or null) if your sequences never exceed the window."
            )
