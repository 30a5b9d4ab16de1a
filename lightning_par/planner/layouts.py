"""Layouts: how a training step is spread over devices, and the enumeration of every valid one.

A :class:`Layout` fixes the mesh sizes of :class:`~lightning_par.parallel_dims.ParallelDims` (``dp_size x cp_size x
tp_size x pp_size = world_size``, ``dp_size = dp_replicate_size x dp_shard_size`` for HSDP, and ``ep_size`` borrowed
from ``dp_shard x cp``) and the choices that change memory or time without changing the mesh: the dp mode (ZeRO
stage), the micro-batching, the pipeline schedule, activation checkpointing, sequence parallelism and the
context-parallel attention (ring or all-to-all).

Validity (checked by :func:`check_layout`, used by :func:`enumerate_layouts`) comes from the runtime, not from a
rulebook of the planner's own:

* the sizes: :class:`~lightning_par.parallel_dims.ParallelDims` (the product is the world size, ``dp_replicate_size``
  divides ``dp_size``, ``ep_size`` divides ``dp_shard_size * cp_size``);
* each registered axis's rules (:func:`planner_terms`: the ``check`` of the :class:`~lightning_par.axis_registry.
  PlannerTerms` in each axis folder's ``planner.py``), built on the axis's own validators: the dp modes and HSDP
  (``data_parallel/planner.py``), whole heads and sequence parallelism (``tensor_parallel/planner.py``), the layer
  split and the schedule's rules (``pipeline_parallel/planner.py``, through :class:`~lightning_par.pipeline_parallel.
  options.PipelineOptions`), the sequence split and Ulysses' heads (``context_parallel/planner.py``, the runtime's
  own checks), experts per ep rank (``expert_parallel/planner.py``, the same function the ep axis checks a network
  with);
* the planner's own choices on top, which narrow what it enumerates to what its cost model covers: ``tp_size`` at
  most ``max_tp_size`` and, with ``devices_per_node`` given, dividing it (tensor-parallel groups inside a node;
  Narayanan et al. 2021, §3.3); the global batch split into ``dp_size * num_microbatches`` micro-batches of
  ``micro_batch_size`` sequences; one spelling per layout (``cp_method="ring"`` at ``cp_size == 1``, HSDP only under
  a ZeRO mode, ZeRO only with something to shard).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
import dataclasses
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_par.context_parallel.options import CP_METHODS
from lightning_par.data_parallel.options import DP_MODES
from lightning_par.parallel_dims import DERIVED_MESHES, ParallelDims
from lightning_par.pipeline_parallel.planner import PLANNED_SCHEDULES
from lightning_par.planner.model import ModelSpec

if TYPE_CHECKING:
    from lightning_par.axis_registry import PlannerTerms

__all__ = [
    "AXIS_OPTIONS",
    "CHECKPOINTING",
    "CP_METHODS",
    "DP_MODES",
    "SCHEDULES",
    "WORLD_SIZE_FIELDS",
    "AxisOption",
    "Layout",
    "axis_choices",
    "check_layout",
    "comm_axes",
    "comm_axis",
    "divisors",
    "enumerate_layouts",
    "planner_terms",
    "sequence_split",
    "size_fields",
]

#: The runtime's schedules whose step time the planner models (``"none"`` when ``pp_size == 1``: micro-batches are
#: gradient accumulation).
SCHEDULES: tuple[str, ...] = PLANNED_SCHEDULES
#: Activation checkpointing (Korthikanti et al. 2022): keep all, recompute attention cores, recompute whole layers.
CHECKPOINTING: tuple[str, ...] = ("none", "selective", "full")
#: The :class:`Layout` sizes whose product is the world size; the other sizes of :func:`size_fields` borrow their
#: ranks from these (HSDP's replicas from ``dp_size``, expert parallelism from ``dp_shard x cp``).
WORLD_SIZE_FIELDS: tuple[str, ...] = ("dp_size", "cp_size", "tp_size", "pp_size")


@dataclass(frozen=True)
class AxisOption:
    """An option of an axis added on the registry that the planner enumerates next to the axis's size, and that the
    planner's generic code reads from here: ``plan()``'s keyword and ``PlannerConfig``'s field (the plural, e.g.
    ``cp_methods``), the emitted override, the run-config reader and the report's column.

    Attributes:
        name: the :class:`Layout` field (``"cp_method"``).
        size: the :class:`Layout` size field of its axis (``"cp_size"``): while that size is 1 the option takes its
            first value only (one spelling per layout), and the override and the report's cell are left out.
        values: the valid values, the first the default.
        strategy_key: its key under ``strategy.`` in the run config (``conf/strategy/*.yaml``).
        header: its column in the report's tables.
    """

    name: str
    size: str
    values: tuple[str, ...]
    strategy_key: str
    header: str


#: The per-layout options of the axes added on the registry: the cp attention (ring attention or Ulysses' all-to-all,
#: :data:`~lightning_par.context_parallel.options.CP_METHODS`).
AXIS_OPTIONS: tuple[AxisOption, ...] = (
    AxisOption("cp_method", "cp_size", CP_METHODS, "context_parallel.method", "cp method"),
)


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n`` in increasing order."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Layout:
    """One way to run a training step on ``dp_size * cp_size * tp_size * pp_size`` devices.

    Args:
        dp_size: data-parallel replicas.
        tp_size: tensor-parallel ranks per layer.
        pp_size: pipeline stages.
        dp_mode: one of :data:`DP_MODES`.
        micro_batch_size: sequences per micro-batch on one replica.
        num_microbatches: micro-batches per replica per optimizer step (pipeline micro-batches, or gradient
            accumulation when ``pp_size == 1``).
        schedule: one of :data:`SCHEDULES`.
        virtual_stages: model chunks per pipeline rank (``> 1`` only for ``interleaved_1f1b``).
        activation_checkpointing: one of :data:`CHECKPOINTING`.
        sequence_parallel: shard norms/dropouts over the sequence inside tensor parallelism.
        cp_size: context-parallel ranks each sequence is split over (each holds ``seq_len / cp_size`` tokens).
        cp_method: the context-parallel attention, one of :data:`CP_METHODS` (``"ring"`` when ``cp_size == 1``).
        dp_replicate_size: HSDP replicas among the ``dp_size`` data-parallel ranks (each holds one copy of the model
            state sharded over ``dp_size / dp_replicate_size`` ranks, times ``cp_size``).
        ep_size: expert-parallel ranks, borrowed from ``dp_shard x cp`` (a MoE model's experts split over them; it
            does not multiply into the world size).
    """

    dp_size: int
    tp_size: int
    pp_size: int
    dp_mode: str = "ddp"
    micro_batch_size: int = 1
    num_microbatches: int = 1
    schedule: str = "none"
    virtual_stages: int = 1
    activation_checkpointing: str = "none"
    sequence_parallel: bool = False
    cp_size: int = 1
    cp_method: str = "ring"
    dp_replicate_size: int = 1
    ep_size: int = 1

    @property
    def world_size(self) -> int:
        """``dp_size * cp_size * tp_size * pp_size`` (:data:`WORLD_SIZE_FIELDS`)."""
        return math.prod(getattr(self, f) for f in WORLD_SIZE_FIELDS)

    def dims(self, world_size: int | None = None) -> ParallelDims:
        """The runtime's layout of these sizes on ``world_size`` devices (default: :attr:`world_size`). For the
        layout's own world size it is built once and the same object is returned on every call (read it, do not build
        meshes on it).

        Raises:
            ValueError: as :class:`~lightning_par.parallel_dims.ParallelDims` (a size that is not a positive integer,
                a product that is not ``world_size``).
        """
        if world_size is None or world_size == self.world_size:
            # built once per layout: the planner's cost model asks about a dozen times per layout (a fifth of a plan's
            # time when built each time)
            cached = self.__dict__.get("_dims")
            if cached is None:
                cached = self._build_dims(self.world_size)
                object.__setattr__(self, "_dims", cached)
            return cached
        return self._build_dims(world_size)

    def _build_dims(self, world_size: int) -> ParallelDims:
        return ParallelDims(dp_size=self.dp_size, tp_size=self.tp_size, pp_size=self.pp_size, cp_size=self.cp_size,
                            dp_replicate_size=self.dp_replicate_size, ep_size=self.ep_size, world_size=world_size)

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step: ``dp_size * num_microbatches * micro_batch_size`` (the cp ranks of a replica
        share its sequences)."""
        return self.dp_size * self.num_microbatches * self.micro_batch_size

    @property
    def mesh(self) -> str:
        """``"dp2·tp2·pp2"``; with context parallelism ``"dp2·cp2·tp2·pp1"`` (in rank order, between dp and tp);
        with HSDP ``"dp2x2·tp2·pp1"`` (replicas x shard); with expert parallelism ``"·ep2"`` after (borrowed
        ranks)."""
        r = self.dp_replicate_size
        dp = f"dp{r}x{self.dp_size // r}" if r > 1 else f"dp{self.dp_size}"
        cp = f"·cp{self.cp_size}" if self.cp_size > 1 else ""
        ep = f"·ep{self.ep_size}" if self.ep_size > 1 else ""
        return f"{dp}{cp}·tp{self.tp_size}·pp{self.pp_size}{ep}"

    def describe(self) -> str:
        """One line: mesh, dp mode, schedule, cp method (``cp_size > 1``), micro-batching, checkpointing, sequence
        parallelism."""
        sched = "" if self.pp_size == 1 else f" {self.schedule}" + (
            f"(v={self.virtual_stages})" if self.virtual_stages > 1 else "")
        cp = f" cp={self.cp_method}" if self.cp_size > 1 else ""
        return (
            f"{self.mesh} {self.dp_mode}{sched}{cp} m={self.num_microbatches} b={self.micro_batch_size}"
            f" ckpt={self.activation_checkpointing}" + (" sp" if self.sequence_parallel else "")
        )


def size_fields() -> tuple[str, ...]:
    """The :class:`Layout` size fields beyond ``dp_size``, ``tp_size`` and ``pp_size`` (those of the axes added on the
    registry: ``cp_size``, ``dp_replicate_size``, ``ep_size``; 1 = not used), read from the dataclass: the emitted
    overrides, the run-config reader and the report's columns follow a new one without an edit."""
    return tuple(f.name for f in dataclasses.fields(Layout)
                 if f.name.endswith("_size") and f.default == 1 and f.name not in ("tp_size", "pp_size",
                                                                                    "micro_batch_size"))


def axis_choices() -> dict[str, tuple[object, ...]]:
    """The per-axis choices ``plan()`` takes as keywords and ``PlannerConfig`` as fields, each with its default, in
    :class:`Layout` order: ``<size>s`` for each of :func:`size_fields` (default ``(1,)``: the axis unused), each
    followed by ``<option>s`` for its :data:`AXIS_OPTIONS` (default: every value), e.g. ``{"cp_sizes": (1,),
    "cp_methods": ("ring", "all_to_all"), "dp_replicate_sizes": (1,), "ep_sizes": (1,)}``."""
    out: dict[str, tuple[object, ...]] = {}
    for size in size_fields():
        out[f"{size}s"] = (1,)
        out.update({f"{o.name}s": o.values for o in AXIS_OPTIONS if o.size == size})
    return out


def comm_axis(size: str) -> str:
    """The axis whose communication a size field of :func:`size_fields` adds: its mesh axis (``"cp"``, ``"ep"``), or
    ``"dp"`` for a part of the data-parallel pair (``dp_replicate_size``: HSDP's all-reduce is the dp axis's); the key
    of :attr:`~lightning_par.planner.step_time.TimeBreakdown.comm_s`."""
    axis = size.removesuffix("_size")
    return "dp" if axis in DERIVED_MESHES["dp"] else axis


def comm_axes() -> tuple[str, ...]:
    """The axes added on the registry whose communication is their own (not the dp axis's), in :func:`size_fields`
    order: ``("cp", "ep")``; each is reported as ``<axis>_comm_s``."""
    return tuple(a for a in dict.fromkeys(comm_axis(size) for size in size_fields()) if a != "dp")


def sequence_split(layout: Layout) -> int:
    """Ranks each sequence's tokens are split over: the product of every registered axis's ``token_split``
    (:class:`~lightning_par.axis_registry.PlannerTerms`; context parallelism's ``cp_size``); a rank holds
    ``seq_len / sequence_split(layout)`` tokens of each of its sequences."""
    return math.prod(t.token_split(layout) for _, t in planner_terms() if t.token_split is not None)


def _check_choice(name: str, value: object, valid: Sequence[object]) -> None:
    if value not in valid:
        raise ValueError(f"{name}={value!r} is not valid: expected one of {list(valid)}.")


def _check_int(name: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} is not valid: expected an integer >= {minimum}.")


def check_layout(
    layout: Layout,
    model: ModelSpec,
    num_devices: int | None = None,
    global_batch_size: int | None = None,
    max_tp_size: int | None = None,
    devices_per_node: int | None = None,
) -> None:
    """Raise if ``layout`` cannot run ``model`` (see the module docstring for the rules).

    Args:
        layout: the layout.
        model: the model.
        num_devices: if given, the world size the layout must use.
        global_batch_size: if given, the sequences per step the layout must process.
        max_tp_size: if given, the largest tensor-parallel size allowed.
        devices_per_node: if given, ``tp_size`` must divide it (tensor-parallel groups inside a node).

    Raises:
        ValueError: the first rule broken, naming the field, its value and what would be valid.
    """
    for name in ("dp_size", "tp_size", "pp_size", "cp_size", "micro_batch_size", "num_microbatches",
                 "virtual_stages", "dp_replicate_size", "ep_size"):
        _check_int(name, getattr(layout, name))
    layout.dims(num_devices)  # the runtime's size rules
    _check_choice("activation_checkpointing", layout.activation_checkpointing, CHECKPOINTING)
    if not isinstance(layout.sequence_parallel, bool):
        raise ValueError(f"sequence_parallel={layout.sequence_parallel!r} is not valid: expected True or False.")
    if global_batch_size is not None and layout.global_batch_size != global_batch_size:
        raise ValueError(
            f"dp_size * num_microbatches * micro_batch_size = {layout.global_batch_size} is not valid: expected "
            f"global_batch_size={global_batch_size}."
        )
    if max_tp_size is not None and layout.tp_size > max_tp_size:
        raise ValueError(
            f"tp_size={layout.tp_size} is not valid: expected at most max_tp_size={max_tp_size} (tensor parallelism "
            f"stays inside a node)."
        )
    if devices_per_node is not None and devices_per_node % layout.tp_size:
        raise ValueError(
            f"tp_size={layout.tp_size} is not valid with devices_per_node={devices_per_node}: a tensor-parallel group "
            f"must lie inside one node; expected one of {divisors(devices_per_node)}."
        )
    for _, terms in planner_terms():
        if terms.check is not None:
            terms.check(layout, model)


def planner_terms() -> list[tuple[str, PlannerTerms]]:
    """``(axis name, its planner terms)`` of every registered axis that has them, in the registry's order
    (:data:`lightning_par.axes.AXES`; each axis's ``planner.py``)."""
    from lightning_par.axes import AXES  # the registry imports the axes' folders, which import the planner

    return [(axis.name, axis.planner) for axis in AXES if axis.planner is not None]


def enumerate_layouts(
    model: ModelSpec,
    num_devices: int,
    global_batch_size: int,
    *,
    max_tp_size: int | None = None,
    devices_per_node: int | None = None,
    dp_modes: Sequence[str] = DP_MODES,
    schedules: Sequence[str] = ("gpipe", "1f1b", "interleaved_1f1b"),
    checkpointing: Sequence[str] = CHECKPOINTING,
    micro_batch_sizes: Sequence[int] | None = None,
    num_microbatches: Sequence[int] | None = None,
    max_virtual_stages: int = 4,
    sequence_parallel: Sequence[bool] = (False, True),
    cp_sizes: Sequence[int] = (1,),
    cp_methods: Sequence[str] = CP_METHODS,
    dp_replicate_sizes: Sequence[int] = (1,),
    ep_sizes: Sequence[int] = (1,),
    sizes: Mapping[str, Sequence[int]] | None = None,
) -> Iterator[Layout]:
    """Every valid :class:`Layout` for ``model`` on ``num_devices`` devices at ``global_batch_size`` sequences/step.

    Args:
        model: the model.
        num_devices: world size ``N``.
        global_batch_size: sequences per optimizer step ``B``.
        max_tp_size: largest tensor-parallel size (None: no limit beyond the heads).
        devices_per_node: if given, only tensor-parallel sizes that divide it (groups inside a node).
        dp_modes: dp modes to consider (only ``"ddp"`` when ``dp_size == 1``).
        schedules: pipeline schedules to consider when ``pp_size > 1``.
        checkpointing: activation checkpointing choices.
        micro_batch_sizes: micro-batch sizes to consider (None: every divisor of ``B / dp_size``).
        num_microbatches: if given, only these micro-batch counts (e.g. the ``num_microbatches`` of a config).
        max_virtual_stages: largest number of chunks per rank for ``interleaved_1f1b``.
        sequence_parallel: sequence-parallel choices (only False when ``tp_size == 1``).
        cp_sizes: context-parallel sizes to consider; the default ``(1,)`` enumerates no context parallelism (the
            layouts of dp x tp x pp alone, in the same order).
        cp_methods: context-parallel attentions to consider when ``cp_size > 1`` (only ``"ring"`` when
            ``cp_size == 1``).
        dp_replicate_sizes: HSDP replica counts to consider (each dividing ``dp_size``; default ``(1,)``: no HSDP).
        ep_sizes: expert-parallel sizes to consider for a MoE model (each dividing ``dp_shard_size * cp_size`` and
            the experts; default ``(1,)``).
        sizes: further :func:`size_fields`, each with the sizes to consider, e.g. ``{"ep_size": (1, 2)}`` (the same
            as ``ep_sizes``; ``"cp_size"`` the same as ``cp_sizes``); they take precedence over those keywords.

    Yields:
        Valid layouts, in a deterministic order.
    """
    sizes = dict(sizes or {})
    cp_sizes = sizes.pop("cp_size", cp_sizes)  # the one added size that multiplies into the world size
    for tp in divisors(num_devices):
        if model.num_heads % tp or (max_tp_size is not None and tp > max_tp_size):
            continue
        if devices_per_node is not None and devices_per_node % tp:
            continue
        for cp in cp_sizes:
            if (num_devices // tp) % cp:
                continue
            yield from _enumerate_pp_dp(
                model, num_devices, global_batch_size, tp, cp, cp_methods if cp > 1 else ("ring",),
                dp_modes=dp_modes, schedules=schedules, checkpointing=checkpointing,
                micro_batch_sizes=micro_batch_sizes, num_microbatches=num_microbatches,
                max_virtual_stages=max_virtual_stages, sequence_parallel=sequence_parallel,
                borrowed={"dp_replicate_size": dp_replicate_sizes, "ep_size": ep_sizes, **sizes},
            )


def _enumerate_pp_dp(
    model: ModelSpec,
    num_devices: int,
    global_batch_size: int,
    tp: int,
    cp: int,
    cp_methods: Sequence[str],
    *,
    dp_modes: Sequence[str],
    schedules: Sequence[str],
    checkpointing: Sequence[str],
    micro_batch_sizes: Sequence[int] | None,
    num_microbatches: Sequence[int] | None,
    max_virtual_stages: int,
    sequence_parallel: Sequence[bool],
    borrowed: Mapping[str, Sequence[int]],
) -> Iterator[Layout]:
    """The valid layouts of :func:`enumerate_layouts` with tensor-parallel size ``tp`` and cp size ``cp``."""
    for pp in divisors(num_devices // (tp * cp)):
        if model.num_layers % pp:
            continue
        dp = num_devices // (tp * cp * pp)
        if global_batch_size % dp:
            continue
        per_replica = global_batch_size // dp
        for b in micro_batch_sizes if micro_batch_sizes is not None else divisors(per_replica):
            if per_replica % b:
                continue
            m = per_replica // b
            if num_microbatches is not None and m not in num_microbatches:
                continue
            if pp == 1:
                sched_options: list[tuple[str, int]] = [("none", 1)]
            else:
                sched_options = []
                for sched in schedules:
                    if sched == "interleaved_1f1b":
                        sched_options += [(sched, v) for v in range(2, max_virtual_stages + 1)]
                    else:
                        sched_options.append((sched, 1))
            for sched, v in sched_options:
                for mode in dp_modes if dp * cp > 1 else ("ddp",):
                    for ckpt in checkpointing:
                        for sp in sequence_parallel if tp > 1 else (False,):
                            for method in cp_methods:
                                base = Layout(dp, tp, pp, mode, b, m, sched, v, ckpt, sp, cp, method)
                                for combo in itertools.product(*borrowed.values()):
                                    layout = dataclasses.replace(base, **dict(zip(borrowed, combo)))
                                    try:
                                        check_layout(layout, model)  # ParallelDims and every axis's check
                                    except ValueError:
                                        continue
                                    if all(t.canonical(layout) for _, t in planner_terms() if t.canonical):
                                        yield layout
