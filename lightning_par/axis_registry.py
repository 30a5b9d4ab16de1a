"""The axis registry: each parallelism says, in its own folder, what it adds to :func:`~lightning_par.parallelize.
parallelize` and to a run.

An :class:`Axis` is one entry: the mesh axis it works on, the option groups it owns, its checks against a model
(no process group needed), and its step in ``parallelize()``. A step reads and extends one :class:`Build` (the model
being parallelised); what it leaves there (a step protocol of its own, a gradient finisher, a state-dict transform, a
loss context, summary figures) is how the axis takes part in the run, so the strategy has no per-axis branch.

The registry itself, in ``parallelize()``'s order, is :data:`lightning_par.axes.AXES`.

An entry may also carry its :class:`PlannerTerms`: its rules and costs in the layout planner
(:mod:`lightning_par.planner`), kept in the axis's folder (``<axis>/planner.py``), which the planner sums over the
registry instead of naming axes.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from lightning_par.data_parallel.engine import DataParallelEngine
    from lightning_par.parallel_dims import ParallelDims
    from lightning_par.steps import StepHooks

# The registry sits below parallelize(): it never imports lightning_par.parallelize, not even for annotations, so the
# options an axis reads are typed ``Any`` here (they are a ``lightning_par.parallelize.ParallelOptions``), and no import
# circle runs through the registry (tests/core/test_import_layers.py).

__all__ = ["CALLBACK_KINDS", "PHASES", "Axis", "Build", "Check", "PlannerTerms", "StateTransform"]

#: ``parallelize()``'s order: a step's phase places it (Megatron-LM's PTD-P order as torchtitan applies it: the pipeline
#: cut, tensor parallelism, context parallelism, activation checkpointing inside the tp styles' hooks and outside the dp
#: mode's, ``torch.compile`` of each block (its graph holds the tp styles and the recomputation, the dp mode's hooks stay
#: outside), the dp mode, then the schedule over the stage modules).
#: ``read`` comes first: a model's plans are read from the whole network, before any cut.
PHASES: dict[str, int] = {
    "read": 0, "cut": 1, "split": 2, "context": 3, "recompute": 4, "compile": 5, "data": 6, "schedule": 7,
}

#: The kinds of Lightning callback an axis may refuse (:attr:`Axis.refused_callbacks`): ``weight_averaging``
#: (``StochasticWeightAveraging``, ``WeightAveraging``), ``finetuning`` (``BaseFinetuning``), ``pruning``
#: (``ModelPruning``); what each does wrong under which layout: :func:`lightning_par.callbacks.refusals.check_callbacks`.
CALLBACK_KINDS: tuple[str, ...] = ("weight_averaging", "finetuning", "pruning")

#: ``check(module, network, dims, options)``: raise ``ValueError`` naming the field and value if the layout cannot run.
Check = Callable[["nn.Module", "nn.Module", "ParallelDims", Any], None]
#: ``transform(model_state, optimizer_states)``: rewrite states in place into their one-process form (and the same
#: function is used for the state a checkpoint is loaded into).
StateTransform = Callable[[dict[str, Any], list[dict[str, Any]]], None]


@dataclass
class Build:
    """The model as :func:`~lightning_par.parallelize.parallelize` builds it, step by step, on this rank.

    Attributes:
        module: the LightningModule (or any ``nn.Module`` meeting :mod:`lightning_par.contract`).
        dims: the layout, whose meshes exist.
        options: the option groups.
        device: this rank's device.
        training: built for training (``False``: validate/test/predict).
        step_context: entered around each pipeline schedule run (autocast, the vocab-parallel loss context).
        network: this rank's part of the network (after a pipeline cut: the holder of its stages' parameters).
        plan: the tensor-parallel plan of the whole network, read before any cut (``None``: no tp).
        checkpoint_paths: the modules to recompute, read from the whole network before any cut.
        stage_ids: this rank's virtual stages (``None`` without pipelining).
        stage_modules: the modules a pipeline schedule runs, in chunk order.
        layer_counts: layers per virtual stage.
        checkpointed: paths of the modules whose activations are recomputed on this rank.
        compile_paths: the blocks to compile (``strategy.compile``), read from the whole network before any cut.
        compiled: paths of the blocks compiled on this rank.
        engine: the dp axis's engine (set by the dp step).
        pipeline: the pipeline schedule's engine (set by the pp step).
        steps: the class of the step hooks (:class:`~lightning_par.steps.StepHooks`; the pp step replaces it).
        loss_context: a factory of the context the loss's forward and backward must run in (vocab-parallel loss).
        step_contexts: factories of further contexts each step's forward and backward run in (cp's attention).
        batch_transforms: applied in order to each batch before the LightningModule's step sees it (cp's split of
            the sequence).
        after_schedule: run after a pipeline schedule's backward pieces, before the dp reduction.
        finishers: run once per optimizer step after the dp reduction, before clipping (tp partial-gradient sums).
        state_transforms: turn this rank's states into their one-process form (vocabulary padding cut off).
        full_state_transforms: the same for full (gathered) tensors, ``{name: tensor}`` in place.
        norm_groups: process groups whose ranks hold *other* parameters: a gradient norm sums over them (pp).
        summaries: figures for ``summary.json``, each a function returning a dict.
        expert_paths: the experts modules of the whole network, read before any cut (``None``: no ep).
        dp_groups: modules whose parameters have their data-parallel replicas on other meshes than the dp axis's (the
            experts: ``edp``), each with those meshes
            (:class:`~lightning_par.data_parallel.meshes.DataParallelMeshes`); the dp step runs its mode there.
        step_logs: functions returning per-step figures ``{name: float}`` logged under ``parallel/`` after each
            training step.
        step_wrappers: each ``wrap(module, batch, run) -> output`` runs ``run(batch)`` (the LightningModule's own
            training, validation or test step on this rank's ``batch``) and may change what it logs and returns: cp
            averages them over the ranks holding the other pieces of the sequence
            (:mod:`~lightning_par.context_parallel.report`). Applied in order, the first outermost.
        token_groups: process groups whose ranks hold other tokens of the same batch (cp's pieces of a sequence, dp's
            other samples): a pipeline weighs each micro-batch's token-mean loss by its share of the tokens counted
            over them.
        optimizer_step_hooks: run after every optimizer step (each optimizer's step post-hook), on every rank, in
            order (float8: the weights' scales for the next float8 all-gather).
        refused_stages: Trainer stages the layout cannot run (``"predict"``), each with the reason; the strategy
            raises it as a ``ValueError`` before the stage's first batch.
    """

    module: nn.Module
    dims: ParallelDims
    options: Any  # a lightning_par.parallelize.ParallelOptions
    device: torch.device
    training: bool = True
    step_context: Callable[[], AbstractContextManager[Any]] | None = None
    network: nn.Module | None = None
    plan: dict[str, Any] | None = None
    checkpoint_paths: list[str] = field(default_factory=list)
    stage_ids: list[int] | None = None
    stage_modules: list[nn.Module] = field(default_factory=list)
    layer_counts: list[int] | None = None
    checkpointed: list[str] = field(default_factory=list)
    compile_paths: list[str] = field(default_factory=list)
    compiled: list[str] = field(default_factory=list)
    engine: DataParallelEngine | None = None
    pipeline: Any = None
    steps: type[StepHooks] | None = None
    loss_context: Callable[[], AbstractContextManager[Any]] = nullcontext
    step_contexts: list[Callable[[], AbstractContextManager[Any]]] = field(default_factory=list)
    batch_transforms: list[Callable[[Any], Any]] = field(default_factory=list)
    after_schedule: list[Callable[[], None]] = field(default_factory=list)
    finishers: list[Callable[[], None]] = field(default_factory=list)
    state_transforms: list[StateTransform] = field(default_factory=list)
    full_state_transforms: list[Callable[[dict[str, Any]], None]] = field(default_factory=list)
    norm_groups: list[Any] = field(default_factory=list)
    summaries: list[Callable[[], dict[str, Any]]] = field(default_factory=list)
    expert_paths: list[str] | None = None
    dp_groups: list[tuple[list[nn.Module], Any]] = field(default_factory=list)
    step_logs: list[Callable[[], dict[str, float]]] = field(default_factory=list)
    step_wrappers: list[Callable[[Any, Any, Callable[[Any], Any]], Any]] = field(default_factory=list)
    token_groups: list[Any] = field(default_factory=list)
    refused_stages: dict[str, str] = field(default_factory=dict)
    optimizer_step_hooks: list[Callable[[], None]] = field(default_factory=list)


@dataclass(frozen=True)
class PlannerTerms:
    """An axis's part in the layout planner (:mod:`lightning_par.planner`): pure functions of the planner's
    ``ModelSpec`` and ``Layout`` (no process group, no tensor).

    The planner core runs every registered ``check`` in :func:`~lightning_par.planner.layouts.check_layout`, adds every
    ``slot_comm_s`` to the time of one micro-batch slot and every ``step_comm_s`` after the schedule
    (:func:`~lightning_par.planner.step_time.predict_step_time`), reporting each under the axis's name, and sums every
    ``state_bytes`` into a rank's model state (:func:`~lightning_par.planner.memory.rank_state_bytes`).

    Attributes:
        check: ``check(layout, model)``: raise ``ValueError`` naming the field, its value and what would be valid when
            this axis cannot run the layout (the runtime's own rules, plus the choices the planner's cost model covers).
        slot_comm_s: ``slot_comm_s(ctx)``: seconds of this axis's communication, not overlapped, in one micro-batch slot
            (forward and backward) on the slowest pipeline rank; ``ctx`` is a
            :class:`~lightning_par.planner.context.PlanContext`.
        step_comm_s: ``step_comm_s(ctx, window_s)``: seconds of this axis's exposed communication once per optimizer
            step, after the schedule, given ``window_s`` seconds of compute it may overlap (the dp axis).
        state_bytes: ``state_bytes(ctx, pp_rank)``: bytes of parameters, gradients and optimizer state of the parameter
            group this axis shards, on the fullest rank of pipeline rank ``pp_rank`` (the dp axis: the dense
            parameters; the ep axis: the experts); the planner's model state is their sum.
        canonical: ``canonical(layout)``: ``False`` for a valid layout the enumeration leaves out because another
            spelling of it runs the same way (HSDP under ``ddp`` is ``ddp`` over ``dp_replicate x dp_shard``).
        token_split: ``token_split(layout)``: the ranks this axis splits each sequence's tokens over (an int >= 1; the
            cp axis: ``cp_size``); a rank holds ``seq_len`` divided by the product over the registered axes
            (:func:`~lightning_par.planner.layouts.sequence_split`) of the tokens of each of its sequences (``None``: 1,
            no split).
        point_to_point: ``point_to_point(layout)``: ``True`` when this axis's messages under ``layout`` go from one
            device to one device (ring attention's K/V sends), so a group across nodes uses one network adapter per
            step rather than one per member (:func:`~lightning_par.planner.comm.group_ranks_per_node`; ``None``:
            collectives).
    """

    check: Callable[[Any, Any], None] | None = None
    slot_comm_s: Callable[[Any], float] | None = None
    step_comm_s: Callable[[Any, float], float] | None = None
    state_bytes: Callable[[Any, int], float] | None = None
    canonical: Callable[[Any], bool] | None = None
    token_split: Callable[[Any], int] | None = None
    point_to_point: Callable[[Any], bool] | None = None


@dataclass(frozen=True)
class Axis:
    """One parallelism in the registry.

    Attributes:
        name: the mesh axis it uses (one of :data:`~lightning_par.parallel_dims.MESH_AXES`, or ``"dp"`` for the
            data-parallel pair ``dp_replicate`` x ``dp_shard``); a technique on no axis (activation checkpointing)
            names itself.
        size_fields: the :class:`~lightning_par.parallel_dims.ParallelDims` size fields it owns.
        option_groups: the option groups of :class:`~lightning_par.parallelize.ParallelOptions` it owns; an option of
            these is refused by a strategy that does not have this axis.
        check: its checks against a model, without any process group (``None``: nothing to check).
        steps: its steps in ``parallelize()``, each ``(phase, step)`` with a phase of :data:`PHASES`; every step is
            called for every build and decides from ``build.dims`` and ``build.options`` whether there is anything to
            do.
        planner: its terms in the layout planner (``None``: the planner has none for it).
        refused_callbacks: the kinds of Lightning callback this axis cannot train with under a layout, read before the
            first step (:func:`lightning_par.callbacks.refusals.check_callbacks`): called with the
            :class:`~lightning_par.parallel_dims.ParallelDims` and the options, it returns ``{kind: what rules it
            out}`` (a size or mode, ``"tp_size=2"``) for the kinds of :data:`CALLBACK_KINDS` it refuses there
            (``None``: none ever).
    """

    name: str
    size_fields: tuple[str, ...] = ()
    option_groups: tuple[str, ...] = ()
    check: Check | None = None
    steps: tuple[tuple[str, Callable[[Build], None]], ...] = ()
    planner: PlannerTerms | None = None
    refused_callbacks: Callable[[ParallelDims, Any], dict[str, str]] | None = None
