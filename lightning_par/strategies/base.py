"""``MeshStrategy``: the one strategy core. Every lightning_par strategy is a preset of it.

It is Lightning's adapter for the parallel model: it owns the validated :class:`~lightning_par.parallel_dims.
ParallelDims`, the process group (with a collective timeout, so a dead rank ends the job instead of hanging it), the
device mesh of named axes, data sharding over the **dp** ranks only (the tp, cp and pp ranks of one replica see the
same batch), and it drives the :class:`~lightning_par.parallelize.ParallelModel` that :func:`lightning_par.parallelize.
parallelize` builds from the registered axes, through one step protocol (:class:`~lightning_par.steps.StepHooks`):
Lightning's ``training_step``, ``backward``, ``block_backward_sync`` and the evaluation steps go to
``parallel.steps``; the gradient finishers run once per optimizer step; checkpoints take the parallel model's
one-process state. Checkpoints are sharded ``torch.distributed.checkpoint`` directories committed atomically
(:mod:`lightning_par.checkpoint`), loadable into any layout, strategy and one process.
"""

from __future__ import annotations

import atexit
import logging
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_par.axes import EVERY_AXIS, axis_of_group, check_sizes
from lightning_par.checkpoint.strategy_io import ShardedCheckpointIO
from lightning_par.compat.fabric import (
    default_process_group_backend_for_device,
    distributed_is_initialized,
    init_dist_connection,
    optimizers_to_device,
    sync_ddp_if_available,
)
from lightning_par.compat.lightning import SubprocessScriptLauncher
from lightning_par.compat.lightning import before_batch_transfer, data_fetcher, plain_optimizer, set_module_device_mesh
from lightning_par.data_parallel.fault_tolerance import (
    FaultTolerantReplicas,
    check_fault_tolerance,
    check_lighthouse,
    check_train_data,
    move_train_data,
)
from lightning_par.callbacks.metrics import log_comm_stats, log_host_number
from lightning_par.callbacks.model_summary import install as install_model_summary
from lightning_par.fault.elastic import init_process_group_per_attempt
from lightning_par.fault.orphan import guard_outside_launcher
from lightning_par.fault.preemption import PreemptionWatch
from lightning_par.fault.process_group_exit import FAILED, destroy_process_group_at_exit
from lightning_par.parallel_dims import ParallelDims
from lightning_par.parallelize import (
    OPTION_GROUPS,
    ParallelModel,
    ParallelOptions,
    parallel_model_of,
    parallelize,
    validate,
)
from lightning_par.precision import check_precision, distributed_scaler, fsdp_mixed_precision
from lightning_par.validation import MAX_TIMEOUT_S, check_number

__all__ = ["MeshStrategy"]

_log = logging.getLogger(__name__)

