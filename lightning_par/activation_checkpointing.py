"""Activation checkpointing: keep a module's inputs instead of its activations, recompute them in backward.

Chen et al. 2016 ("Training Deep Nets with Sublinear Memory Cost"): a checkpointed module keeps only its inputs
during forward; its backward runs its forward again to rebuild what autograd needs. Two granularities, as Megatron-LM
names them (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", §5):

* ``"full"``: every block (the units of :func:`lightning_par.contract.checkpoint_modules`; a transformer layer for
  the reference GPT), so a block's activations live only while its backward runs: about one forward more of compute
  for activation memory of the block inputs only;
* ``"selective"``: only the attention of every block, the part whose activations grow with the sequence length
  squared in the paper's accounting; the MLP keeps its activations. Korthikanti et al. recompute only the attention
  core (scores, softmax, dropout, weighted sum); torch's fused ``scaled_dot_product_attention`` kernels already keep
  no ``s x s`` scores, so here the unit is the attention sub-module the model names (projections included).

:func:`apply_activation_checkpointing` runs once in the composition path
(:func:`lightning_par.parallelize.parallelize`): after tensor parallelism, before the dp mode (torchtitan's order),
so FSDP2's and the tensor-parallel styles' module hooks stay outside the recomputed region (a recompute does not
all-gather a ``zero3`` block's parameters again: FSDP2 unshards them for backward). Parameter names do not change
(the module's class is swapped for a subclass whose ``forward`` is checkpointed, nothing is wrapped), so
checkpoints, ZeRO state and tensor-parallel plans are the same with and without it. The recomputation uses
``torch.utils.checkpoint`` without reentrance, restoring the RNG and autocast states, so dropout masks and mixed
precision match the first forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_par import contract
from lightning_par.axis_registry import Axis, Build

__all__ = [
    "ACTIVATION_CHECKPOINTING",
    "ACTIVATION_CHECKPOINTING_STEP",
    "apply_activation_checkpointing",
    "checkpoint_module",
    "is_checkpointed",
    "modules_at",
]

#: Valid values of the ``activation_checkpointing`` option.
ACTIVATION_CHECKPOINTING: tuple[str, ...] = ("none", "full", "selective")

_CLASSES: dict[type, type] = {}


class _Checkpointed:
    """Mixin of the swapped-in classes: ``forward`` runs under ``torch.utils.checkpoint`` while gradients are on."""

    def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201 - the module's own signature
        forward = super().forward  # type: ignore[misc]
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=_recompute_contexts, **kwargs)


def _recompute_contexts() -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
    """``(forward context, recomputation context)`` for ``torch.utils.checkpoint``'s ``context_fn``: the recomputation
    in backward attends as the forward did (torch function modes are off while autograd recomputes), under the
    context-parallel attention (outer, as each step enters it) and a packed block's document masks (inner)."""
    from lightning_par.context_parallel.attention import recompute_context as cp_context
    from lightning_par.data.doc_mask import recompute_context as documents_context

    return nullcontext(), _Recomputation(cp_context(), documents_context())


class _Recomputation:
    """The recomputation context of one checkpointed forward, made anew at each entry: torch recomputes a block once
    per backward pass through it, and a zero-bubble schedule makes two (input gradients, then weight gradients),
    where a generator's context enters only once (measured: ``AttributeError`` in contextlib at the second
    recomputation, selective activation checkpointing under ``zbv_zero_bubble``)."""

    def __init__(self, *makers: Callable[[], AbstractContextManager[Any]]) -> None:
        self._makers, self._open = makers, []

    def __enter__(self) -> None:
        stack = ExitStack()
        for make in self._makers:
            stack.enter_context(make())
        self._open.append(stack)

    def __exit__(self, *exc: object) -> bool | None:
        return self._open.pop().__exit__(*exc)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``module``'s forward is checkpointed (by :func:`checkpoint_module`)."""
    return isinstance(module, _Checkpointed)


