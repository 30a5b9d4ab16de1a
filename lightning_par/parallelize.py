"""One composition path: every strategy turns a LightningModule into its parallel form here, in one fixed order.

:func:`parallelize` applies, to this rank's part of the model:

1. **pipeline cut** (``pp_size > 1``): this rank's virtual stage(s) of the network (:mod:`lightning_par.contract`,
   :func:`~lightning_par.pipeline_parallel.split.cut_network`); the LightningModule keeps only their parameters, under
   their whole-model names;
2. **tensor parallelism** (``tp_size > 1``) on the tp sub-mesh: the plan (paths relative to the network) on what this
   rank holds (:func:`~lightning_par.tensor_parallel.apply_tensor_parallel`);
   then **activation checkpointing** (``activation_checkpointing`` ``"full"`` or ``"selective"``) of the modules the
   model names (:func:`~lightning_par.activation_checkpointing.apply_activation_checkpointing`), inside the tp styles'
   hooks and outside the dp mode's (torchtitan's order: TP, activation checkpointing, FSDP);
3. **the dp mode** on the dp sub-mesh: ``ddp`` (bucketed, overlapped all-reduce), ``zero1``, ``zero2`` or ``zero3``
   (:func:`~lightning_par.data_parallel.engine.apply_data_parallel`);
4. **the schedule** (``pp_size > 1``): torch's ``PipelineStage`` + schedule over the stage modules
   (:class:`~lightning_par.pipeline_parallel.engine.PipelineEngine`).

The order is Megatron-LM's "PTD-P" (Narayanan et al. 2021, §2.3) as torchtitan applies it (``parallelize_llama``:
TP, then FSDP on the dp mesh, then the pipeline schedule over the stage modules). A single-technique strategy is the
same path with the other sizes at 1. :func:`validate` runs the same checks without any process group.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ContextManager

import torch
import torch.distributed as dist
from torch import nn

from lightning_par import contract
from lightning_par.activation_checkpointing import ACTIVATION_CHECKPOINTING, apply_activation_checkpointing
from lightning_par.data_parallel.engine import DataParallelEngine, apply_data_parallel
from lightning_par.data_parallel.options import DP_MODES, ReducerOptions, ZeroOptions, resolve_zero_options, zero_stage
from lightning_par.data_parallel.options import ZERO_GROUP_DEFAULTS
from lightning_par.parallel_dims import ParallelDims
from lightning_par.pipeline_parallel.engine import PipelineEngine
from lightning_par.pipeline_parallel.options import PipelineOptions
from lightning_par.pipeline_parallel.split import cut_network, plan_split, validate_split
from lightning_par.tensor_parallel.apply import apply_tensor_parallel
from lightning_par.tensor_parallel.options import TensorParallelOptions
from lightning_par.tensor_parallel.plan import uses_vocab_parallel_loss, validate_plan
from lightning_par.validation import check_choice

__all__ = ["OPTION_GROUPS", "ParallelModel", "ParallelOptions", "parallelize", "validate"]

#: User-facing ZeRO fields (``strategy.zero.*``); the rest of :class:`ZeroOptions` comes from ``dp_mode`` and the
#: reducer group.
_ZERO_DEFAULTS: dict[str, Any] = ZERO_GROUP_DEFAULTS
_ZERO_FIELDS: tuple[str, ...] = tuple(_ZERO_DEFAULTS)

#: Option group name -> the flat keyword names it owns.
OPTION_GROUPS: dict[str, tuple[str, ...]] = {
    "reducer": tuple(f.name for f in fields(ReducerOptions)),
    "zero": _ZERO_FIELDS,
    "tensor_parallel": tuple(f.name for f in fields(TensorParallelOptions)),
    "pipeline": tuple(f.name for f in fields(PipelineOptions)),
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
        owner = {name: g for g, names in OPTION_GROUPS.items() for name in names}
        for key, value in options.items():
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
            tensor_parallel=TensorParallelOptions(**groups["tensor_parallel"]),
            pipeline=PipelineOptions(**groups["pipeline"]),
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


def _put(group: dict[str, Any], group_name: str, name: str, value: Any) -> None:
    if value is None:  # None is "the default" (the Hydra schemas leave unset options at None)
        return
    if name in group:
        raise ValueError(f"{group_name}.{name} is given twice (flat and nested); give it once.")
    group[name] = value


@dataclass
class ParallelModel:
    """What :func:`parallelize` made of a LightningModule on this rank.

    Attributes:
        module: the LightningModule (under pipelining its network is replaced by ``network``).
        network: this rank's part of the network: the whole network, or under pipelining the holder of its stages'
            parameters (whole-model names), with tensor parallelism applied.
        engine: the dp axis.
        pipeline: the schedule over ``stage_modules`` (``None`` without pipelining).
        stage_modules: the modules the schedule runs, in chunk order.
        layer_counts: layers per virtual stage (``None`` without pipelining).
        loss_parallel: the plan has a ``vocab_head``: the loss (forward and backward) must run under the vocab-parallel
            loss context.
        training: built for training (ZeRO stages 1 and 2 shard only then).
        checkpointed: paths (relative to the network) of the modules whose activations are recomputed on this rank.
    """

    module: nn.Module
    network: nn.Module
    engine: DataParallelEngine
    pipeline: PipelineEngine | None = None
    stage_modules: list[nn.Module] = field(default_factory=list)
    layer_counts: list[int] | None = None
    loss_parallel: bool = False
    training: bool = True
    checkpointed: list[str] = field(default_factory=list)


def validate(module: nn.Module, dims: ParallelDims, options: ParallelOptions) -> None:
    """Every check :func:`parallelize` would make that needs no process group: the options against the layout, the
    network against the contract, the plan against the network, the split against the layers.

    Raises:
        ValueError: the first problem, naming the field, the value and what would be valid.
    """
    options.check_layout(dims.pp_size)
    network = contract.find_network(module, options.module_attr, dims.pp_enabled)
    if dims.pp_enabled:
        contract.pipeline_loss(module)
        names = contract.pipeline_layers(network)
        validate_split(options.pipeline.split, len(names), options.pipeline.num_stages(dims.pp_size), dims.pp_size)
    if dims.tp_enabled:
        tp = options.tensor_parallel
        plan = contract.tp_plan(module, network, tp.plan)
        contract.check_tensor_parallel(network, dims.tp_size, tp.sequence_parallel)
        validate_plan(network, plan, dims.tp_size, tp.sequence_parallel)
    if options.activation_checkpointing != "none":
        for path in contract.checkpoint_modules(network, options.activation_checkpointing):
            try:
                network.get_submodule(path)
            except AttributeError as err:
                raise ValueError(
                    f"activation_checkpointing={options.activation_checkpointing!r}: checkpoint_modules() path {path!r} "
                    f"names no module of {type(network).__name__} ({err})."
                ) from err
    if options.dp_mode != "ddp" and not any(p.requires_grad for p in module.parameters()):
        raise ValueError(
            f"{type(module).__name__} has no parameter that requires a gradient: dp_mode={options.dp_mode!r} has "
            f"nothing to shard. Build the layers in __init__ or configure_model, or use dp_mode='ddp'."
        )


def _layer_counts(module: nn.Module, network: nn.Module, dims: ParallelDims, options: PipelineOptions,
                  device: torch.device) -> list[int]:
    num_stages = options.num_stages(dims.pp_size)
    split = options.split
    if not isinstance(split, str) or split == "params":
        return plan_split(network, num_stages, split)
    counts: list[Any] = [None]
    if dist.get_rank() == 0:  # profile once: timings differ between ranks, and every rank must cut alike
        sample = tuple(t.to(device) for t in contract.pipeline_sample(module, network))
        counts[0] = plan_split(
            network, num_stages, split, sample, timeout_s=options.split_timeout_s, device=device,
            num_microbatches=options.num_microbatches,
        )
    dist.broadcast_object_list(counts, src=0)
    return counts[0]


def parallelize(
    module: nn.Module,
    dims: ParallelDims,
    options: ParallelOptions,
    *,
    device: torch.device,
    training: bool = True,
    step_context: Callable[[], ContextManager] | None = None,
) -> ParallelModel:
    """Turn ``module`` into this rank's parallel form (in place): pipeline cut -> tensor parallel -> dp mode ->
    schedule (see the module docstring). Collective over the world: every rank calls it.

    Args:
        module: the LightningModule (or any ``nn.Module`` meeting :mod:`lightning_par.contract`), equal on every rank
            (each replica starts from dp rank 0's values, each tp shard from tp rank 0's).
        dims: the layout, whose mesh exists (:meth:`ParallelDims.build_mesh`).
        options: what to apply.
        device: this rank's device.
        training: ``False`` for validate/test/predict: ZeRO stages 1 and 2 then keep plain replicas (there is no
            optimizer to shard); ``zero3`` still shards.
        step_context: entered around each pipeline schedule run (autocast, the vocab-parallel loss context).

    Returns:
        The :class:`ParallelModel`.

    Raises:
        ValueError: see :func:`validate`.
    """
    validate(module, dims, options)
    mesh = dims.build_mesh(device.type)
    network = contract.find_network(module, options.module_attr, dims.pp_enabled)
    tp = options.tensor_parallel
    # The plan and the checkpointed modules of the whole network, before the cut: a model's tp_plan() and
    # checkpoint_modules() may read its own structure.
    plan = contract.tp_plan(module, network, tp.plan) if dims.tp_enabled else None
    ac = options.activation_checkpointing
    ac_paths = contract.checkpoint_modules(network, ac) if ac != "none" else []
    stage_modules: list[nn.Module] = []
    counts = stage_ids = None
    if dims.pp_enabled:  # 1. this rank's pipeline stage(s)
        counts = _layer_counts(module, network, dims, options.pipeline, device)
        stage_ids = options.pipeline.stage_ids(dims.coordinates(dist.get_rank())["pp"], dims.pp_size)
        network, stage_modules = cut_network(network, counts, stage_ids)
        setattr(module, options.module_attr, network)  # type: ignore[arg-type]
    loss_parallel = False
    if plan is not None:  # 2. tensor parallelism inside the stage(s)
        apply_tensor_parallel(
            network, mesh["tp"], plan, tp.sequence_parallel, skip_absent=dims.pp_enabled,
            eager_grad_reduction=not dims.pp_enabled,
        )
        loss_parallel = uses_vocab_parallel_loss(plan)
    checkpointed: list[str] = []
    if ac_paths:  # 2b. activation checkpointing: inside the tp styles' hooks, outside the dp mode's
        checkpointed = apply_activation_checkpointing(network, ac_paths, skip_absent=dims.pp_enabled)
    # 3. the dp mode on the dp axis (over the whole LightningModule: its state names are the checkpoint's)
    dp_mode = options.dp_mode if training or options.dp_mode == "zero3" else None
    engine = apply_data_parallel(
        module, mesh["dp"], dp_mode or "ddp", options.reducer, options.zero if dp_mode not in (None, "ddp") else None,
        stage_modules=stage_modules or None, communicate=dp_mode is not None,
    )
    pipeline = None
    if dims.pp_enabled:  # 4. the schedule over the stage modules
        pipeline = PipelineEngine(
            stage_modules, stage_ids, options.pipeline, mesh["pp"].get_group(), dims.pp_size, device,  # type: ignore[arg-type]
            contract.pipeline_loss(module), step_context,
        )
    return ParallelModel(module, network, engine, pipeline, stage_modules, counts, loss_parallel, training, checkpointed)
