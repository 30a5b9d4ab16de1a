"""Where a network is cut into pipeline stages, and the cutting itself.

A *layer* is the unit a stage boundary can fall between: a transformer block of the reference
:class:`~lightning_par.models.GPT` (whose embeddings always go to the first stage and whose final norm and head go
to the last), or a child of an ``nn.Sequential`` / ``nn.ModuleList`` network (run in order).

Boundaries (layer counts per virtual stage, in stage order) come from

* ``"params"`` (default): balance the parameter count (memory) of the stages;
* ``"time"``: balance the measured forward + backward time of each layer, profiled with fairscale's
  ``profile_times`` (the profiler behind ``fairscale.nn.pipe.balance.balance_by_time``, torchgpipe by Kim et al.
  2020, §3.3);
* ``"size"``: balance the memory each layer needs in training, profiled with fairscale's ``profile_sizes`` (behind
  ``balance_by_size``; CUDA only, as fairscale measures CUDA allocations);
* an explicit list of layer counts, as fairscale's ``Pipe(balance=...)``.

Given per-layer costs, :func:`balance_costs` finds the contiguous partition that minimises the costliest stage
(exactly, by dynamic programming over the cut points), counting the embeddings on the first stage and the head on the
last. fairscale is imported only for ``"time"`` and ``"size"``.

Cutting (:func:`cut_network`) keeps every parameter's name (FQN) as in the whole model (``blocks.3.attn.q_proj.weight``
on whichever stage holds block 3), so a checkpoint of the stages is a checkpoint of the whole model.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_par.models.gpt import GPT

__all__ = [
    "SPLIT_METHODS",
    "balance_costs",
    "cut_network",
    "gpt_stage_view",
    "layer_costs",
    "network_layers",
    "plan_split",
    "validate_split",
]

#: Automatic ways of placing the stage boundaries (an explicit list of layer counts is the other way).
SPLIT_METHODS: tuple[str, ...] = ("params", "time", "size")


def network_layers(network: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers a pipeline boundary may fall between, with their names, in execution order.

    Args:
        network: a :class:`~lightning_par.models.GPT` (layers: its blocks; the GPT may already be cut, then only the
            blocks it holds are listed), an ``nn.Sequential`` or an ``nn.ModuleList`` (layers: its children).

    Raises:
        ValueError: any other kind of network (the message lists the supported ones).
    """
    if isinstance(network, GPT):
        return [(f"blocks.{k}", block) for k, block in network.blocks.items()]
    if isinstance(network, (nn.Sequential, nn.ModuleList)):
        return list(network.named_children())
    raise ValueError(
        f"a network of type {type(network).__name__} cannot be split into pipeline stages: expected the reference "
        f"GPT (lightning_par.models.GPT), an nn.Sequential or an nn.ModuleList of layers run in order."
    )


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


def _gpt_ends(network: GPT) -> tuple[list[nn.Module], list[nn.Module]]:
    first = [m for m in (network.wte, network.wpe) if m is not None]
    last = [m for m in (network.ln_f, network.lm_head) if m is not None]
    return first, last


def _num_params(modules: Sequence[nn.Module]) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def _profile_modules(network: nn.Module) -> nn.Sequential:
    """An ``nn.Sequential`` view of the network for fairscale's profilers: for the GPT, ``[embeddings, blocks...,
    norm + head]``."""
    if isinstance(network, GPT):
        keys = list(network.blocks.keys())
        parts = [gpt_stage_view(network, [], first=True, last=False)]
        parts += [network.blocks[k] for k in keys]
        parts.append(gpt_stage_view(network, [], first=False, last=True))
        return nn.Sequential(*parts)
    if isinstance(network, nn.ModuleList):
        return nn.Sequential(*network)
    return network  # type: ignore[return-value]


