"""Check, in one process and before any split, that each split region of a plan computes on a part what the model
computes whole.

A *split region* is a module planned ``colwise_input`` (Megatron's ``f``/``g`` in front of it) with ``colwise``
layers inside: an attention split by heads, an MLP by its intermediate features. Under tensor parallelism each rank
runs the region's own ``forward`` on its part: the column-parallel layers give this rank's slice of their output
features, whatever the model computes between them and the row-parallel layers (reshapes into heads, per-head norms,
an activation with learned parameters, the attention) runs on that slice, and the row-parallel layers' partial
outputs are summed over the ranks. That is right only if the code in between treats each part on its own: a norm
over all of a projection's features, a mask built for every head, or a count of heads read from the config, computes
something else (or fails) on a part.

:func:`check_split_regions` runs the model once on a sample (recording each region's inputs and output), then each
region again per rank with its column layers cut to that rank's features and its row layers to that rank's inputs,
the row layers' outputs summed over the simulated ranks (Megatron's all-reduce), and compares every rank's output with
the whole one. The parameters the plan leaves out inside a region then get, on each rank, the gradient of its part of
the region's output: a partial sum over the ranks, which the plan sums (``replicate_grad_sum``). A region that reduces
over the ranks more than once (a row layer's summed output used again by split code inside the region, whose gradient
the next split layer would take from this rank's part only) is refused too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_par.tensor_parallel.styles import transposed_linear_features

__all__ = ["check_split_regions", "split_regions"]

#: Relative tolerance of a region's simulated output against the whole one (of its largest entry) in fp32; in a lower
#: precision ``16 * eps`` of its dtype (bf16: 0.125), since the row layers' partial sums round apart there. A region
#: that is wrong on a part (a norm over all of a projection's features taken over half of them) is off by about the
#: size of its outputs.
REGION_RTOL = 1e-4

_LAYER_STYLES = ("colwise", "rowwise", "colwise_gather", "rowwise_split")


def split_regions(plan: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """``{region path: {path inside it, relative: linear style}}`` for every ``colwise_input`` module of an expanded
    plan (exact paths) that holds a ``colwise`` layer."""
    out = {}
    for path, style in plan.items():
        if style != "colwise_input" or not path:
            continue
        inner = {p[len(path) + 1:]: s for p, s in plan.items()
                 if p.startswith(path + ".") and isinstance(s, str) and s in _LAYER_STYLES}
        if "colwise" in inner.values():
            out[path] = inner
    return out


def _first_tensor(out: Any) -> Tensor | None:
    if isinstance(out, Tensor):
        return out
    if isinstance(out, Mapping):
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        return next((o for o in out if isinstance(o, Tensor)), None)
    return None


def _weight_part(layer: nn.Module, rank: int, tp_size: int, dim_of_linear: int) -> Tensor:
    """This rank's part of a linear layer's weight: of its output features (``dim_of_linear=0``) or input features (1)
    of an ``nn.Linear`` weight ``(out, in)``; the other dim of a transposed one ``(in, out)``."""
    weight = layer.weight
    dim = dim_of_linear if transposed_linear_features(layer) is None else 1 - dim_of_linear
    size = weight.shape[dim] // tp_size
    return weight.narrow(dim, rank * size, size)


def _matmul(layer: nn.Module, x: Tensor, weight: Tensor) -> Tensor:
    return x @ (weight if transposed_linear_features(layer) is not None else weight.t())


@contextmanager
def _simulated(region: nn.Module, inner: Mapping[str, str], rank: int, tp_size: int, summed: list[Tensor],
               partials: list[tuple[Tensor, Any]]) -> Any:
    """The region's linear layers as rank ``rank`` of ``tp_size`` runs them: column layers give this rank's output
    features; row layers this rank's partial sum (recorded in ``partials``) or, for the first ``len(summed)`` calls,
    the sum over the ranks (a row layer's bias added once, to the sum)."""
    saved: dict[nn.Module, Any] = {}

    def column(layer: nn.Module) -> Callable[[Tensor], Tensor]:
        def forward(x: Tensor) -> Tensor:
            out = type(layer).forward(layer, x)
            size = out.shape[-1] // tp_size
            return out.narrow(-1, rank * size, size)
        return forward

    def row(layer: nn.Module, split_input: bool) -> Callable[[Tensor], Tensor]:
        def forward(x: Tensor) -> Tensor:
            if split_input:
                size = x.shape[-1] // tp_size
                x = x.narrow(-1, rank * size, size)
            part = _matmul(layer, x, _weight_part(layer, rank, tp_size, 1))
            index = len(partials)
            bias = layer.bias if getattr(layer, "bias", None) is not None else 0
            partials.append((part, bias))
            return summed[index] if index < len(summed) else part + bias
        return forward

    try:
        for path, style in inner.items():
            layer = region.get_submodule(path)
            saved[layer] = layer.__dict__.get("forward")
            if style == "colwise":
                layer.forward = column(layer)
            elif style in ("rowwise", "rowwise_split"):
                layer.forward = row(layer, split_input=style == "rowwise_split")
        yield
    finally:
        for layer, previous in saved.items():
            layer.__dict__.pop("forward", None)
            if previous is not None:
                layer.forward = previous


@torch.no_grad()
def check_split_regions(root: nn.Module, plan: Mapping[str, Any], tp_size: int, run: Callable[[], Any],
                        model: str) -> None:
    """Check every split region of ``plan`` (see the module docstring) on the unsplit ``root``, in eval mode.

    Args:
        root: the module the plan's paths are relative to, with real (not ``meta``) weights: else nothing is checked.
        plan: the expanded plan (exact paths, :func:`~lightning_par.tensor_parallel.plan.expand_plan`).
        tp_size: the number of ranks to simulate.
        run: runs ``root`` once on a sample input (a few tokens).
        model: how messages name the model.

    Raises:
        ValueError: a region whose own ``forward`` fails on a rank's part, gives other outputs summed over the ranks
            than whole (more than :data:`REGION_RTOL` of its largest output), or reduces over the ranks more than once;
            the message names the region, its class and what differs.
    """
    regions = split_regions(plan)
    if not regions or tp_size < 2 or any(p.is_meta for p in root.parameters()):
        return
    captured: dict[str, tuple[tuple[Any, ...], dict[str, Any], Tensor]] = {}

    def recorder(path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
            whole = _first_tensor(out)
            if path not in captured and whole is not None:
                captured[path] = (args, kwargs, whole)
        return hook

    modes = {m: m.training for m in root.modules()}
    root.eval()
    handles = [root.get_submodule(p).register_forward_hook(recorder(p), with_kwargs=True) for p in regions]
    try:
        try:
            run()
        except Exception:  # noqa: BLE001 - a model that cannot run the sample is not this check's to judge
            return
        finally:
            for handle in handles:
                handle.remove()
        for path, inner in regions.items():
            if path in captured:
                _check_region(root.get_submodule(path), path, inner, tp_size, *captured[path], model)
    finally:
        for module, mode in modes.items():
            module.training = mode


def _check_region(region: nn.Module, path: str, inner: Mapping[str, str], tp_size: int, args: tuple[Any, ...],
                  kwargs: dict[str, Any], whole: Tensor, model: str) -> None:
    where = (f"tensor parallelism (tp_size={tp_size}) is not valid for {model}: its split region {path!r} "
             f"({type(region).__name__}, column-parallel {sorted(p for p, s in inner.items() if s == 'colwise')})")
    advice = ("Use tp_size=1 (zero3, pipeline or context parallelism), or pass strategy.tensor_parallel.plan with "
              "this module's layers gathered ('colwise_gather' / 'rowwise_split').")
    summed: list[Tensor] = []
    while True:
        outputs, calls = [], []
        for rank in range(tp_size):
            partials: list[tuple[Tensor, Any]] = []
            with _simulated(region, inner, rank, tp_size, summed, partials):
                try:
                    out = _first_tensor(region(*args, **kwargs))
                except Exception as err:  # noqa: BLE001 - reported with the region named
                    raise ValueError(
                        f"{where} fails on one rank's part of its features ({type(err).__name__}: {err}): its own "
                        f"forward computes across the heads or features the split divides. {advice}"
                    ) from err
            outputs.append(out)
            calls.append(partials)
        if len(summed) >= len(calls[0]):
            break
        index = len(summed)
        summed.append(sum(c[index][0] for c in calls) + calls[0][index][1])
    if len(summed) > 1:
        raise ValueError(
            f"{where} sums its row-parallel outputs over the ranks {len(summed)} times in one forward: an output "
            f"summed inside the region is used again by split code, whose gradient each rank would take from its "
            f"part only. {advice}"
        )
    scale = float(whole.float().abs().max())
    rtol = max(REGION_RTOL, 16 * torch.finfo(whole.dtype).eps) if whole.is_floating_point() else REGION_RTOL
    for rank, out in enumerate(outputs):
        same = out is not None and out.shape == whole.shape
        gap = float((out.float() - whole.float()).abs().max()) if same else float("inf")
        if not gap <= rtol * max(scale, 1e-30):
            raise ValueError(
                f"{where} computes on one rank's part of its features other outputs than whole (rank {rank} of "
                f"{tp_size}: largest difference {gap:.3g} of outputs up to {scale:.3g} on a sample): its own forward "
                f"computes across the heads or features the split divides. {advice}"
            )
