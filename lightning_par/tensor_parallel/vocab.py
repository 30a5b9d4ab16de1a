"""Vocabulary padding and the vocab-parallel cross-entropy.

The token embedding and the LM head are split over the vocabulary (Megatron-LM, Shoeybi et al. 2019, §3, "input
embedding ... parallelized along the vocabulary dimension"), so each of the ``tp_size`` ranks holds an equal slice of
``padded_vocab`` rows. When ``vocab_size`` is not a multiple of ``tp_size`` the tables are padded, as Megatron does
(``--make-vocab-size-divisible-by``). Here the padding never changes the loss: padded embedding rows are never looked
up (token ids are ``< vocab_size``), and the padded logits are set to the most negative finite value of their dtype,
so their softmax probability is exactly 0, their gradient is exactly 0, and the padded LM-head rows (initialised to 0)
stay 0 under AdamW, weight decay included.

The padding is kept *in* the parameters (so the shards are equal and the DTensor collectives need no uneven cases).
:func:`strip_vocab_padding` removes it from a gathered state dict, so it compares with (and loads into) the unpadded
model; a padded module records its real vocabulary in the attribute :data:`VOCAB_SIZE_ATTR`.

The cross-entropy never gathers the logits: :func:`vocab_parallel_loss` is torch's ``loss_parallel`` context, under
which ``F.cross_entropy`` on logits sharded on the class dimension all-reduces only the per-token max, sum of
exponentials and target logit (three ``(tokens,)`` vectors) — Megatron's vocab-parallel cross-entropy.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

__all__ = [
    "VOCAB_SIZE_ATTR",
    "mask_padded_logits",
    "pad_rows",
    "padded_vocab_size",
    "strip_vocab_padding",
    "vocab_parallel_loss",
]

#: Attribute set on a vocab-parallel ``nn.Embedding`` / ``nn.Linear`` whose weight was padded: the real vocab size.
VOCAB_SIZE_ATTR = "tp_vocab_size"


def padded_vocab_size(vocab_size: int, tp_size: int, multiple: int = 1) -> int:
    """Smallest multiple of ``multiple * tp_size`` that is ``>= vocab_size``.

    Args:
        vocab_size: number of real token ids.
        tp_size: tensor-parallel ranks that split the vocabulary.
        multiple: extra per-rank alignment (Megatron's ``make_vocab_size_divisible_by``; 1 pads the least).

    Returns:
        The padded vocabulary size (``vocab_size`` itself when it already divides evenly).

    Raises:
        ValueError: a non-positive argument.
    """
    for name, value in (("vocab_size", vocab_size), ("tp_size", tp_size), ("multiple", multiple)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is not valid: expected a positive integer.")
    step = multiple * tp_size
    return -(-vocab_size // step) * step


def pad_rows(param: nn.Parameter, rows: int) -> nn.Parameter:
    """A new parameter with ``rows - param.shape[0]`` zero rows appended (``param`` itself when nothing to add).

    Args:
        param: ``(vocab_size, ...)`` weight or ``(vocab_size,)`` bias.
        rows: padded size of dim 0.
    """
    extra = rows - param.shape[0]
    if extra <= 0:
        return param
    with torch.no_grad():
        padded = torch.cat([param.detach(), param.new_zeros((extra, *param.shape[1:]))], dim=0)
    return nn.Parameter(padded, requires_grad=param.requires_grad)


def mask_padded_logits(local_logits: Tensor, first_column: int, vocab_size: int) -> Tensor:
    """Set the logits of padded vocabulary entries to the dtype's most negative finite value.

    Args:
        local_logits: this rank's slice ``(..., padded_vocab / tp_size)`` of the logits.
        first_column: global vocabulary index of the slice's first column.
        vocab_size: number of real token ids; columns ``>= vocab_size`` are padding.

    Returns:
        ``local_logits`` with padded columns masked (a new tensor; autograd gives them a zero gradient).
    """
    if first_column + local_logits.shape[-1] <= vocab_size:  # no padded column: decided on the host, no device read
        return local_logits
    columns = torch.arange(first_column, first_column + local_logits.shape[-1], device=local_logits.device)
    padded = columns >= vocab_size
    return local_logits.masked_fill(padded, torch.finfo(local_logits.dtype).min)


def strip_vocab_padding(module: nn.Module, state_dict: dict[str, Tensor], prefix: str = "") -> dict[str, Tensor]:
    """Remove vocabulary padding from a *gathered* (full-tensor) state dict of ``module``.

    Args:
        module: the tensor-parallel module whose padded submodules carry :data:`VOCAB_SIZE_ATTR`.
        state_dict: full tensors keyed by ``module``'s parameter names (e.g. from ``.full_tensor()``).
        prefix: prefix of ``module``'s names inside ``state_dict`` (e.g. ``"model."``).

    Returns:
        A new dict in which each padded weight/bias keeps only its first ``vocab_size`` rows.
    """
    out = dict(state_dict)
    for name, sub in module.named_modules():
        vocab = getattr(sub, VOCAB_SIZE_ATTR, None)
        if vocab is None:
            continue
        for pname, _ in sub.named_parameters(recurse=False):
            key = prefix + (f"{name}.{pname}" if name else pname)
            if key in out:
                out[key] = out[key][:vocab]
    return out


@contextmanager
def vocab_parallel_loss() -> Generator[None, None, None]:
    """Context in which ``F.cross_entropy`` on vocab-sharded DTensor logits runs without gathering them.

    Torch's ``loss_parallel`` (the distributed log-softmax and NLL of Megatron's vocab-parallel cross-entropy); the
    backward pass must also run inside it. Logits must be a DTensor sharded on the class dimension (the output of a
    ``"vocab_head"``), targets plain token ids replicated over the tp ranks.
    """
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        yield
