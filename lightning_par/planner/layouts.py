"""Layouts: how a training step is spread over devices, and the enumeration of every valid one.

A :class:`Layout` fixes the four mesh sizes (``dp_size x cp_size x tp_size x pp_size = world_size``, the
mesh of :class:`~lightning_par.parallel_dims.ParallelDims`: tp innermost, then cp, dp, pp outermost) and the choices
that change memory or time without changing the mesh: the dp mode (ZeRO stage), the micro-batching, the pipeline
schedule, activation checkpointing, sequence parallelism and the context-parallel attention (ring or all-to-all).

Validity (checked by :func:`check_layout`, used by :func:`enumerate_layouts`), on the runtime's own validators where
the runtime has the rule:

* the sizes: :class:`~lightning_par.parallel_dims.ParallelDims` (``dp_size * cp_size * tp_size * pp_size ==
  num_devices``, each a positive integer); the dp mode: the runtime's
  :data:`~lightning_par.data_parallel.options.DP_MODES`; the schedule, ``virtual_stages`` and ``num_microbatches``
  against ``pp_size`` and the dp mode: the runtime's :class:`~lightning_par.pipeline_parallel.options.PipelineOptions`
  and its ``check_layout`` (so ``1f1b`` needs ``num_microbatches >= pp_size``, as torch's ``Schedule1F1B``);
* context parallelism, as the runtime's cp axis (:mod:`lightning_par.context_parallel`): the method one of
  :data:`~lightning_par.context_parallel.options.CP_METHODS`; the sequence length a multiple of ``2 * cp_size``
  (causal load balancing cuts it into ``2 * cp_size`` chunks); ``all_to_all`` (Ulysses) with whole heads per rank,
  ``num_heads % (cp_size * tp_size) == 0`` (:func:`~lightning_par.context_parallel.attention.check_ulysses_heads`);
* and the planner's own choices on top, which narrow what it enumerates to what its cost model covers:
  ``tp_size`` divides the number of heads (whole heads per rank) and is at most ``max_tp_size``; with
  ``devices_per_node`` given, a tensor-parallel group lies inside one node: ``tp_size`` divides ``devices_per_node``
  (the per-layer all-reduces need the fast links; Narayanan et al. 2021, §3.3); the layers split evenly over the
  virtual stages (as Megatron-LM requires; the emitted runs pass the same split explicitly); the global batch splits
  into ``dp_size * num_microbatches`` micro-batches of ``micro_batch_size`` sequences; ``interleaved_1f1b`` with
  ``num_microbatches % pp_size == 0`` (Megatron-LM's rule, which the bubble formula assumes); the schedules it models
  (:data:`SCHEDULES`, ``"none"`` when ``pp_size == 1``); ZeRO modes only with ``dp_size * cp_size > 1`` (ZeRO shards
  over the runtime's ``dp_shard_cp`` mesh); sequence parallelism only with ``tp_size > 1`` and a per-rank sequence
  (``seq_len / cp_size`` tokens) divisible by ``tp_size``; ``cp_method="ring"`` when ``cp_size == 1`` (nothing to
  split: one spelling per layout).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from lightning_par.context_parallel.attention import _check_seq_len as check_cp_seq_len
from lightning_par.context_parallel.attention import check_ulysses_heads
from lightning_par.context_parallel.options import CP_METHODS
from lightning_par.data_parallel.options import DP_MODES
from lightning_par.parallel_dims import ParallelDims
from lightning_par.pipeline_parallel.options import SCHEDULES as RUNTIME_SCHEDULES
from lightning_par.pipeline_parallel.options import PipelineOptions
from lightning_par.planner.model import ModelSpec

__all__ = [
    "CHECKPOINTING",
    "CP_METHODS",
    "DP_MODES",
    "SCHEDULES",
    "Layout",
    "check_layout",
    "divisors",
    "enumerate_layouts",
]

#: The runtime's schedules whose step time the planner models (``"none"`` when ``pp_size == 1``: micro-batches are
#: gradient accumulation).
SCHEDULES: tuple[str, ...] = ("none", *(s for s in ("gpipe", "1f1b", "interleaved_1f1b") if s in RUNTIME_SCHEDULES))
#: Activation checkpointing (Korthikanti et al. 2022): keep all, recompute attention cores, recompute whole layers.
CHECKPOINTING: tuple[str, ...] = ("none", "selective", "full")


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

    @property
    def world_size(self) -> int:
        """``dp_size * cp_size * tp_size * pp_size``."""
        return self.dp_size * self.cp_size * self.tp_size * self.pp_size

    def dims(self, world_size: int | None = None) -> ParallelDims:
        """The runtime's layout of these sizes on ``world_size`` devices (default: :attr:`world_size`).

        Raises:
            ValueError: as :class:`~lightning_par.parallel_dims.ParallelDims` (a size that is not a positive integer,
                a product that is not ``world_size``).
        """
        return ParallelDims(dp_size=self.dp_size, tp_size=self.tp_size, pp_size=self.pp_size, cp_size=self.cp_size,
                            world_size=self.world_size if world_size is None else world_size)

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step: ``dp_size * num_microbatches * micro_batch_size`` (the cp ranks of a replica
        share its sequences)."""
        return self.dp_size * self.num_microbatches * self.micro_batch_size

    @property
    def mesh(self) -> str:
        """``"dp2·tp2·pp2"``; with context parallelism ``"dp2·cp2·tp2·pp1"`` (in rank order, between dp and tp)."""
        cp = f"·cp{self.cp_size}" if self.cp_size > 1 else ""
        return f"dp{self.dp_size}{cp}·tp{self.tp_size}·pp{self.pp_size}"

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
                 "virtual_stages"):
        _check_int(name, getattr(layout, name))
    layout.dims(num_devices)  # the runtime's size rules
    _check_choice("dp_mode", layout.dp_mode, DP_MODES)
    _check_choice("cp_method", layout.cp_method, CP_METHODS)
    _check_choice("schedule", layout.schedule, SCHEDULES)
    _check_choice("activation_checkpointing", layout.activation_checkpointing, CHECKPOINTING)
    if not isinstance(layout.sequence_parallel, bool):
        raise ValueError(f"sequence_parallel={layout.sequence_parallel!r} is not valid: expected True or False.")
    if global_batch_size is not None and layout.global_batch_size != global_batch_size:
        raise ValueError(
            f"dp_size * num_microbatches * micro_batch_size = {layout.global_batch_size} is not valid: expected "
            f"global_batch_size={global_batch_size}."
        )
    if model.num_heads % layout.tp_size:
        raise ValueError(
            f"tp_size={layout.tp_size} is not valid for num_heads={model.num_heads}: tensor parallelism splits whole "
            f"heads; expected one of {divisors(model.num_heads)}."
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
    stages = layout.pp_size * layout.virtual_stages
    if model.num_layers % stages:
        raise ValueError(
            f"pp_size * virtual_stages = {layout.pp_size} * {layout.virtual_stages} = {stages} is not valid for "
            f"num_layers={model.num_layers}: expected a divisor of the layers, one of {divisors(model.num_layers)}."
        )
    if layout.pp_size == 1 and layout.schedule != "none":
        raise ValueError(f"schedule={layout.schedule!r} is not valid with pp_size=1: expected 'none'.")
    if layout.pp_size > 1 and layout.schedule == "none":
        raise ValueError(
            f"schedule='none' is not valid with pp_size={layout.pp_size}: expected one of {list(SCHEDULES[1:])}."
        )
    if layout.pp_size > 1:  # the runtime's schedule rules (virtual stages, micro-batches against pp_size)
        PipelineOptions(
            schedule=layout.schedule, num_microbatches=layout.num_microbatches, virtual_stages=layout.virtual_stages
        ).check_layout(layout.pp_size, layout.dp_mode)
    elif layout.virtual_stages != 1:
        raise ValueError(f"virtual_stages={layout.virtual_stages} is not valid with pp_size=1: expected 1.")
    if layout.schedule == "interleaved_1f1b" and layout.num_microbatches % layout.pp_size:
        raise ValueError(
            f"num_microbatches={layout.num_microbatches} is not valid for schedule='interleaved_1f1b' with "
            f"pp_size={layout.pp_size}: expected a multiple of pp_size (Megatron-LM's rule, which the planner's bubble "
            f"formula assumes)."
        )
    if layout.dp_size * layout.cp_size == 1 and layout.dp_mode != "ddp":
        raise ValueError(f"dp_mode={layout.dp_mode!r} is not valid with dp_size=1: expected 'ddp' (nothing to shard).")
    _check_context_parallel(layout, model)
    if layout.tp_size == 1 and layout.sequence_parallel:
        raise ValueError("sequence_parallel=True is not valid with tp_size=1: expected False.")
    if layout.sequence_parallel and model.seq_len % layout.tp_size:
        raise ValueError(
            f"sequence_parallel=True is not valid with tp_size={layout.tp_size} and seq_len={model.seq_len}: expected "
            f"a sequence length divisible by tp_size."
        )
    if layout.sequence_parallel and layout.cp_size > 1 and (model.seq_len // layout.cp_size) % layout.tp_size:
        raise ValueError(
            f"sequence_parallel=True is not valid with tp_size={layout.tp_size}, cp_size={layout.cp_size} and "
            f"seq_len={model.seq_len}: expected the tokens per cp rank, seq_len / cp_size = "
            f"{model.seq_len // layout.cp_size}, divisible by tp_size."
        )


def _check_context_parallel(layout: Layout, model: ModelSpec) -> None:
    """The cp axis's rules (:mod:`lightning_par.context_parallel`), on the runtime's own checks where it has them.

    Raises:
        ValueError: ``cp_method`` other than ``"ring"`` with ``cp_size == 1``; a sequence length that is not a multiple of ``2 * cp_size``; ``all_to_all`` with heads that do not split
            over ``cp_size * tp_size`` ranks.
    """
    cp = layout.cp_size
    if cp == 1:
        if layout.cp_method != "ring":
            raise ValueError(
                f"cp_method={layout.cp_method!r} is not valid with cp_size=1: expected 'ring' (nothing to split)."
            )
        return
    # The runtime's own rule (private there: split_sequence and load_balanced_positions call it on tensors):
    # causal load balancing cuts the sequence into 2 * cp_size equal chunks.
    check_cp_seq_len(model.seq_len, cp)
    if layout.cp_method == "all_to_all":
        check_ulysses_heads(model.num_heads, cp, layout.tp_size)


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

    Yields:
        Valid layouts, in a deterministic order.
    """
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
                                layout = Layout(dp, tp, pp, mode, b, m, sched, v, ckpt, sp, cp, method)
                                try:
                                    check_layout(layout, model)
                                except ValueError:
                                    continue
                                yield layout