def checkpoint_module(module: nn.Module) -> nn.Module:
    """Checkpoint ``module``'s forward in place (idempotent): its class becomes a cached subclass
    ``Checkpointed<Class>``; parameters, buffers, hooks and names are untouched.

    Returns:
        ``module``.
    """
    if is_checkpointed(module):
        return module
    cls = type(module)
    sub = _CLASSES.get(cls)
    if sub is None:
        sub = type(f"Checkpointed{cls.__name__}", (_Checkpointed, cls), {"__module__": cls.__module__})
        _CLASSES[cls] = sub
    module.__class__ = sub
    return module


def apply_activation_checkpointing(network: nn.Module, paths: Sequence[str], skip_absent: bool = False) -> list[str]:
    """Checkpoint the modules of ``network`` at ``paths`` (see :func:`lightning_par.contract.checkpoint_modules`).

    Args:
        network: the network, or under pipelining the holder of this rank's stages.
        paths: module paths relative to ``network`` (``""`` is the network itself).
        skip_absent: skip paths through parts another pipeline stage holds.

    Returns:
        The paths checkpointed on this rank.

    Raises:
        ValueError: a path that names no module (unless ``skip_absent``).
    """
    found = modules_at(network, paths, skip_absent, "activation checkpointing path")
    for module in found.values():
        checkpoint_module(module)
    return list(found)


def modules_at(network: nn.Module, paths: Sequence[str], skip_absent: bool, what: str) -> dict[str, nn.Module]:
    """``{path: module}`` for the block ``paths`` of ``network`` present on this rank (the per-block techniques:
    activation checkpointing, compile).

    Raises:
        ValueError: a path that names no module (unless ``skip_absent``), named as ``what``.
    """
    found = {}
    for path in paths:
        try:
            module = network.get_submodule(path)
        except AttributeError as err:
            if skip_absent:
                continue
            raise ValueError(f"{what} {path!r} names no module of {type(network).__name__}: {err}") from err
        if module is not None:
            found[path] = module
    return found


def _paths(network: nn.Module, mode: str) -> list[str]:
    """:func:`lightning_par.contract.checkpoint_modules`, its error standing alone: the message already says what
    activation checkpointing needs, and a chained cause from the fallback (the pipeline layers) would speak of
    pipeline stages to a run that has none."""
    try:
        return contract.checkpoint_modules(network, mode)
    except ValueError as err:
        raise ValueError(str(err)) from None


def _check(module: nn.Module, network: nn.Module, dims: Any, options: Any) -> None:
    if options.activation_checkpointing == "none":
        return
    contract.check_not_compiled(module, f"activation_checkpointing={options.activation_checkpointing!r}",
                                "wraps the modules named by their paths")
    for path in _paths(network, options.activation_checkpointing):
        try:
            network.get_submodule(path)
        except AttributeError as err:
            raise ValueError(
                f"activation_checkpointing={options.activation_checkpointing!r}: checkpoint_modules() path {path!r} "
                f"names no module of {type(network).__name__} ({err})."
            ) from err


def _read_paths(build: Build) -> None:
    """The modules to recompute, read from the whole network before any cut."""
    mode = build.options.activation_checkpointing
    if mode != "none":
        build.checkpoint_paths = _paths(build.network, mode)


def _recompute(build: Build) -> None:
    """Inside the tp styles' hooks and outside the dp mode's (torchtitan's order: TP, activation checkpointing,
    FSDP)."""
    if build.checkpoint_paths:
        build.checkpointed = apply_activation_checkpointing(
            build.network, build.checkpoint_paths, skip_absent=build.dims.pp_enabled
        )


#: Activation checkpointing: a technique on no mesh axis, in the registry for its place in ``parallelize()``.
ACTIVATION_CHECKPOINTING_STEP = Axis(
    name="activation_checkpointing",
    check=_check,
    steps=(("read", _read_paths), ("recompute", _recompute)),
)