def layer_costs(
    network: nn.Module,
    method: str = "params",
    sample: torch.Tensor | None = None,
    *,
    num_microbatches: int = 1,
    param_scale: float = 2.0,
    timeout_s: float = 1.0,
    device: torch.device | str = "cpu",
) -> tuple[list[float], float, float]:
    """Cost of each layer under ``method``, plus the costs pinned to the first and last stage.

    Args:
        network: see :func:`network_layers`.
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
        ``(per-layer costs, first-stage extra, last-stage extra)``; the extras are the GPT's embeddings and head
        (zero for other networks).

    Raises:
        ValueError: an unknown method, a missing sample, ``"size"`` without CUDA, or fairscale not installed.
    """
    layers = network_layers(network)
    first, last = _gpt_ends(network) if isinstance(network, GPT) else ([], [])
    if method == "params":
        return [float(_num_params([m])) for _, m in layers], float(_num_params(first)), float(_num_params(last))
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
    seq = _profile_modules(network)
    grads_before = [p.grad for p in seq.parameters()]
    for p in seq.parameters():  # fairscale refuses modules that already hold gradients
        p.grad = None
    try:
        if method == "time":
            raw = profile_times(seq, sample, timeout_s, device)
        else:
            raw = profile_sizes(seq, sample, num_microbatches, param_scale, device)
    finally:
        for p, g in zip(seq.parameters(), grads_before):
            p.grad = g
    costs = [float(c) for c in raw]
    if isinstance(network, GPT):
        return costs[1:-1], costs[0], costs[-1]
    return costs, 0.0, 0.0


def plan_split(
    network: nn.Module,
    num_stages: int,
    split: str | Sequence[int] = "params",
    sample: torch.Tensor | None = None,
    **profile: Any,
) -> list[int]:
    """Layer counts per virtual stage.

    Args:
        network: see :func:`network_layers`.
        num_stages: virtual stages.
        split: a method of :data:`SPLIT_METHODS` or explicit layer counts.
        sample: input batch for the profiling methods.
        **profile: passed to :func:`layer_costs` (``timeout_s``, ``device``, ``num_microbatches``, ``param_scale``).

    Raises:
        ValueError: see :func:`validate_split` and :func:`layer_costs`.
    """
    layers = network_layers(network)
    validate_split(split, len(layers), num_stages)
    if not isinstance(split, str):
        return list(split)
    costs, first, last = layer_costs(network, split, sample, **profile)
    return balance_costs(costs, num_stages, first, last)


def gpt_stage_view(network: GPT, block_keys: Sequence[str], first: bool, last: bool) -> GPT:
    """A :class:`GPT` that shares ``network``'s modules but runs only ``block_keys`` (plus the embeddings if
    ``first``, and the final norm and head if ``last``). No parameter is copied; names stay those of the whole model."""
    view = GPT.__new__(GPT)
    nn.Module.__init__(view)
    view.config = network.config
    view.wte = network.wte if first else None
    view.wpe = network.wpe if first else None
    view.drop = network.drop
    view.blocks = nn.ModuleDict({k: network.blocks[k] for k in block_keys})
    view.ln_f = network.ln_f if last else None
    view.lm_head = network.lm_head if last else None
    return view


def cut_network(network: nn.Module, counts: Sequence[int], stages: Sequence[int]) -> tuple[nn.Module, list[nn.Module]]:
    """Keep only the virtual stages ``stages`` of ``network``: the module this rank holds, and one runnable module per
    stage.

    Args:
        network: the whole network (see :func:`network_layers`); a GPT is cut in place (parts it does not hold are set
            to ``None`` or deleted), an ``nn.Sequential``/``nn.ModuleList`` is left as it is.
        counts: layers per virtual stage (all stages of the pipeline), e.g. from :func:`plan_split`.
        stages: the virtual stages this rank runs, in chunk order (see
            :func:`~lightning_par.pipeline_parallel.schedules.stage_ids`).

    Returns:
        ``(holder, chunks)``. ``holder`` owns every parameter of this rank under its whole-model name (put it where
        the network was, so the optimizer and checkpoints see it); ``chunks[c]`` runs virtual stage ``stages[c]``
        and shares the holder's modules.

    Raises:
        ValueError: ``counts`` does not cover the network's layers.
    """
    layers = network_layers(network)
    validate_split(list(counts), len(layers), len(counts))
    bounds = [0]
    for n in counts:
        bounds.append(bounds[-1] + n)
    last_stage = len(counts) - 1
    if isinstance(network, GPT):
        keys = [name.split(".", 1)[1] for name, _ in layers]
        chunks = [
            gpt_stage_view(network, keys[bounds[s] : bounds[s + 1]], first=s == 0, last=s == last_stage) for s in stages
        ]
        kept = {k for chunk in chunks for k in chunk.blocks.keys()}
        for k in keys:
            if k not in kept:
                del network.blocks[k]
        if 0 not in stages:
            network.wte = network.wpe = None
        if last_stage not in stages:
            network.ln_f = network.lm_head = None
        return network, chunks
    chunk_layers = [OrderedDict(layers[bounds[s] : bounds[s + 1]]) for s in stages]
    holder = nn.Sequential(OrderedDict((name, m) for part in chunk_layers for name, m in part.items()))
    return holder, [nn.Sequential(part) for part in chunk_layers]
