"""One composition path: every strategy turns a LightningModule into its parallel form here, in one fixed order.

:func:`parallelize` runs the steps of every registered parallelism (:data:`lightning_par.axes.AXES`) in the order of
their phases (:data:`lightning_par.axis_registry.PHASES`), on this rank's part of the model:

==============  ==========================  =================================================================
phase           step (folder)               what it does
==============  ==========================  =================================================================
``read``        tp, activation ckpt         read the plan and the modules to recompute from the whole network
``cut``         pp (``pipeline_parallel``)  keep this rank's virtual stage(s); the LightningModule keeps only
                                            their parameters, under their whole-model names
``split``       tp (``tensor_parallel``)    the plan's DTensor styles on the tp mesh, inside the stage(s)
``recompute``   activation checkpointing    wrap the named modules: inside the tp styles' hooks, outside the dp
                                            mode's (torchtitan's order: TP, activation checkpointing, FSDP)
``data``        dp (``data_parallel``)      ``ddp``, ``zero1``, ``zero2`` or ``zero3`` on the dp meshes (HSDP
                                            when ``dp_replicate_size > 1``)
``schedule``    pp (``pipeline_parallel``)  torch's ``PipelineStage`` + schedule over the stage modules; the
                                            pipelined step hooks
==============  ==========================  =================================================================

The order is Megatron-LM's "PTD-P" (Narayanan et al. 2021, §2.3) as torchtitan applies it (``parallelize_llama``:
TP, then FSDP on the dp mesh, then the pipeline schedule over the stage modules). A single-technique strategy is the
same path with the other sizes at 1. :func:`validate` runs every axis's checks without any process group. What the
steps leave behind (step hooks, gradient finishers, state transforms, the loss context, summary figures) makes the
:class:`ParallelModel` the strategy drives through one protocol (:class:`~lightning_par.steps.StepHooks`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_par import contract
from lightning_par.activation_checkpointing import ACTIVATION_CHECKPOINTING
from lightning_par.axes import AXES
from lightning_par.axis_registry import PHASES, Build
from lightning_par.compile import CompileOptions
from lightning_par.context_parallel.options import ContextParallelOptions
from lightning_par.data_parallel.engine import DataParallelEngine
from lightning_par.data_parallel.options import DP_MODES, ReducerOptions, ZeroOptions, resolve_zero_options, zero_stage
from lightning_par.fault_tolerance.options import FaultToleranceOptions
from lightning_par.data_parallel.options import ZERO_GROUP_DEFAULTS
from lightning_par.float8 import Float8Options
from lightning_par.parallel_dims import ParallelDims
from lightning_par.pipeline_parallel.options import PipelineOptions
from lightning_par.restore import ModuleSnapshot
from lightning_par.steps import StepHooks
from lightning_par.tensor_parallel.options import TensorParallelOptions
from lightning_par.validation import check_choice

__all__ = [
    "OPTION_GROUPS", "ParallelModel", "ParallelOptions", "parallel_model_of", "parallelize", "parallelize_order", "validate",
]

#: Attribute of a module :func:`parallelize` changed: the :class:`ParallelModel` that owns it (in a box that deep
#: copies and pickles as ``None``: a copy of a parallelised module owns nothing).
OWNER_ATTR = "_lightning_par_parallel_model"

#: User-facing ZeRO fields (``strategy.zero.*``); the rest of :class:`ZeroOptions` comes from ``dp_mode`` and the
#: reducer group.
_ZERO_DEFAULTS: dict[str, Any] = ZERO_GROUP_DEFAULTS
_ZERO_FIELDS: tuple[str, ...] = tuple(_ZERO_DEFAULTS)

#: The option groups built from their own keywords alone (the dp axis's two are built together, from ``dp_mode``):
#: group name (a field of :class:`ParallelOptions`) -> its options dataclass.
PLAIN_GROUPS: dict[str, type] = {
    "tensor_parallel": TensorParallelOptions,
    "pipeline": PipelineOptions,
    "context_parallel": ContextParallelOptions,
}
#: Groups given only nested (``compile={"enabled": True}``, ``strategy.float8.recipe=rowwise``,
#: ``fault_tolerance={...}``): their field names (``enabled``, ``mode``, ``recipe``) would say nothing flat, and three
#: groups share ``enabled``.
NESTED_GROUPS: dict[str, type] = {
    "compile": CompileOptions, "float8": Float8Options, "fault_tolerance": FaultToleranceOptions,
}

#: Option group name -> the flat keyword names it owns.
OPTION_GROUPS: dict[str, tuple[str, ...]] = {
    "reducer": tuple(f.name for f in fields(ReducerOptions)),
    "zero": _ZERO_FIELDS,
    **{group: tuple(f.name for f in fields(cls)) for group, cls in {**PLAIN_GROUPS, **NESTED_GROUPS}.items()},
}


@dataclass(frozen=True)
class ParallelOptions:
    """Everything :func:`parallelize` needs besides the layout, as validated groups.

    Attributes:
        dp_mode: ``"ddp"``, ``"zero1"``, ``"zero2"`` or ``"zero3"`` on the dp axis.
        reducer: the bucketed reducer of ``ddp`` (and ``zero1``'s all-reduce; ``bucket_cap_mb`` for ``zero2`` too).
        zero: the ZeRO options (``None`` with ``ddp``); their stage is ``dp_mode``'s.
        tensor_parallel: the tp axis's options.
        pipeline: the pp axis's options.
        context_parallel: the cp axis's options.
        compile: ``torch.compile`` of every block (:mod:`lightning_par.compile`).
        float8: float8 training of the selected ``nn.Linear`` layers (:mod:`lightning_par.float8`).
        fault_tolerance: the fault-tolerant replicate axis across replica groups (torchft;
            :mod:`lightning_par.fault_tolerance`).
        module_attr: attribute of the LightningModule holding the network (see :mod:`lightning_par.contract`).
        activation_checkpointing: ``"none"``, ``"full"`` (every block) or ``"selective"`` (the attention of every
            block; :mod:`lightning_par.activation_checkpointing`).

    Raises:
        ValueError: an invalid group or combination, named in the message.
    """

    dp_mode: str = "ddp"
    reducer: ReducerOptions = field(default_factory=ReducerOptions)
    zero: ZeroOptions | None = None
    tensor_parallel: TensorParallelOptions = field(default_factory=TensorParallelOptions)
    pipeline: PipelineOptions = field(default_factory=PipelineOptions)
    context_parallel: ContextParallelOptions = field(default_factory=ContextParallelOptions)
    compile: CompileOptions = field(default_factory=CompileOptions)
    float8: Float8Options = field(default_factory=Float8Options)
    fault_tolerance: FaultToleranceOptions = field(default_factory=FaultToleranceOptions)
    module_attr: str | None = "model"
    activation_checkpointing: str = "none"

    def __post_init__(self) -> None:
        check_choice("activation_checkpointing", self.activation_checkpointing, ACTIVATION_CHECKPOINTING)
        stage = zero_stage(self.dp_mode)
        if stage and self.zero is None:
            object.__setattr__(self, "zero", resolve_zero_options(stage))
        if not stage and self.zero is not None:
            raise ValueError(f"zero={self.zero!r} is not valid with dp_mode='ddp': expected None.")
        if stage and self.zero.stage != stage:  # type: ignore[union-attr]
            raise ValueError(f"zero.stage={self.zero.stage} does not match dp_mode={self.dp_mode!r}.")  # type: ignore[union-attr]
        if self.module_attr is not None and (not isinstance(self.module_attr, str) or not self.module_attr):
            raise ValueError(f"module_attr={self.module_attr!r} is not valid: expected an attribute name or None.")

    @classmethod
    def build(cls, dp_mode: str = dp_mode, module_attr: str | None = module_attr,  # the fields' defaults above
              activation_checkpointing: str = activation_checkpointing, **options: Any) -> ParallelOptions:
        """Options from plain values, flat (``schedule="1f1b", bucket_cap_mb=10``) or nested by group
        (``pipeline={"schedule": "1f1b"}``, as the Hydra schemas give them); see :data:`OPTION_GROUPS`.

        Raises:
            ValueError: an unknown option (the message lists the valid ones), an option given twice, an invalid value,
                or a reducer option the dp mode does not use (``comm_hook`` or ``bucket_cap_mb`` with ``zero3``,
                ``comm_hook`` with ``zero2``).
        """
        check_choice("dp_mode", dp_mode, DP_MODES)
        groups: dict[str, dict[str, Any]] = {g: {} for g in OPTION_GROUPS}
        owner = {name: g for g, names in OPTION_GROUPS.items() if g not in NESTED_GROUPS for name in names}
        for key, value in options.items():
            if isinstance(value, CompileOptions) and key == "compile":
                value = {f.name: getattr(value, f.name) for f in fields(value)}
            if key in OPTION_GROUPS:
                if value is None:
                    continue
                if not isinstance(value, Mapping):
                    raise ValueError(f"{key}={value!r} is not valid: expected a mapping of {list(OPTION_GROUPS[key])}.")
                for name, v in value.items():
                    if name not in OPTION_GROUPS[key]:
                        raise ValueError(
                            f"{key}.{name} is not a valid option: expected one of {list(OPTION_GROUPS[key])}."
                        )
                    _put(groups[key], key, name, v)
            elif key in owner:
                _put(groups[owner[key]], owner[key], key, value)
            else:
                valid = sorted(owner) + sorted(OPTION_GROUPS)
                raise ValueError(f"{key}={value!r} is not a valid option: expected one of {valid}.")
        stage = zero_stage(dp_mode)
        reducer_given = groups["reducer"]
        zero = None
        if stage:
            if stage == 3 and reducer_given.get("bucket_cap_mb") is not None:
                raise ValueError(
                    f"bucket_cap_mb={reducer_given['bucket_cap_mb']!r} is not valid with dp_mode='zero3': stage 3 "
                    f"gathers and reduces one fully_shard unit (one block) at a time. Leave it unset."
                )
            hook = reducer_given.get("comm_hook", ReducerOptions.comm_hook)
            zero = resolve_zero_options(
                stage,
                **groups["zero"],
                bucket_cap_mb=reducer_given.get("bucket_cap_mb") if stage < 3 else None,
                gradient_as_bucket_view=reducer_given.get(
                    "gradient_as_bucket_view", ReducerOptions.gradient_as_bucket_view
                ),
                static_graph=reducer_given.get("static_graph", ReducerOptions.static_graph),
                comm_hook=hook,
            )
        elif any(v != _ZERO_DEFAULTS[k] for k, v in groups["zero"].items()):
            given = sorted(k for k, v in groups["zero"].items() if v != _ZERO_DEFAULTS[k])
            raise ValueError(
                f"zero options {given} are not valid with dp_mode='ddp': use dp_mode in ['zero1', 'zero2', 'zero3'] "
                f"to shard."
            )
        reducer = ReducerOptions(**reducer_given)
        return cls(
            dp_mode=dp_mode,
            reducer=reducer,
            zero=zero,
            **{group: options_cls(**groups[group]) for group, options_cls in {**PLAIN_GROUPS, **NESTED_GROUPS}.items()},
            module_attr=module_attr,
            activation_checkpointing=activation_checkpointing,
        )

    def check_layout(self, pp_size: int) -> None:
        """Check the options against the pipeline size, without a model (see :meth:`PipelineOptions.check_layout`).

        Raises:
            ValueError: a combination the layout cannot run.
        """
        if pp_size > 1:
            reshard = self.zero.reshard_after_forward if self.zero is not None else True
            self.pipeline.check_layout(pp_size, self.dp_mode, reshard)

    def check_batch_size(self, batch_size: Any, pp_size: int) -> None:
        """Check a training loader's batch size against the layout, before the first step.

        Raises:
            ValueError: under pipelining, a batch size that is not a multiple of ``num_microbatches``.
        """
        m = self.pipeline.num_microbatches
        if pp_size > 1 and isinstance(batch_size, int) and batch_size % m != 0:
            raise ValueError(
                f"batch_size={batch_size} is not valid with num_microbatches={m}: expected a batch size that is a "
                f"multiple of {m}."
            )


def _put(group: dict[str, Any], group_name: str, name: str, value: Any) -> None:
    if value is None:  # None is "the default" (the Hydra schemas leave unset options at None)
        return
    if name in group:
        raise ValueError(f"{group_name}.{name} is given twice (flat and nested); give it once.")
    group[name] = value


class ParallelModel:
    """What :func:`parallelize` made of a LightningModule on this rank, and the one protocol a strategy drives it by.

    Attributes:
        module: the LightningModule (under pipelining its network is replaced by ``network``).
        network: this rank's part of the network: the whole network, or under pipelining the holder of its stages'
            parameters (whole-model names), with tensor parallelism applied.
        dims: the layout.
        options: the options it was built with.
        engine: the dp axis.
        pipeline: the schedule over ``stage_modules`` (``None`` without pipelining).
        stage_modules: the modules the schedule runs, in chunk order.
        layer_counts: layers per virtual stage (``None`` without pipelining).
        loss_parallel: the loss (forward and backward) must run under :meth:`loss_context` (a tp ``vocab_head``).
        training: built for training (ZeRO stages 1 and 2 shard only then).
        checkpointed: paths (relative to the network) of the modules whose activations are recomputed on this rank.
        steps: the step hooks (:class:`~lightning_par.steps.StepHooks`, or the pipelined ones).
        after_schedule: what runs after a pipeline schedule's backward pieces, before the dp reduction.
    """

    def __init__(self, build: Build, snapshot: ModuleSnapshot | None = None) -> None:
        assert build.network is not None and build.engine is not None
        self.module = build.module
        self.device = build.device
        self._snapshot = snapshot
        self._hooks_removed = False
        self.network = build.network
        self.dims = build.dims
        self.options = build.options
        self.engine: DataParallelEngine = build.engine
        self.pipeline = build.pipeline
        self.stage_modules = build.stage_modules
        self.layer_counts = build.layer_counts
        self.training = build.training
        self.checkpointed = build.checkpointed
        self.loss_parallel = build.loss_context is not nullcontext
        self.after_schedule = list(build.after_schedule)
        self._contexts = [build.loss_context, *build.step_contexts]
        self._batch_transforms = list(build.batch_transforms)
        self._finishers = list(build.finishers)
        self._state_transforms = list(build.state_transforms)
        self._full_state_transforms = list(build.full_state_transforms)
        self._summaries = list(build.summaries)
        self._step_logs = list(build.step_logs)
        self._step_wrappers = list(build.step_wrappers)
        #: Trainer stage -> why this layout cannot run it (raised before the stage's first batch)
        self.refused_stages = dict(build.refused_stages)
        self._norm_groups = list(build.norm_groups)
        self._optimizer_step_hooks = list(build.optimizer_step_hooks)
        self.steps: StepHooks = (build.steps or StepHooks)(self)

    @contextmanager
    def loss_context(self) -> Generator[None, None, None]:
        """The contexts a step's forward and backward run in: the vocab-parallel loss (tp ``vocab_head``), the
        context-parallel attention (cp); a no-op without them."""
        with ExitStack() as stack:
            for factory in self._contexts:
                stack.enter_context(factory())
            yield

    def prepare_batch(self, batch: Any) -> Any:
        """Called once per step, before its forward (every step protocol does): the module buffers are broadcast
        over dp first when torch DDP would (:class:`~lightning_par.data_parallel.buffers.BufferSync`; collective over
        the dp group then). Returns the batch as the LightningModule's step sees it on this rank (cp: this rank's
        piece of the sequence and its ``position_ids``); ``batch`` itself without such an axis."""
        if self.engine.buffers is not None:
            self.engine.buffers.before_forward()
        for transform in self._batch_transforms:
            batch = transform(batch)
        return batch

    @property
    def has_batch_transforms(self) -> bool:
        """Whether an axis transforms the batch before the step sees it (cp: each rank's piece of every sequence)."""
        return bool(self._batch_transforms)

    def transform_batch(self, batch: Any) -> Any:
        """``batch`` as the LightningModule's step sees it on this rank (every axis's batch transform: cp's split of
        the sequence), without :meth:`prepare_batch`'s buffer broadcast (no collective)."""
        for transform in self._batch_transforms:
            batch = transform(batch)
        return batch

    def run_step(self, call: Callable[[Any], Any], batch: Any) -> Any:
        """``call(batch)``: the LightningModule's own step on this rank's prepared ``batch``, through every axis's
        step wrapper (cp: what the step logs and returns becomes the mean over the cp ranks' tokens)."""
        run = call
        for wrap in reversed(self._step_wrappers):
            run = functools.partial(wrap, self.module, run=run)
        return run(batch)

    @contextmanager
    def block_sync(self) -> Generator[None, None, None]:
        """Entered for every batch of an accumulation window but the last: no dp reduction (the step hooks'
        ``block_sync``), and, as under torch DDP's ``no_sync``, no buffer broadcast before the next forward."""
        buffers = self.engine.buffers
        with self.steps.block_sync(), buffers.no_sync() if buffers is not None else nullcontext():
            yield

    @property
    def has_optimizer_step_hooks(self) -> bool:
        """Whether an axis asked to run after every optimizer step (:meth:`after_optimizer_step`)."""
        return bool(self._optimizer_step_hooks)

    def after_optimizer_step(self) -> None:
        """After every optimizer step, on every rank: every axis's optimizer-step hook (float8: the weights' scales
        for the next float8 all-gather, in one all-reduce over the dp shard ranks)."""
        for hook in self._optimizer_step_hooks:
            hook()

    def finish_gradients(self) -> None:
        """Once per optimizer step, after the dp reduction and before clipping: every axis's gradient finisher (the
        tp partial-gradient sum of replicated parameters)."""
        for finish in self._finishers:
            finish()

    def clip_grad_norm_(self, params: list[Tensor], max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the gradients of ``params`` (an optimizer's) by the whole model's norm: every shard (the dp engine),
        every stage (the groups holding other parameters). Returns the norm before clipping."""
        return self.engine.clip_grad_norm_(params, max_norm, norm_type, self._norm_groups)

    @torch.no_grad()
    def clip_grad_value_(self, params: list[Tensor], clip_value: float) -> None:
        """Clamp every gradient of ``params`` (an optimizer's) to ``[-clip_value, clip_value]``, elementwise, so
        clamping each rank's shard (a DTensor's local tensor, a ZeRO chunk, a stage's parameters) is exactly the one
        process's ``torch.nn.utils.clip_grad_value_``, with no communication. A gradient still ``Partial`` over a mesh
        (a sum pending over the tp ranks) is summed first: the clamp of a sum is not the sum of clamps."""
        from torch.distributed.tensor import DTensor, Replicate

        from lightning_par.compat import local_tensor

        for p in params:
            grad = p.grad
            if grad is None:
                continue
            if isinstance(grad, DTensor) and any(pl.is_partial() for pl in grad.placements):
                grad = grad.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in grad.placements])
                p.grad = grad
            local_tensor(grad).clamp_(-clip_value, clip_value)

    def model_state_dict(self) -> dict[str, Any]:
        """This rank's part of the model, keyed by one-process name (sharded tensors as DTensors of their global
        shape, in their one-process form)."""
        state = self.engine.model_state_dict()
        self.to_one_process(state, [])
        return state

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's part of ``optimizer``'s state, keyed by one-process parameter name."""
        state = self.engine.optimizer_state_dict(optimizer)
        self.to_one_process({}, [state])
        return state

    def to_one_process(self, model_state: dict[str, Any], optimizer_states: list[dict[str, Any]]) -> None:
        """Every axis's state transform, in place (e.g. vocabulary padding cut off)."""
        for transform in self._state_transforms:
            transform(model_state, optimizer_states)

    def full_state_dict(self) -> dict[str, Tensor]:
        """Every parameter of the whole model in full, keyed by one-process name, on every rank (fp32 masters under
        mixed precision). Collective over the whole world (tp/dp gathers, then the pp group); for tests and small
        models — checkpoints never gather."""
        local = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
            for k, v in self.engine.full_state_dict().items()
        }
        for transform in self._full_state_transforms:
            transform(local)
        return self._over_stages(local)

    def grad_norm(self, params: list[Tensor], norm_type: float = 2.0) -> Tensor:
        """The ``norm_type``-norm of the whole model's gradient (every shard, every stage), computed as clipping
        computes it, without scaling anything. Collective over the world. A float32 scalar, the same on every rank."""
        return self.engine.clip_grad_norm_(params, float("inf"), norm_type, self._norm_groups)

    def full_grads(self) -> dict[str, Tensor]:
        """Every parameter's gradient in full (averaged over dp), keyed by one-process name, on every rank (CPU).
        Collective over the whole world (dp/tp gathers, then the pp group); gathers the whole gradient on every rank:
        for callbacks on small models, and tests."""
        local = {k: v.detach().cpu() for k, v in self.engine.full_grads().items()}
        for transform in self._full_state_transforms:
            transform(local)
        return self._over_stages(local)

    def parameter_counts(self) -> dict[str, tuple[int, bool]]:
        """``{one-process name: (elements, requires_grad)}`` of every parameter of the whole model, on every rank:
        sharded parameters (DTensors: tp, zero3) counted at their global shape less vocabulary padding, the other
        stages' parameters gathered over the pp group (collective over it). What a model summary counts."""
        shapes: dict[str, Any] = {}
        trainable: dict[str, bool] = {}
        for name, p in self.module.named_parameters():
            shapes[name] = torch.empty(p.shape, device="meta")  # a DTensor's shape is its global one
            trainable[name] = p.requires_grad
        for transform in self._full_state_transforms:
            transform(shapes)
        local = {name: (t.numel(), trainable[name]) for name, t in shapes.items()}
        return self._over_stages(local)

    def full_buffers(self) -> dict[str, Tensor]:
        """Every buffer of the whole model in full, keyed by one-process name, on every rank (collective over the tp
        meshes, then the pp group)."""
        local = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
            for k, v in self.module.named_buffers()
        }
        return self._over_stages(local)

    def _over_stages(self, local: dict[str, Any]) -> dict[str, Any]:
        """``local`` (this rank's entries, keyed by one-process name) merged with the other pipeline stages'
        (collective over the pp group; the first stage's entry wins where two hold one name, e.g. a buffer)."""
        if not self.dims.pp_enabled:
            return local
        parts: list[Any] = [None] * self.dims.pp_size
        dist.all_gather_object(parts, local, group=self.dims.group("pp"))
        out: dict[str, Any] = {}
        for part in parts:
            for k, v in part.items():
                out.setdefault(k, v)
        return out

    def remove_hooks(self) -> None:
        """Detach the dp engine's hooks (idempotent)."""
        if not self._hooks_removed:
            self.engine.remove()
            self._hooks_removed = True

    def unparallelize(self) -> nn.Module:
        """Put the plain module back, holding the trained values: every axis's changes undone (the pipeline cut,
        the tensor-parallel styles, FSDP2, the dp engines' hooks, activation checkpointing), fresh plain parameters
        with the full values on every rank (see :mod:`lightning_par.restore`). After it this ``ParallelModel`` no
        longer owns the module; :func:`parallelize` may take it again, under any layout. Collective over the world
        (it gathers the whole model on every rank: :meth:`full_state_dict`), with this model's meshes.

        Returns:
            The module.

        Raises:
            RuntimeError: the module was not parallelised by :func:`parallelize` (no record to undo it).
        """
        if self._snapshot is None:
            raise RuntimeError("This ParallelModel has no record of the plain module: it cannot be undone.")
        try:
            self.module.to(self.device)  # Lightning's teardown moved it to the CPU; the gathers run on the meshes'
        except Exception:  # noqa: BLE001 - best effort: the gathers below say what is wrong
            pass
        self.engine.reshard()
        params = self.full_state_dict()
        buffers = self.full_buffers()
        self.remove_hooks()
        self._snapshot.restore(params, buffers)
        self._snapshot = None
        if isinstance(self.module.__dict__.get(OWNER_ATTR), _Owner) and self.module.__dict__[OWNER_ATTR].model is self:
            del self.module.__dict__[OWNER_ATTR]
        return self.module

    def step_figures(self) -> dict[str, float]:
        """Every axis's figures of the training step that just ran (e.g. the MoE layers' load imbalance and the ep
        all-to-all bytes), to log under ``parallel/``."""
        out: dict[str, float] = {}
        for figures in self._step_logs:
            out.update(figures())
        return out

    def summary(self) -> dict[str, Any]:
        """Every axis's figures for ``summary.json``, and the step hooks'."""
        out: dict[str, Any] = {"activation_checkpointed_modules": len(self.checkpointed)}
        for summary in self._summaries:
            out.update(summary())
        out.update(self.steps.summary())
        return out


class _Owner:
    """The box of :data:`OWNER_ATTR`: a deep copy or a pickle of the module carries ``None`` instead."""

    def __init__(self, model: ParallelModel) -> None:
        self.model = model

    def __deepcopy__(self, memo: dict[int, Any]) -> None:
        return None

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _nothing, ()


def _nothing() -> None:
    return None


def parallel_model_of(module: nn.Module) -> ParallelModel | None:
    """The :class:`ParallelModel` :func:`parallelize` made of ``module`` and that still owns it (``None``: a plain
    module)."""
    owner = module.__dict__.get(OWNER_ATTR)
    return owner.model if isinstance(owner, _Owner) else None


def validate(module: nn.Module, dims: ParallelDims, options: ParallelOptions) -> None:
    """Every check :func:`parallelize` would make that needs no process group: the options against the layout, and
    every registered axis's checks of the network against its contract (the plan against the network, the split
    against the layers, ...).

    Raises:
        ValueError: the first problem, naming the field, the value and what would be valid.
    """
    options.check_layout(dims.pp_size)
    network = contract.find_network(module, options.module_attr, dims.pp_enabled)
    for axis in AXES:
        if axis.check is not None:
            axis.check(module, network, dims, options)


def parallelize_order() -> list[tuple[str, str, Callable[[Build], None]]]:
    """``(phase, axis name, step)`` of every registered axis's steps, in the order :func:`parallelize` runs them: by
    phase (:data:`~lightning_par.axis_registry.PHASES`), then by the axis's place in :data:`~lightning_par.axes.AXES`.
    ``docs/architecture.md`` lists it (a unit test keeps the page equal to it)."""
    steps = [(PHASES[phase], n, phase, axis.name, step) for n, axis in enumerate(AXES) for phase, step in axis.steps]
    return [(phase, name, step) for _, _, phase, name, step in sorted(steps, key=lambda t: t[:2])]


def parallelize(
    module: nn.Module,
    dims: ParallelDims,
    options: ParallelOptions,
    *,
    device: torch.device,
    training: bool = True,
    step_context: Callable[[], AbstractContextManager[Any]] | None = None,
    check: bool = True,
) -> ParallelModel:
    """Turn ``module`` into this rank's parallel form (in place): every registered axis's steps in phase order (see
    the module docstring). Collective over the world: every rank calls it.

    Args:
        module: the LightningModule (or any ``nn.Module`` meeting :mod:`lightning_par.contract`), equal on every rank
            (each replica starts from dp rank 0's values, each tp shard from tp rank 0's).
        dims: the layout; its meshes are built here if they are not yet (:meth:`ParallelDims.build_mesh`).
        options: what to apply.
        device: this rank's device.
        training: ``False`` for validate/test/predict: ZeRO stages 1 and 2 then keep plain replicas (there is no
            optimizer to shard); ``zero3`` still shards.
        step_context: entered around each pipeline schedule run (autocast, the vocab-parallel loss context).
        check: run :func:`validate` first (``False`` when the caller has just validated this module and layout).

    A module an earlier call parallelised (a second, new Trainer on the same module) is first put back to its plain
    form with the trained values (:meth:`ParallelModel.unparallelize`, collective with the earlier layout's meshes).

    Returns:
        The :class:`ParallelModel`, which owns ``module`` until :meth:`ParallelModel.unparallelize`.

    Raises:
        ValueError: see :func:`validate`.
    """
    previous = parallel_model_of(module)
    if previous is not None:
        previous.unparallelize()
    if check:
        validate(module, dims, options)
    dims.build_mesh(device.type)
    build = Build(
        module=module, dims=dims, options=options, device=device, training=training, step_context=step_context,
        network=contract.find_network(module, options.module_attr, dims.pp_enabled),
    )
    snapshot = ModuleSnapshot(module)
    for _, _, step in parallelize_order():
        step(build)
    snapshot.seal(live=build.stage_modules)
    model = ParallelModel(build, snapshot)
    module.__dict__[OWNER_ATTR] = _Owner(model)
    return model
