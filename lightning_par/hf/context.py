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
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["ATTENTION", "mask_free_attention"]

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
