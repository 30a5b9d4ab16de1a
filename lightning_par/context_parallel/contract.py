"""What context parallelism asks of a network (:mod:`lightning_par.contract`, "context parallelism"): ``position_ids``
in its ``forward``, and optionally ``context_parallel_attention()`` (on the network or its adapter)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from lightning_par.contract import network_method

__all__ = ["check_context_parallel", "context_parallel_attention", "context_parallel_positions"]


def context_parallel_positions(network: nn.Module) -> None:
    """Check that ``network`` can run on a split sequence: its ``forward`` takes ``position_ids`` (the global positions
    of the tokens a cp rank holds; or its adapter's ``takes_position_ids()`` says that a ``**kwargs`` forward passes
    them on), since a model that computes positions from a local ``arange`` would give every
    cp rank positions ``0..S/cp-1``.

    Raises:
        ValueError: ``forward`` has no ``position_ids`` parameter; the message says what to change.
    """
    import inspect

    if "position_ids" in inspect.signature(network.forward).parameters:
        return
    takes = network_method(network, "takes_position_ids")  # a wrapper passing them on through **kwargs (PEFT)
    if callable(takes) and takes():
        return
    raise ValueError(
        f"context parallelism (cp_size > 1) is not valid for {type(network).__name__}: its forward takes no "
        f"position_ids, so positions would be computed from each rank's local piece of the sequence. Add a "
        f"position_ids argument (global positions, (seq,) or (batch, seq)) to forward and use it for position "
        f"embeddings or rotary frequencies; the LightningModule receives it as the last element of each batch."
    )


def context_parallel_attention(network: nn.Module) -> Callable[[], Any] | None:
    """``network.context_parallel_attention`` (or its adapter's): a factory of the context every context-parallel
    step runs in, for networks whose attention only reaches ``scaled_dot_product_attention`` unmasked after a change
    (Hugging Face models build a mask from ``position_ids``); ``None`` when the network has none."""
    method = network_method(network, "context_parallel_attention")
    return method if callable(method) else None


def check_context_parallel(network: nn.Module, cp_size: int) -> None:
    """``network.check_context_parallel(cp_size)`` (or its adapter's), if defined: refuse, before any step, attention
    the context-parallel path cannot compute (a Hugging Face model's logit soft-capping, attention sinks, a sliding
    window).

    Raises:
        ValueError: what the network's check raises; nothing when it defines none.
    """
    method = network_method(network, "check_context_parallel")
    if callable(method):
        method(cp_size)
