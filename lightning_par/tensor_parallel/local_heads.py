"""A shape error raised inside a module the tensor-parallel plan split, explained.

After ``colwise`` q/k/v projections each tp rank holds ``out_features / tp_size`` of their outputs, i.e.
``heads / tp_size`` attention heads. The reshape most models write first, ``q.view(batch, seq, n_heads, head_dim)``
with the model's whole head count, then fails on every rank with torch's bare ``shape '[16, 32, 4, 16]' is invalid for
input of size 16384``. :func:`local_heads_hint` is a context each step's forward and backward run in (the tp axis adds
it to the ``Build``'s step contexts): when such an error comes from a module the plan split (a planned module, or the
parent of a split linear layer: the attention block), it adds to the error's own message what each rank holds and what
to write instead. The exception is the user's, re-raised with the longer message: no new exception is chained above
it. Anything else passes through untouched.
"""

from __future__ import annotations

import re
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["SHAPE_ERROR", "explain_shape_error", "local_heads_hint", "split_modules"]

#: torch's messages for a view/reshape of the wrong element count, and for tensors of mismatched sizes.
SHAPE_ERROR = re.compile(r"is invalid for input of size \d+|must match the size of tensor b|view size is not compatible")

#: Styles that split a linear layer's features over the tp ranks (their parent then runs on the local share).
_SPLIT_LINEAR = ("colwise", "rowwise", "colwise_gather", "rowwise_split")
_HINT = "each rank holds heads/tp heads; reshape with -1 or the local count"


def split_modules(network: nn.Module, expanded: Mapping[str, Any]) -> dict[int, str]:
    """``id(module) -> path`` of the modules a shape error is explained in: every module of the expanded plan whose
    style splits or gathers (``colwise_input`` and the split linear styles) and the parent of every split linear."""
    out: dict[int, str] = {}
    for path, style in expanded.items():
        if not isinstance(style, str) or style not in (*_SPLIT_LINEAR, "colwise_input"):
            continue
        out[id(network.get_submodule(path))] = path
        if style in _SPLIT_LINEAR:
            parent = path.rpartition(".")[0]
            out[id(network.get_submodule(parent))] = parent
    return out


def _chain(err: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while err is not None and err not in seen:
        seen.append(err)
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
    return seen


def _innermost_split(err: BaseException, modules: Mapping[int, str]) -> nn.Module | None:
    tb, found = err.__traceback__, None
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in modules:
            found = owner
        tb = tb.tb_next
    return found


def _local_features(module: nn.Module) -> str:
    parts = []
    for name, child in module.named_children():
        weight = getattr(child, "weight", None)
        if isinstance(child, nn.Linear) and isinstance(weight, DTensor) and weight.placements[0].is_shard(0):
            parts.append(f"{name}: {weight.to_local().shape[0]} of {weight.shape[0]} output features")
    return "; ".join(parts)


def explain_shape_error(err: BaseException, modules: Mapping[int, str], tp_size: int) -> bool:
    """Lengthen the message of the shape error in ``err``'s chain when it was raised inside one of ``modules``
    (:func:`split_modules`). Returns whether it did."""
    for inner in _chain(err):
        if not (isinstance(inner, RuntimeError) and inner.args and isinstance(inner.args[0], str)):
            continue
        if not SHAPE_ERROR.search(inner.args[0]) or _HINT in inner.args[0]:
            continue
        module = _innermost_split(inner, modules)
        if module is None:
            continue
        local = _local_features(module)
        hint = (
            f"\n{modules[id(module)] or 'the network'} ({type(module).__name__}) is split by the tensor-parallel plan "
            f"(tp_size={tp_size}){': on this rank ' + local if local else ''}. Under tensor parallelism {_HINT} "
            f"(e.g. q.view(batch, seq, -1, head_dim), not the model's whole head count); see docs/your-model.md, "
            f"'Tensor parallelism of attention'."
        )
        inner.args = (inner.args[0] + hint, *inner.args[1:])
        if err is not inner and isinstance(err, RuntimeError) and err.args and isinstance(err.args[0], str):
            err.args = (err.args[0] + hint, *err.args[1:])
        return True
    return False


@contextmanager
def local_heads_hint(modules: Mapping[int, str], tp_size: int) -> Generator[None, None, None]:
    """Re-raise a shape error from a split module with :func:`explain_shape_error`'s message (the same exception)."""
    try:
        yield
    except RuntimeError as err:
        explain_shape_error(err, modules, tp_size)
        raise
