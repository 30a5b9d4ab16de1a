"""Attention masked per document, for blocks that pack several documents (``data.packing=documents``).

A packed block carries, beside its token ids, ``document_ids`` ``(batch, seq)`` int64 (which document each token
belongs to; the padding at a block's end is a document of its own whose labels are all ignored) and ``position_ids``
``(batch, seq)`` (restarting at 0 with every document). A token must attend only to earlier tokens **of its own
document**: the mask is ``causal & (document_ids[q] == document_ids[k])``.

How the mask reaches a model that was written for one unpacked sequence: while :func:`document_attention` is active,
every ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` call (the reference GPT's, a user's model's, a
Hugging Face model's through the attention implementation of :mod:`lightning_par.hf.context`) runs with that mask
instead (:class:`DocumentAttentionMode`). The kernel: on CPU, SDPA with a boolean mask built from the document ids
(FlexAttention has no backward on CPU in torch 2.13: "FlexAttention does not support backward on CPU"); on CUDA the
same call with the mask lets SDPA pick its memory-efficient kernel (a varlen / FlexAttention block mask would skip the
masked tiles; not measured here, there is no GPU on this machine).

Under context parallelism the cp attention (:class:`~lightning_par.context_parallel.attention.CPAttentionMode`) reads
:func:`active_documents` itself and masks every ring block or the all-to-all's gathered sequence the same way, so this
mode steps aside while a cp step runs. Under pipelining each stage's forward of micro-batch ``i`` runs with micro-batch
``i``'s document ids (:class:`~lightning_par.pipeline_parallel.engine.PipelineEngine`): the ids travel with the
micro-batch, not with the activations.
"""

from __future__ import annotations

import functools

from collections.abc import Callable, Generator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_par.step_context import StepVar

__all__ = [
    "DOCUMENT_IDS",
    "POSITION_IDS",
    "DocumentAttentionMode",
    "active_documents",
    "batch_document_ids",
    "document_attention",
    "document_mask",
    "recompute_context",
]

#: The batch keys of a packed block (a mapping batch), besides ``input_ids`` and ``labels``.
DOCUMENT_IDS = "document_ids"
POSITION_IDS = "position_ids"

#: ``(document ids, attention context)`` of the :func:`document_attention` scopes entered on this thread and not yet
#: left, innermost last.
_ACTIVE: StepVar[tuple[tuple[Tensor, Callable[[], Any] | None], ...]] = StepVar("document_attention", ())


def active_documents() -> Tensor | None:
    """The document ids ``(batch, seq_local)`` of the forward running now under :func:`document_attention`; ``None``
    outside one (every token sees every earlier token)."""
    active = _ACTIVE.get()
    return active[-1][0] if active else None


def recompute_context() -> Callable[[], Any]:
    """Called at a checkpointed forward (``torch.utils.checkpoint``'s ``context_fn``): what makes the context its
    recomputation in backward runs in, the document masking active at the forward; a fresh context for each
    recomputation (a zero-bubble schedule recomputes a block twice). Measured: without it, a checkpointed block
    recomputes unmasked attention in backward, and torch refuses the different saved tensors."""
    from contextlib import nullcontext

    active = _ACTIVE.get()
    if not active:
        return nullcontext
    documents, attention_context = active[-1]
    return functools.partial(document_attention, documents, attention_context)


def batch_document_ids(batch: Any) -> Tensor | None:
    """``batch["document_ids"]`` of a mapping batch (a packed block), else ``None``."""
    if isinstance(batch, Mapping):
        ids = batch.get(DOCUMENT_IDS)
        return ids if isinstance(ids, Tensor) else None
    return None


def document_mask(documents_q: Tensor, documents_k: Tensor, positions_q: Tensor | None = None,
                  positions_k: Tensor | None = None) -> Tensor:
    """Boolean attention mask ``(batch, 1, seq_q, seq_k)``: query ``i`` may attend key ``j`` iff both are in the same
    document and key ``j`` is not later.

    Args:
        documents_q: ``(batch, seq_q)`` document ids of the queries.
        documents_k: ``(batch, seq_k)`` document ids of the keys.
        positions_q: ``(seq_q,)`` global positions of the queries (context parallelism); ``None``: ``0 .. seq_q-1``.
        positions_k: ``(seq_k,)`` likewise for the keys.

    Returns:
        ``(batch, 1, seq_q, seq_k)`` bool, broadcasting over heads.
    """
    sq, sk = documents_q.shape[-1], documents_k.shape[-1]
    dev = documents_q.device
    pq = torch.arange(sq, device=dev) if positions_q is None else positions_q
    pk = torch.arange(sk, device=dev) if positions_k is None else positions_k
    causal = pk.unsqueeze(0) <= pq.unsqueeze(1)  # (seq_q, seq_k)
    same = documents_q.unsqueeze(-1) == documents_k.unsqueeze(-2)  # (batch, seq_q, seq_k)
    return (same & causal).unsqueeze(1)


class DocumentAttentionMode(TorchFunctionMode):
    """While active, a causal ``F.scaled_dot_product_attention`` without a mask attends within documents only.

    Calls with their own ``attn_mask`` or without ``is_causal`` pass unchanged (a model's own mask is the model's), as
    does every call while a context-parallel step runs (the cp attention masks by document itself).

    Args:
        documents: ``(batch, seq)`` document ids of the tokens the model runs on.

    Raises:
        ValueError: (at a call) the query's batch or sequence length differs from ``documents``'s.
    """

    def __init__(self, documents: Tensor) -> None:
        super().__init__()
        self.documents = documents

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self._attention(func, *args, **kwargs)
        return func(*args, **kwargs)

    def _attention(self, func: Callable[..., Tensor], query: Tensor, key: Tensor, value: Tensor,
                   attn_mask: Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                   scale: float | None = None, enable_gqa: bool = False) -> Tensor:
        from lightning_par.context_parallel.sequence import active_sequence_shard

        call = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
        if enable_gqa:
            call["enable_gqa"] = True
        if attn_mask is not None or not is_causal or active_sequence_shard() is not None:
            return func(query, key, value, **call)
        docs = self.documents
        sq, sk = query.shape[-2], key.shape[-2]
        if docs.dim() != 2 or docs.shape[0] != query.shape[0] or docs.shape[1] != sq or sq != sk:
            raise ValueError(
                f"document_ids of shape {tuple(docs.shape)} are not valid for an attention over queries "
                f"{tuple(query.shape)} and keys {tuple(key.shape)}: expected (batch, seq) = ({query.shape[0]}, {sq}) "
                f"with as many keys as queries (a packed block attends within itself)."
            )
        call.update(attn_mask=document_mask(docs.to(query.device), docs.to(query.device)), is_causal=False)
        return func(query, key, value, **call)


@contextmanager
def document_attention(documents: Tensor | None,
                       attention_context: Callable[[], Any] | None = None) -> Generator[None, None, None]:
    """Run the enclosed forward with attention masked per document (see the module docstring); a no-op when
    ``documents`` is ``None``.

    Args:
        documents: ``(batch, seq)`` document ids, or ``None``.
        attention_context: a factory of a context the model's attention must run in to reach
            ``scaled_dot_product_attention`` unmasked (a Hugging Face model's
            :func:`~lightning_par.hf.context.mask_free_attention`); ``None`` for models that call it directly.
    """
    if documents is None:
        yield
        return
    with _ACTIVE.scoped((*_ACTIVE.get(), (documents, attention_context))), ExitStack() as stack:
        if attention_context is not None:
            stack.enter_context(attention_context())
        stack.enter_context(DocumentAttentionMode(documents))
        yield