def _split_batch(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """``(batch, the other positional arguments, the other keyword arguments)`` of a Lightning step call."""
    if args:
        return args[0], args[1:], kwargs
    rest = dict(kwargs)
    return rest.pop("batch", None), (), rest



def check_callbacks(trainer: Any, module: torch.nn.Module, dims: ParallelDims, dp_mode: str) -> None:
    """Refuse, before the first step, Lightning callbacks that would crash or train wrongly under this layout.

    Each was run under every registered strategy and layout by the Lightning feature matrix (``tests/strategies/test_lightning_matrix.py``,
    2026-11-28) against one process:

    - ``StochasticWeightAveraging`` and ``WeightAveraging`` (``EMAWeightAveraging``) keep a deep copy of the module and
      copy whole tensors in and out of it. Where parameters are DTensor shards (``tp_size``/``ep_size`` > 1,
      ``dp_mode="zero3"``) the first average raised ``aten.copy_.default got mixed torch.Tensor and DTensor``; under
      pipelining the stages' optimizer steps fell out of step and the run hung until the collective timeout.
      Lightning refuses SWA for its own FSDP the same way.
    - ``BaseFinetuning`` (``BackboneFinetuning``) freezes modules before training and adds them to the optimizer
      later. The dp gradient reducer (``ddp``, ``zero1``, ``zero2``, over dp and cp ranks) is built for the parameters
      that train at the start, so the unfrozen ones were never averaged: each replica stepped on its own gradient and
      the replicas drifted apart silently (Lightning's own DDP does the same); ZeRO-1/2 raised ``KeyError`` on the new
      param group; pipelining hung. FSDP2 (``zero3``) and tensor parallelism without dp replicas match one process.
    - ``ModelPruning`` re-registers each pruned weight as ``<name>_orig`` and a mask. ZeRO-1/2 then trained wrongly
      from the first step after pruning (loss rel 8.5e-3), and DTensor shards refused the masked in-place update.
      Plain ``dp_mode="ddp"`` (with cp or ep) matches one process.

    Raises:
        ValueError: naming the callback, the sizes or dp mode that rule it out, and the layouts where it runs.
    """
    from lightning.pytorch.callbacks import (
        BaseFinetuning,
        ModelPruning,
        StochasticWeightAveraging,
        WeightAveraging,
    )

    callbacks = list(trainer.callbacks)
    sizes = [f"{k}={v}" for k, v in (("pp_size", dims.pp_size), ("tp_size", dims.tp_size), ("ep_size", dims.ep_size))
             if v > 1]
    mode = [f"dp_mode={dp_mode!r}"] if dp_mode != "ddp" else []

    def refuse(callback: Any, why: list[str], detail: str, runs: str) -> None:
        raise ValueError(f"{type(callback).__name__} is not supported with {', '.join(why)}: {detail} It runs under "
                         f"{runs}; remove the callback or train under one of those.")

    for callback in callbacks:
        if isinstance(callback, (StochasticWeightAveraging, WeightAveraging)):
            why = sizes + (["dp_mode='zero3'"] if dp_mode == "zero3" else [])
            if not why and any(isinstance(p, DTensor) for p in module.parameters()):
                why = ["DTensor parameters"]
            if why:
                refuse(callback, why, "its averaged copy of the model holds whole tensors, and here each rank holds "
                       "shards or one pipeline stage of the parameters.", "ddp_overlap, zero1, zero2 and context "
                       "parallelism (whole parameters on every rank)")
        elif isinstance(callback, BaseFinetuning):
            replicas = dims.size("dp_cp")  # the ranks the dp gradient reducer averages over
            why = [f"pp_size={dims.pp_size}"] if dims.pp_size > 1 else []
            if dp_mode != "zero3" and replicas > 1:
                why.append(f"dp_mode={dp_mode!r} over {replicas} ranks that average gradients")
            if why:
                refuse(callback, why, "the gradient reducer is built for the parameters that train at the start, so "
                       "modules it unfreezes later would not be averaged across replicas (each would drift on its own "
                       "gradient).", "dp_mode='zero3' (FSDP2, with tp too) and tp without dp replicas")
        elif isinstance(callback, ModelPruning):
            why = sizes[:1] if dims.pp_size > 1 else []
            why += [s for s in sizes if s.startswith("tp_size")] + mode
            if why:
                refuse(callback, why, "pruning re-registers each pruned weight as '<name>_orig' with a mask, which the "
                       "sharded optimizer state and DTensor shards do not follow.", "dp_mode='ddp' without tp or pp "
                       "(with context or expert parallelism too)")

class MeshStrategy(ShardedCheckpointIO, ParallelStrategy):
    """Every registered axis on one mesh, for any LightningModule meeting :mod:`lightning_par.contract`.

    Args:
        dp_size: data-parallel ranks (different batches), ``dp_replicate_size * dp_shard_size``; ``-1`` infers
            ``world_size // (pp_size * cp_size * tp_size)``.
        tp_size: tensor-parallel ranks per stage.
        pp_size: pipeline ranks.
        dp_mode: ``"ddp"`` (bucketed all-reduce overlapped with backward), ``"zero1"``, ``"zero2"`` or ``"zero3"``.
        dp_replicate_size: HSDP replicas (``> 1``: each dp mode shards within ``dp_shard`` and reduces across the
            replicas; ``ddp`` all-reduces over all of them).
        dp_shard_size: ranks the model state is sharded over (ZeRO's ``N``); ``-1``: ``dp_size // dp_replicate_size``.
        module_attr: attribute of the LightningModule holding the network (see :mod:`lightning_par.contract`).
        activation_checkpointing: ``"none"``, ``"full"`` (recompute every block in backward) or ``"selective"`` (the
            attention of every block); applied after tensor parallelism and before the dp mode.
        timeout_s: seconds a collective may wait for a peer before it raises (gloo and nccl), so that a dead or
            stuck rank ends the job with an error instead of a hang.
        prog_bar: also show the strategy's own figures (``parallel/...``) in the progress bar.
        process_group_backend: ``"gloo"`` or ``"nccl"``; default: nccl on CUDA, gloo on CPU.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as for Lightning's
            ``DDPStrategy`` (the Trainer fills them in).
        **options: the size of every further registered axis (a size field of
            :class:`~lightning_par.parallel_dims.ParallelDims`: ``cp_size`` context-parallel ranks, ``ep_size``
            expert-parallel ranks borrowed from ``dp_shard_size * cp_size``; 1 by default), and the option groups,
            flat or nested (:data:`lightning_par.parallelize.OPTION_GROUPS`):
            ``reducer`` (``bucket_cap_mb``, ``gradient_as_bucket_view``, ``static_graph``, ``comm_hook``,
            ``powersgd_rank``, ``powersgd_start_iter``), ``zero`` (``cpu_offload``, ``mixed_precision``,
            ``reshard_after_forward``), ``tensor_parallel`` (``sequence_parallel``, ``plan``), ``pipeline``
            (``schedule``, ``num_microbatches``, ``virtual_stages``, ``split``, ``split_timeout_s``,
            ``measure_bubble``), ``compile`` (``enabled``, ``backend``, ``mode``, ``fullgraph``; given nested only,
            ``compile={"enabled": True}``: ``torch.compile`` of every block, docs/compile.md).

    Raises:
        ValueError: here, an invalid size, option or combination, or a size or option of an axis this strategy does
            not have; before the process group starts (:meth:`validate_model`), a model the layout cannot run (see
            :func:`lightning_par.parallelize.validate`) or ``cpu_offload`` on a CPU device.
    """

    strategy_name: ClassVar[str] = "mesh"
    #: The registered axes (``Axis.name``) this strategy refuses: a preset named for one classic technique excludes the
    #: other classic axes (``tp``, ``pp``); every other registered axis (``cp``, ``ep``, the next one) is in every preset.
    excluded_axes: ClassVar[frozenset[str]] = frozenset()
    #: Lightning registry names of the class and the options each name implies.
    registry_names: ClassVar[tuple[str, ...]] = ()
    registry_presets: ClassVar[dict[str, dict[str, Any]]] = {}
    #: one line for ``StrategyRegistry``'s listing.
    description: ClassVar[str] = ""

    def __init__(
        self,
        dp_size: int = -1,
        tp_size: int = 1,
        pp_size: int = 1,
        dp_mode: str = ParallelOptions.dp_mode,
        *,
        dp_replicate_size: int = 1,
        dp_shard_size: int = -1,
        module_attr: str | None = ParallelOptions.module_attr,
        activation_checkpointing: str = ParallelOptions.activation_checkpointing,
        timeout_s: float = 1800.0,
        prog_bar: bool = False,
        process_group_backend: str | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        **options: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        sizes = {"dp_size": dp_size, "tp_size": tp_size, "pp_size": pp_size}
        sizes.update({k: v for k, v in (("dp_replicate_size", dp_replicate_size), ("dp_shard_size", dp_shard_size))
                      if v != (-1 if k == "dp_shard_size" else 1)})
        further = {k: options.pop(k) for k in [k for k in options if k in ParallelDims.size_names()]}
        sizes.update({k: v for k, v in further.items() if v != 1})
        self.check_axes(sizes)
        for key in options:
            group = key if key in OPTION_GROUPS else next((g for g, n in OPTION_GROUPS.items() if key in n), None)
            axis = axis_of_group(group) if group is not None else None
            if axis is not None and not self.has_axis(axis.name):
                raise ValueError(
                    f"{key} is an option of the {axis.name} axis, which {type(self).__name__} does not have: "
                    f"remove it, or use a strategy with that axis ({EVERY_AXIS})."
                )
        self.options = ParallelOptions.build(dp_mode, module_attr, activation_checkpointing, **options)
        self.options.check_layout(pp_size)
        self._sizes = sizes
        check_fault_tolerance(self.options, sizes)
        self.ft: Any = None  # the FaultTolerantReplicas of this rank (fault_tolerance.enabled), from setup()
        self._ft_batch_idx: int | None = None  # the live group's batch index, for the step a group rejoins in
        self._timeout_s = check_number("timeout_s", timeout_s, unit="seconds", maximum=MAX_TIMEOUT_S)
        self.prog_bar = bool(prog_bar)
        self._process_group_backend = process_group_backend
        self.parallel_dims: ParallelDims | None = None
        self.parallel: ParallelModel | None = None
        self._validated: Any = None  # the module validate_model checked (parallelize then does not check it again)
        self._exception: BaseException | None = None  # the run's error (teardown then never raises over it)
        self.num_nodes = 1

    @classmethod
    def has_axis(cls, name: str) -> bool:
        """Whether this strategy may use the registered axis ``name``."""
        return name not in cls.excluded_axes

    @classmethod
    def check_axes(cls, sizes: dict[str, Any], prefix: str = "", label: str | None = None) -> None:
        """Refuse a size > 1 on an axis this strategy does not have (:func:`lightning_par.axes.check_sizes`).

        Raises:
            ValueError: naming the field, the value, and what would be valid.
        """
        check_sizes(sizes, cls.has_axis, prefix, label or cls.__name__)

    @property
    def dp_mode(self) -> str:
        return self.options.dp_mode

    # ------------------------------------------------------------------ layout
    @property
    def is_distributed(self) -> bool:
        """Always ``True``: Lightning then injects a ``DistributedSampler`` (over the dp axis, see below)."""
        return True

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def device_mesh(self):  # noqa: ANN201 - DeviceMesh, imported lazily
        """The DeviceMesh of :data:`~lightning_par.parallel_dims.MESH_AXES`.

        Raises:
            RuntimeError: before :meth:`setup_environment` has built it.
        """
        if self.parallel_dims is None or self.parallel_dims._mesh is None:
            raise RuntimeError("The device mesh exists only after the strategy's setup_environment().")
        return self.parallel_dims._mesh

    def resolve_parallel_dims(self, world_size: int) -> ParallelDims:
        """Validate the requested sizes against ``world_size`` (no process group needed).

        Raises:
            ValueError: the sizes do not multiply to ``world_size``; the message names the fields and values.
        """
        return ParallelDims(world_size=world_size, **self._sizes)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Shard batches over the dp ranks only: every tp, cp and pp rank of a replica reads the same samples."""
        dims = self.parallel_dims
        assert dims is not None
        ft = self.options.fault_tolerance
        if ft.enabled:  # every replica group's dp ranks, in group order: a group that is down leaves its share out
            return {"num_replicas": dims.dp_size * ft.num_replica_groups,
                    "rank": ft.replica_group_id * dims.dp_size + dims.coordinates(self.global_rank)["dp"]}
        return {"num_replicas": dims.dp_size, "rank": dims.coordinates(self.global_rank)["dp"]}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    # ------------------------------------------------------------------ processes
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def setup_environment(self) -> None:
        # Under torchrun/SLURM this worker ends with its launcher (with a preemption watch: as if preempted).
        guard_outside_launcher(clean_stop=PreemptionWatch.current() is not None)
        super().setup_environment()
        self.set_world_ranks()
        self._exception = None
        self.unparallelize_previous()
        # Validate the layout, and the model against it, before any process group starts.
        dims = self.resolve_parallel_dims(self.num_nodes * self.num_processes)
        self.validate_model(dims)
        ft = self.options.fault_tolerance
        if ft.enabled:  # an unreachable lighthouse is named now, within connect_timeout_s, before any process group
            ft.bind_host(ft.lighthouse_address())  # and a bind address the job cannot use
            check_lighthouse(ft.lighthouse_address(), ft.connect_timeout_s)
        reset_seed()
        self._process_group_backend = self._process_group_backend or default_process_group_backend_for_device(
            self.root_device
        )
        assert self.cluster_environment is not None
        started = not dist.is_initialized()
        if started:  # under torchrun --max-restarts: a group in a store namespace of this attempt (no-op otherwise)
            accelerator = "gpu" if self.root_device.type == "cuda" else "cpu"
            init_process_group_per_attempt(accelerator, self._timeout_s)
        init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=timedelta(seconds=self._timeout_s)
        )
        if started:
            atexit.register(destroy_process_group_at_exit)
        mesh = dims.build_mesh(self.root_device.type)
        self.parallel_dims = dims
        if self.lightning_module is not None:  # as Lightning's ModelParallelStrategy: visible in configure_model
            set_module_device_mesh(self.lightning_module, mesh)

    def unparallelize_previous(self) -> None:
        """A module that another strategy's run parallelised (a second, new Trainer on the same module) goes back to
        its plain form with the trained values before this run checks and parallelises it
        (:meth:`~lightning_par.parallelize.ParallelModel.unparallelize`: collective, with that run's meshes). The
        module this strategy itself parallelised (``fit`` again on the same Trainer) is kept as it is.

        Raises:
            RuntimeError: the process group the module was parallelised with is gone.
        """
        module = self.lightning_module
        previous = parallel_model_of(module) if module is not None else None
        if previous is None or previous is self.parallel:
            return
        if not dist.is_initialized():
            raise RuntimeError(
                f"{type(module).__name__} was parallelised by an earlier lightning_par run whose process group is "
                f"gone, so its shards cannot be gathered back: build a new module and load the earlier run's "
                f"checkpoint (lightning_par.checkpoint.load_from_checkpoint), or keep the process group alive."
            )
        previous.unparallelize()

    def validate_model(self, dims: ParallelDims) -> None:
        """Check the LightningModule against the layout before the process group starts (all of
        :func:`lightning_par.parallelize.validate`, unless ``configure_model`` builds the layers later; then
        :meth:`setup` checks them).

        Raises:
            ValueError: see :func:`lightning_par.parallelize.validate`; ``cpu_offload=True`` on a CPU device; fp16
                loss scaling (``"16-mixed"``) with pipelining.
        """
        self.options.check_layout(dims.pp_size)
        check_precision(self.precision, dims.pp_size, getattr(self.precision_plugin, "scaler", None) is not None)
        if self.options.zero is not None and self.options.zero.cpu_offload and self.root_device.type == "cpu":
            raise ValueError(
                "cpu_offload=True is not valid on a CPU device: FSDP2's CPUOffloadPolicy moves shards between an "
                "accelerator and the CPU. Run on a GPU or set cpu_offload=False."
            )
        module = self.lightning_module
        # A module this strategy already parallelised (fit again) was checked then; it is reused as it is.
        if module is not None and not is_overridden("configure_model", module) and parallel_model_of(module) is None:
            validate(module, dims, self.options)
            self._validated = module

    @override
    def setup(self, trainer: Any) -> None:
        assert self.model is not None and self.accelerator is not None and self.parallel_dims is not None
        check_precision(self.precision, self.parallel_dims.pp_size,
                        getattr(self.precision_plugin, "scaler", None) is not None)
        self.accelerator.setup(trainer)
        # fit / validate again on this Trainer: the module this strategy parallelised is on its device and converted
        # already, and is reused as it is. Moving or converting it again would replace every DTensor parameter's
        # tensor (nn.Module._apply swaps tensor subclasses), which drops the gradient hooks of the dp reducer and of
        # tensor parallelism: measured, 0 hook calls after `.cpu()` on CPU, and zero gradients for the split
        # parameters at dp 2 x tp 2.
        reuse = self.parallel is not None and parallel_model_of(self.model) is self.parallel
        if not reuse:
            self.model = self.precision_plugin.convert_module(self.model)
            self.model_to_device()
        if self.parallel is None or self.parallel.module is not self.model:
            if self.parallel is not None:  # another module: its engines stay, undone if it is parallelised again
                self.parallel.remove_hooks()
            self.parallel = parallelize(
                self.model, self.parallel_dims, self.precision_options(), device=self.root_device,
                step_context=self._step_context, check=self._validated is not self.lightning_module,
            )
        if trainer.state.fn == TrainerFn.FITTING:
            check_callbacks(trainer, self.model, self.parallel_dims, self.dp_mode)
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None and dist.get_world_size() > 1:
            # Each rank sees only its gradient shard (ZeRO, TP): skip a step on every rank or on none.
            self.precision_plugin.scaler = distributed_scaler(scaler)
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)
            if self.options.fault_tolerance.enabled and self.ft is None:
                self.ft = FaultTolerantReplicas(
                    self.options.fault_tolerance, self.lightning_module,
                    lambda: [plain_optimizer(o) for o in self.optimizers],
                    dist.get_rank(), dist.get_world_size(),
                )
                if self.options.fault_tolerance.diloco_sync_every:
                    if len(self.optimizers) != 1:
                        raise ValueError(
                            f"fault_tolerance.diloco_sync_every needs exactly one optimizer (the inner one); "
                            f"configure_optimizers returned {len(self.optimizers)}."
                        )
                    self.ft.enter_diloco(plain_optimizer(self.optimizers[0]))
        # Norm clipping must see the whole model's norm: every shard, every stage.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]
        # Value clipping clamps each rank's gradient shards (torch's clip_grad_value_ refuses DTensor gradients).
        self.precision_plugin.clip_grad_by_value = self._clip_grad_by_value  # type: ignore[method-assign]
        install_model_summary(trainer)  # Lightning's ModelSummary counts the whole model, not this rank's part

    @property
    def precision(self) -> str:
        """Lightning's precision of this run (``"32-true"`` before the Trainer attaches its plugin)."""
        return str(getattr(self.precision_plugin, "precision", "32-true"))

    def precision_options(self, precision: str | None = None) -> ParallelOptions:
        """The options :func:`~lightning_par.parallelize.parallelize` runs with under this run's precision: with
        ``dp_mode="zero3"`` and no ``zero.mixed_precision`` of the user's, FSDP2's mixed precision policy of
        :func:`lightning_par.precision.fsdp_mixed_precision` (half-precision parameters for compute, fp32 gradient
        reduction) under ``"bf16-mixed"`` / ``"16-mixed"``; the options as given otherwise. ``precision``: another
        precision string than the Trainer's (the Fabric strategies pass Fabric's)."""
        zero = self.options.zero
        policy = fsdp_mixed_precision(precision or self.precision)
        if zero is None or zero.stage != 3 or policy is None or (zero.param_dtype, zero.reduce_dtype) != (None, None):
            return self.options
        return replace(self.options, zero=replace(zero, param_dtype=policy[0], reduce_dtype=policy[1]))

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        assert self.parallel is not None
        parallel = self.parallel
        for optimizer in self.optimizers:
            optimizer = plain_optimizer(optimizer)
            parallel.engine.shard_optimizer(optimizer)
            if parallel.has_optimizer_step_hooks:  # after the engine's own post-hook (ZeRO's all-gather of the shards)
                optimizer.register_step_post_hook(lambda *_: parallel.after_optimizer_step())

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Remember the failure: the exit hook then leaves the process group alone (see
        :func:`~lightning_par.fault.process_group_exit.destroy_process_group_at_exit`), and :meth:`teardown` raises
        nothing over it."""
        FAILED[0] = True
        self._exception = exception
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        """Lightning's teardown (``ParallelStrategy.teardown`` and ``Strategy.teardown`` of Lightning 2.6), except that
        a module this strategy parallelised stays where it is: moving it to the CPU replaces its DTensor parameters'
        tensors and drops the engines' gradient hooks (see :meth:`setup`), so a later ``fit`` on this Trainer would
        train wrongly; a new Trainer takes it back to its plain form first
        (:meth:`~lightning_par.parallelize.ParallelModel.unparallelize`).

        After the run's error (Lightning tears down while that error propagates) every part is tried and none of its
        own errors replaces the user's: an error raised here would be printed last, the user's exception buried above
        it (FSDP2 left mid-forward by the error cannot even be moved: ``'Parameter' object has no attribute
        '_local_tensor'``). The parameters are resharded first then.
        """
        module = self.lightning_module
        failed = self._exception is not None
        keep = module is not None and self.parallel is not None and parallel_model_of(module) is self.parallel
        parts: list[tuple[str, Any]] = [
            ("fault tolerance manager", self.ft.shutdown if self.ft is not None else None),
            ("reshard", (lambda: self.parallel.engine.reshard()) if failed and self.parallel is not None else None),
            ("cluster environment", self.cluster_environment.teardown if self.cluster_environment else None),
            ("optimizers to CPU", lambda: optimizers_to_device(self.optimizers, torch.device("cpu"))),
            ("module to CPU", module.cpu if module is not None and not keep else None),
            ("precision", self.precision_plugin.teardown),
            ("accelerator", self.accelerator.teardown if self.accelerator is not None else None),
            ("checkpoint io", self.checkpoint_io.teardown),
        ]
        for name, part in parts:
            if part is None:
                continue
            if not failed:
                part()
                continue
            try:
                part()
            except Exception as err:  # noqa: BLE001 - the user's error is the one to see
                _log.debug("teardown after the run's error: %s failed: %r", name, err)

    # ------------------------------------------------------------------ steps (the parallel model's step hooks)
    def loss_context(self) -> Any:
        """The context the loss's forward and backward must run in (the vocab-parallel loss of a tp ``vocab_head``),
        else a no-op context."""
        return self.parallel.loss_context() if self.parallel is not None else nullcontext()

    @contextmanager
    def _step_context(self) -> Generator[None, None, None]:
        with self.precision_plugin.forward_context(), self.loss_context():
            yield

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.parallel is not None
        batch, rest, kwargs = _split_batch(args, kwargs)
        batch_idx = rest[0] if rest else kwargs.get("batch_idx", 0)
        if self.ft is not None and self.ft.diloco is None:
            if not self.ft.in_step:  # the quorum is taken in batch_to_device; a loop that skipped it takes it here
                self.ft.begin_step()
                if self.ft.take_data_position() is not None:
                    raise RuntimeError(
                        "This replica group rejoined at a training_step whose batch did not pass through "
                        "MeshStrategy.batch_to_device, so it cannot be moved to the live group's place in the data: "
                        "call super().batch_to_device in an override of it."
                    )
            for name, value in self.ft.figures().items():
                log_host_number(self.lightning_module, f"parallel/{name}", value, on_step=True, on_epoch=False)
            if self._ft_batch_idx is not None:  # the step it rejoined in: the live group's index in the epoch
                batch_idx, self._ft_batch_idx = self._ft_batch_idx, None
                if rest:
                    rest = (batch_idx, *rest[1:])
                elif "batch_idx" in kwargs:
                    kwargs = {**kwargs, "batch_idx": batch_idx}
        out = self.parallel.steps.training_step(
            self, lambda b: super(MeshStrategy, self).training_step(b, *rest, **kwargs), batch, batch_idx
        )
        for name, value in self.parallel.step_figures().items():
            log_host_number(self.lightning_module, f"parallel/{name}", value, on_step=True, on_epoch=False,
                            prog_bar=self.prog_bar)
        return out

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Under fault tolerance, a training window's first batch takes the quorum of the live replica groups first
        (:meth:`~lightning_par.data_parallel.fault_tolerance.FaultTolerantReplicas.begin_step`): Lightning calls this
        right after it fetched the batch and before any hook or ``training_step`` sees it. A group that joins there
        receives the live group's state and its place in the data; where its own loader was elsewhere (a restarted
        process starts at epoch 0, batch 0), the loader is moved there
        (:func:`~lightning_par.data_parallel.fault_tolerance.move_train_data`) and the batch of the live group's place
        replaces the one fetched, so hooks and ``training_step`` see the batch the group would have read had it never
        failed."""
        ft = self.ft
        trainer = getattr(self.lightning_module, "_trainer", None) if self.lightning_module is not None else None
        if ft is not None and ft.diloco is None and not ft.in_step and trainer is not None and trainer.training:
            ft.begin_step()
            position = ft.take_data_position()
            if position is not None:
                epoch, ready = position
                batch = move_train_data(trainer, epoch, ready, take=True)
                ft.data_moves += 1
                # Lightning's epoch loop set these from the batch it fetched (the wrong place), before calling here
                trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = data_fetcher(trainer).done
                self._ft_batch_idx = ready
                # what Lightning's epoch loop does to a fetched batch before batch_to_device (2.6.6, advance())
                batch = trainer.precision_plugin.convert_input(batch)
                batch = before_batch_transfer(trainer.lightning_module, batch, dataloader_idx)
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """The parallel model's backward (:meth:`lightning_par.steps.StepHooks.backward`): backward, the end of the dp
        reduction, then ``on_after_backward``, so a user's hook sees averaged gradients as under ``DDPStrategy``."""
        assert self.parallel is not None
        return self.parallel.steps.backward(self, closure_loss, optimizer, *args, **kwargs)

    def log_comm(self, stats: Any) -> None:
        """Log a synchronised backward's exposed communication time as ``parallel/comm_exposed_ms``, every
        ``log_every_n_steps`` (see :func:`~lightning_par.callbacks.metrics.log_comm_stats`)."""
        log_comm_stats(self.lightning_module, stats, name="parallel/comm_exposed_ms", prog_bar=self.prog_bar)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Once the step's last backward and its dp reduction are done (inside ``closure``), the parallel model's
        gradient finishers (tp: replicated parameters' partial gradients summed), before clipping and the step."""
        parallel = self.parallel
        if parallel is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def closure_then_finish() -> Any:
            out = closure()
            parallel.finish_gradients()
            return out

        ft = self.ft
        if ft is None or ft.diloco is not None:  # DiLoCo: its hooks on the optimizer sync every H steps
            out = super().optimizer_step(optimizer, closure_then_finish, model, **kwargs)
            position = ft.take_data_position() if ft is not None else None
            if position is not None:  # joined at this sync (inside the step): the next fetch reads the live group's
                move_train_data(self.lightning_module.trainer, *position, take=False)
                ft.data_moves += 1
            return out
        # Across replica groups: this rank's gradients (its shard under ZeRO) averaged over the live groups, then the
        # commit vote; a step some live group could not finish is skipped by every group (no update, no state).
        out = closure_then_finish()
        ft.average_gradients([p for g in optimizer.param_groups for p in g["params"]])
        if not ft.commit():
            optimizer.zero_grad(set_to_none=True)
            return out
        return super().optimizer_step(optimizer, lambda: out, model, **kwargs)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning enters this for every batch of an accumulation window but the last: no dp reduction then."""
        with self.parallel.block_sync() if self.parallel is not None else nullcontext():
            yield

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        """False: Lightning counts the accumulation window and steps the optimizer at its end."""
        return False

    def _clip_grad_by_value(self, optimizer: Any, clip_val: float) -> None:
        assert self.parallel is not None
        self.parallel.clip_grad_value_([p for g in optimizer.param_groups for p in g["params"]], float(clip_val))

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        assert self.parallel is not None
        self.parallel.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], float(clip_val))

    def _eval_step(self, stage: str, step: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        assert self.parallel is not None
        batch, rest, kwargs = _split_batch(args, kwargs)
        return self.parallel.steps.eval_step(self, stage, lambda b: step(b, *rest, **kwargs), batch)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("val", super().validation_step, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test", super().test_step, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("predict", super().predict_step, args, kwargs)

    @override
    def on_train_start(self) -> None:
        """Refuse, before any step, a loader batch size the layout cannot split (a pipeline's micro-batches), and under
        fault tolerance a training loop whose data a rejoining group could not be moved in
        (:func:`~lightning_par.data_parallel.fault_tolerance.check_train_data`)."""
        super().on_train_start()
        loader = getattr(self.lightning_module.trainer, "train_dataloader", None) if self.lightning_module else None
        self.options.check_batch_size(getattr(loader, "batch_size", None), self._sizes["pp_size"])
        if self.ft is not None:  # a rejoining group must be able to move to the live group's place in the data
            check_train_data(self.lightning_module.trainer)

    @override
    def on_predict_start(self) -> None:
        """Refuse, before the first batch, predicting under a layout that cannot (an axis's
        :attr:`~lightning_par.axis_registry.Build.refused_stages`).

        Raises:
            ValueError: the axis's reason (e.g. a sequence split over ranks: each ``predict_step`` would see its piece
                of every sequence only, and return outputs for that piece).
        """
        super().on_predict_start()
        reason = self.parallel.refused_stages.get("predict") if self.parallel is not None else None
        if reason:
            raise ValueError(reason)

    def _reshard(self) -> None:
        if self.parallel is not None:
            self.parallel.engine.reshard()

    @override
    def on_validation_end(self) -> None:
        self._reshard()

    @override
    def on_test_end(self) -> None:
        self._reshard()

    @override
    def on_predict_end(self) -> None:
        self._reshard()

    # ------------------------------------------------------------------ collectives
    def group(self, axis: str) -> dist.ProcessGroup:
        """The process group of one mesh axis or derived mesh (:meth:`ParallelDims.get_mesh`) containing this rank."""
        assert self.parallel_dims is not None
        return self.parallel_dims.group(axis)

    @override
    def barrier(self, name: str | None = None) -> None:
        if distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        """As Lightning's; a DTensor (the vocab-parallel loss is a replicated one) is made plain first."""
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        if isinstance(tensor, Tensor):
            return sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ gradients for callbacks
    def grad_norm(self, norm_type: float | str = 2.0) -> Tensor:
        """The global gradient norm the optimizer step will see: over every dp shard, tp shard and pipeline stage
        (what norm clipping computes; one process's ``torch.nn.utils.get_total_norm`` of all gradients). Call it from
        ``on_before_optimizer_step`` (gradients reduced, before clipping) on every rank: it is collective.

        Returns:
            A float32 scalar tensor (CPU), the same on every rank.
        """
        assert self.parallel is not None
        params = [p for opt in self.optimizers for g in opt.param_groups for p in g["params"]]
        return self.parallel.grad_norm(params, float(norm_type))

    def full_grads(self) -> dict[str, Tensor]:
        """Every parameter's gradient in full, keyed by its one-process name (``{"model.0.weight": (out, in)}``),
        on every rank (CPU; gathered over dp shards, tp shards and pipeline stages: collective, and the whole gradient
        on each rank). Call it from ``on_before_optimizer_step``."""
        assert self.parallel is not None
        return self.parallel.full_grads()

    def grad_norms(self, norm_type: float | str = 2.0) -> dict[str, float]:
        """Lightning's ``lightning.pytorch.utilities.grad_norm(module, norm_type)`` for the whole model, whatever the
        layout: ``{"grad_{q}_norm/{name}": norm of each parameter's gradient, "grad_{q}_norm_total": the global
        norm}`` (from :meth:`full_grads`: collective, for small models; :meth:`grad_norm` is the cheap total)."""
        q = float(norm_type)
        norms = {f"grad_{q}_norm/{n}": g.float().norm(q) for n, g in self.full_grads().items()}
        if norms:
            norms[f"grad_{q}_norm_total"] = torch.stack(list(norms.values())).norm(q)
        return {k: float(v) for k, v in norms.items()}

    # ------------------------------------------------------------------ reporting
    def summary_extras(self) -> dict[str, Any]:
        """Strategy figures for ``summary.json``: layout, dp mode, and every axis's figures."""
        dims = self.parallel_dims
        if dims is None:
            return {}
        extras: dict[str, Any] = {
            "dp_size": dims.dp_size,
            "tp_size": dims.tp_size,
            "pp_size": dims.pp_size,
            **dims.sizes(),
            "dp_mode": self.dp_mode,
            "sequence_parallel": self.options.tensor_parallel.sequence_parallel,
            "activation_checkpointing": self.options.activation_checkpointing,
            "precision": self.precision,
        }
        zero = self.precision_options().zero
        if zero is not None and (zero.param_dtype or zero.reduce_dtype):
            extras["zero_param_dtype"] = str(zero.param_dtype) if zero.param_dtype else None
            extras["zero_reduce_dtype"] = str(zero.reduce_dtype) if zero.reduce_dtype else None
        if self.parallel is not None:
            extras.update(self.parallel.summary())
        if self.ft is not None:
            extras.update(self.ft.summary())
        return extras

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register every name of :attr:`registry_names` with its preset options (names already taken are kept)."""
        for name in cls.registry_names or (cls.strategy_name,):
            if name not in strategy_registry:
                strategy_registry.register(
                    name, cls, description=cls.description, **cls.registry_presets.get(name, {})
                )
