"""Where a network is cut into pipeline stages, and the cutting itself, for any network that meets the model contract
(:mod:`lightning_par.contract`: ``pipeline_layers()`` / ``pipeline_stage()``, or an ``nn.Sequential``/``nn.ModuleList``).

A *layer* is the unit a stage boundary can fall between (a transformer block of the reference GPT, a child of an
``nn.Sequential``). Boundaries (layer counts per virtual stage, in stage order) come from

* ``"params"`` (default): balance the parameter count (memory) of the stages;
* ``"time"``: balance the measured forward + backward time of each layer, profiled with fairscale's
  ``profile_times`` (the profiler behind ``fairscale.nn.pipe.balance.balance_by_time``, torchgpipe by Kim et al.
  2020, §3.3) — fairscale is used only for this, behind an import guard: torch has no such profiler;
* ``"size"``: balance the memory each layer needs in training, fairscale's ``profile_sizes`` (CUDA only);
* an explicit list of layer counts, as fairscale's ``Pipe(balance=...)``.

Given per-layer costs, :func:`balance_costs` finds the contiguous partition that minimises the costliest stage
(exactly, by dynamic programming over the cut points), counting what the first stage runs before its first layer
(embeddings) and what the last stage runs after its last (final norm, head).

Cutting (:func:`cut_network`) builds this rank's stage modules with the contract and a *holder*: a copy of the network's
module tree pruned to the parameters this rank's stages use, under their whole-model names
(``blocks.3.attn.q_proj.weight`` on whichever stage holds block 3), so the optimizer, tensor parallelism (whose plan
paths are relative to the network) and checkpoints see the same names as in one process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_par import contract
from lightning_par.compat import module_copy
from lightning_par.pipeline_parallel.options import SPLIT_METHODS

__all__ = [
    "SPLIT_METHODS",
    "balance_costs",
    "cut_network",
    "layer_costs",
    "plan_split",
    "prune_to",
    "validate_split",
]


def validate_split(split: str | Sequence[int], num_layers: int, num_stages: int, pp_size: int | None = None) -> None:
    """Check a split option against the model and the pipeline.

    Args:
        split: one of :data:`SPLIT_METHODS`, or a list of layer counts, one per virtual stage.
        num_layers: layers of the model (GPT blocks, children of an ``nn.Sequential``).
        num_stages: virtual stages (``pp_size * virtual_stages``).
        pp_size: only to word the messages.

    Raises:
        ValueError: an unknown method; fewer layers than virtual stages; an explicit list with a wrong number of
            entries, an entry below 1, or counts that do not add up to ``num_layers`` (it does not cover the model).
    """
    layout = f"{num_stages} virtual stages" + (
        f" (pp_size={pp_size} x virtual_stages={num_stages // pp_size})" if pp_size else ""
    )
    if num_layers < num_stages:
        raise ValueError(
            f"the model has {num_layers} layers but the pipeline has {layout}: expected at least one layer per virtual "
            f"stage; use fewer stages or a deeper model."
        )
    if isinstance(split, str):
        if split not in SPLIT_METHODS:
            raise ValueError(
                f"split={split!r} is not valid: expected one of {list(SPLIT_METHODS)} or a list of layer counts per "
                f"virtual stage."
            )
        return
    if not isinstance(split, Sequence) or not all(isinstance(n, int) and not isinstance(n, bool) for n in split):
        raise ValueError(
            f"split={split!r} is not valid: expected one of {list(SPLIT_METHODS)} or a list of integer layer counts "
            f"per virtual stage."
        )
    counts = list(split)
    if len(counts) != num_stages:
        raise ValueError(
            f"split={counts} has {len(counts)} entries but the pipeline has {layout}: expected one layer count per "
            f"virtual stage."
        )
    if min(counts) < 1:
        raise ValueError(f"split={counts} is not valid: every virtual stage needs at least one layer (counts >= 1).")
    if sum(counts) != num_layers:
        raise ValueError(
            f"split={counts} does not cover the model: its layer counts add up to {sum(counts)} but the model has "
            f"{num_layers} layers; expected {num_stages} counts >= 1 adding up to {num_layers}."
        )


def balance_costs(
    costs: Sequence[float], num_stages: int, first_extra: float = 0.0, last_extra: float = 0.0
) -> list[int]:
    """Cut ``costs`` into ``num_stages`` contiguous, non-empty groups so that the costliest group is as cheap as
    possible (linear partition by dynamic programming, O(stages x layers^2)).

    Args:
        costs: cost of each layer, in order (parameters, seconds, bytes, ...).
        num_stages: groups to make.
        first_extra: cost added to the first group (e.g. the GPT's embeddings).
        last_extra: cost added to the last group (e.g. the GPT's final norm and head).

    Returns:
        Layers per group. Among optimal partitions, the one whose groups are cut earliest is returned.

    Raises:
        ValueError: fewer layers than groups, or ``num_stages < 1``.
    """
    n = len(costs)
    if num_stages < 1 or n < num_stages:
        raise ValueError(f"cannot cut {n} layers into num_stages={num_stages} non-empty stages.")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))

    def group(j: int, lo: int, hi: int) -> float:  # cost of group j holding layers [lo, hi)
        extra = (first_extra if j == 0 else 0.0) + (last_extra if j == num_stages - 1 else 0.0)
        return prefix[hi] - prefix[lo] + extra

    inf = float("inf")
    # best[j][i]: smallest max-cost of putting layers [0, i) into groups 0..j; cut[j][i]: where group j starts.
    best = [[inf] * (n + 1) for _ in range(num_stages)]
    cut = [[0] * (n + 1) for _ in range(num_stages)]
    for i in range(1, n + 1):
        best[0][i] = group(0, 0, i)
    for j in range(1, num_stages):
        for i in range(j + 1, n + 1):
            for lo in range(j, i):
                value = max(best[j - 1][lo], group(j, lo, i))
                if value < best[j][i] - 1e-12 * max(1.0, abs(value)):
                    best[j][i], cut[j][i] = value, lo
    counts, hi = [], n
    for j in range(num_stages - 1, 0, -1):
        lo = cut[j][hi]
        counts.append(hi - lo)
        hi = lo
    counts.append(hi)
    return counts[::-1]


def _num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _ends(network: nn.Module) -> tuple[nn.Module, nn.Module]:
    """What the first stage runs before its first layer, and the last stage after its last (as stage modules)."""
    return (
        contract.pipeline_stage(network, [], first=True, last=False),
        contract.pipeline_stage(network, [], first=False, last=True),
    )


def layer_costs(
    network: nn.Module,
    method: str = "params",
    sample: tuple[Tensor, ...] | Tensor | None = None,
    *,
    num_microbatches: int = 1,
    param_scale: float = 2.0,
    timeout_s: float = 1.0,
    device: torch.device | str = "cpu",
) -> tuple[list[float], float, float]:
    """Cost of each layer under ``method``, plus the costs pinned to the first and last stage.

    Args:
        network: a network meeting the pipeline contract (:func:`lightning_par.contract.pipeline_layers`).
        method: ``"params"`` (parameter count), ``"time"`` (microseconds of forward + backward, fairscale's
            ``profile_times``) or ``"size"`` (bytes of parameters x ``param_scale`` plus activations, fairscale's
            ``profile_sizes``).
        sample: an input batch for the profilers (token ids ``(batch, seq)`` for the GPT). Required for
            ``"time"``/``"size"``.
        num_microbatches: for ``"size"``: activations are scaled to one micro-batch.
        param_scale: for ``"size"``: copies of each parameter training holds (2 for SGD, 4-5 for Adam).
        timeout_s: for ``"time"``: profile repeatedly for this long (at least once).
        device: where to profile (``"size"`` needs a CUDA device).

    Returns:
        ``(per-layer costs, first-stage extra, last-stage extra)``; the extras are what the first stage runs before
        its first layer and the last stage after its last (the GPT's embeddings, and its final norm and head).

    Raises:
        ValueError: an unknown method, a missing sample, ``"size"`` without CUDA, or fairscale not installed.
    """
    names = contract.pipeline_layers(network)
    first, last = _ends(network)
    if method == "params":
        layers = [network.get_submodule(n) for n in names]
        return [float(_num_params(m)) for m in layers], float(_num_params(first)), float(_num_params(last))
    if method not in SPLIT_METHODS:
        raise ValueError(f"split={method!r} is not valid: expected one of {list(SPLIT_METHODS)}.")
    if sample is None:
        raise ValueError(f"split={method!r} profiles the layers and needs a sample input batch; got sample=None.")
    device = torch.device(device)
    if method == "size" and device.type != "cuda":
        raise ValueError(
            f"split='size' is not valid on device {device}: fairscale's profile_sizes measures CUDA memory; use "
            f"split='params' (parameter count) or split='time' on CPU."
        )
    try:
        from fairscale.nn.pipe.balance.profile import profile_sizes, profile_times
    except ImportError as err:  # pragma: no cover - fairscale is a dependency, but optional at run time
        raise ValueError(f"split={method!r} needs fairscale (pip install fairscale); use split='params'.") from err
    # fairscale profiles an nn.Sequential whose parts feed each other: the ends and each layer as its own stage.
    parts = [first] + [contract.pipeline_stage(network, [n], first=False, last=False) for n in names] + [last]
    seq = nn.Sequential(*parts)
    batch = sample[0] if isinstance(sample, tuple) else sample
    grads_before = [p.grad for p in seq.parameters()]
    for p in seq.parameters():  # fairscale refuses modules that already hold gradients
        p.grad = None
    try:
        if method == "time":
            raw = profile_times(seq, batch, timeout_s, device)
        else:
            raw = profile_sizes(seq, batch, num_microbatches, param_scale, device)
    finally:
        for p, g in zip(seq.parameters(), grads_before):
            p.grad = g
    costs = [float(c) for c in raw]
    return costs[1:-1], costs[0], costs[-1]


def plan_split(
    network: nn.Module,
    num_stages: int,
    split: str | Sequence[int] = "params",
    sample: tuple[Tensor, ...] | Tensor | None = None,
    **profile: Any,
) -> list[int]:
    """Layer counts per virtual stage.

    Args:
        network: see :func:`layer_costs`.
        num_stages: virtual stages.
        split: a method of :data:`SPLIT_METHODS` or explicit layer counts.
        sample: input batch for the profiling methods.
        **profile: passed to :func:`layer_costs` (``timeout_s``, ``device``, ``num_microbatches``, ``param_scale``).

    Raises:
        ValueError: see :func:`validate_split` and :func:`layer_costs`.
    """
    names = contract.pipeline_layers(network)
    validate_split(split, len(names), num_stages)
    if not isinstance(split, str):
        return list(split)
    costs, first, last = layer_costs(network, split, sample, **profile)
    return balance_costs(costs, num_stages, first, last)


def prune_to(module: nn.Module, keep: set[int]) -> nn.Module:
    """A copy of ``module``'s tree holding only the parameters whose ``id`` is in ``keep``, under the same names.

    A sub-module whose parameters are all kept (or that has none) is shared as is; one with none kept is left out;
    one with some kept is shallow-copied (same class and attributes) with its children pruned the same way. Buffers
    of a copied module are kept. Nothing is copied but the containers: the parameters are the same objects.
    """
    own = list(module.parameters())
    if all(id(p) in keep for p in own):
        return module
    pruned = module_copy(module, parameters=False)
    for name, p in module.named_parameters(recurse=False, remove_duplicate=False):
        if id(p) in keep:
            pruned.register_parameter(name, p)
    # every name of every child (a child under two names keeps both), not only the first as named_children gives
    children = [(n, c) for n, c in module.named_modules(remove_duplicate=False) if n and "." not in n]
    for name, child in children:
        child_params = list(child.parameters())
        if child_params and not any(id(p) in keep for p in child_params):
            continue
        pruned.add_module(name, prune_to(child, keep))
    return pruned


def cut_network(network: nn.Module, counts: Sequence[int], stages: Sequence[int]) -> tuple[nn.Module, list[nn.Module]]:
    """This rank's pipeline stages of ``network``, and the module that holds their parameters.

    Args:
        network: the whole network (see :func:`lightning_par.contract.pipeline_layers`); left unchanged.
        counts: layers per virtual stage (all stages of the pipeline), e.g. from :func:`plan_split`.
        stages: the virtual stages this rank runs, in chunk order (see
            :meth:`~lightning_par.pipeline_parallel.options.PipelineOptions.stage_ids`).

    Returns:
        ``(holder, modules)``. ``holder`` owns every parameter of this rank under its whole-model name (put it where
        the network was, so the optimizer and checkpoints see it; see :func:`prune_to`); ``modules[c]`` runs virtual
        stage ``stages[c]`` and shares the holder's parameters.

    Raises:
        ValueError: ``counts`` does not cover the network's layers.
    """
    names = contract.pipeline_layers(network)
    validate_split(list(counts), len(names), len(counts))
    bounds = [0]
    for n in counts:
        bounds.append(bounds[-1] + n)
    last = len(counts) - 1
    modules = [
        contract.pipeline_stage(network, names[bounds[s] : bounds[s + 1]], first=s == 0, last=s == last)
        for s in stages
    ]
    keep = {id(p) for m in modules for p in m.parameters()}
    return prune_to(network, keep), modules
