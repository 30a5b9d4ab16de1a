"""``MeshStrategy``: Lightning's adapter for the parallel runtime (:mod:`lightning_par.runtime`); every lightning_par
Trainer strategy is a preset of it. It translates Lightning's hooks into runtime calls: the layout and process group
(:mod:`lightning_par.runtime.host`), the step (``parallel.steps``, :mod:`lightning_par.runtime.step`), sharded
``torch.distributed.checkpoint`` directories (:mod:`lightning_par.checkpoint`), fault tolerance
(:mod:`lightning_par.fault_tolerance`).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from typing_extensions import override

from lightning_par.checkpoint.strategy_io import ShardedCheckpointIO
from lightning_par.compat.fabric import optimizers_to_device
from lightning_par.compat.lightning import SubprocessScriptLauncher, plain_optimizer, set_module_device_mesh
from lightning_par.callbacks.metrics import log_comm_stats, log_host_number
from lightning_par.callbacks.model_summary import install as install_model_summary
from lightning_par.callbacks.refusals import check_callbacks
from lightning_par.callbacks.views import StrategyViews
from lightning_par.fault.elastic import init_process_group_per_attempt
from lightning_par.fault.orphan import guard_outside_launcher
from lightning_par.fault.preemption import PreemptionWatch
from lightning_par.fault.process_group_exit import FAILED
from lightning_par.fault_tolerance.hooks import FaultToleranceHooks
from lightning_par.parallel_dims import ParallelDims
from lightning_par.parallelize import ParallelModel, ParallelOptions
from lightning_par.precision import check_precision, distributed_scaler, route_clipping
from lightning_par.runtime import collectives, host, step
from lightning_par.runtime.core import StrategyCore

__all__ = ["MeshStrategy"]


class MeshStrategy(StrategyCore, ShardedCheckpointIO, StrategyViews, host.HostDevices, ParallelStrategy):
    """Every registered axis on one mesh, for any LightningModule meeting :mod:`lightning_par.contract`.

    Args:
        dp_size, tp_size, pp_size, dp_mode, dp_replicate_size, dp_shard_size, module_attr, activation_checkpointing,
            timeout_s, prog_bar, process_group_backend, **options: the layout's sizes, option groups and process-group
            settings, the same under both hosts: see :class:`~lightning_par.runtime.core.StrategyCore`.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as for Lightning's
            ``DDPStrategy`` (the Trainer fills them in).

    Raises:
        ValueError: here, an invalid size, option or combination, or a size or option of an axis this strategy does
            not have; before the process group starts (:meth:`validate_model`), a model the layout cannot run (see
            :func:`lightning_par.parallelize.validate`) or ``cpu_offload`` on a CPU device.
    """

    def __init__(
        self, dp_size: int = -1, tp_size: int = 1, pp_size: int = 1, dp_mode: str = ParallelOptions.dp_mode, *,
        dp_replicate_size: int = 1, dp_shard_size: int = -1, module_attr: str | None = ParallelOptions.module_attr,
        activation_checkpointing: str = ParallelOptions.activation_checkpointing, timeout_s: float = 1800.0,
        prog_bar: bool = False, process_group_backend: str | None = None, accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None, cluster_environment: Any = None, checkpoint_io: Any = None,
        precision_plugin: Any = None, **options: Any,
    ) -> None:
        ParallelStrategy.__init__(self, accelerator=accelerator, parallel_devices=parallel_devices,
                                  cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                                  precision_plugin=precision_plugin)
        StrategyCore.__init__(
            self, dp_size, tp_size, pp_size, dp_mode, dp_replicate_size=dp_replicate_size, dp_shard_size=dp_shard_size,
            module_attr=module_attr, activation_checkpointing=activation_checkpointing, timeout_s=timeout_s,
            prog_bar=prog_bar, process_group_backend=process_group_backend, **options,
        )
        self.fault_tolerance = FaultToleranceHooks(self.options, self._sizes)  # torchft replica groups, or no-ops
        self.parallel: ParallelModel | None = None
        self._validated: Any = None  # the module validate_model checked (parallelize then does not check it again)
        self._exception: BaseException | None = None  # the run's error (teardown then never raises over it)
        self.num_nodes = 1

    @property
    def ft(self) -> Any:
        """This rank's :class:`~lightning_par.fault_tolerance.replicas.FaultTolerantReplicas` (``fault_tolerance.
        enabled``, from :meth:`setup`), else ``None``."""
        return self.fault_tolerance.replicas

    # ------------------------------------------------------------------ layout
    @property
    def is_distributed(self) -> bool:
        """Always ``True``: Lightning then injects a ``DistributedSampler`` (over the dp axis, see below)."""
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Shard batches over the dp ranks only: every tp, cp and pp rank of a replica reads the same samples."""
        dims = self.parallel_dims
        assert dims is not None
        return self.fault_tolerance.sampler_kwargs(dims.dp_size, dims.coordinates(self.global_rank)["dp"])

    # ------------------------------------------------------------------ processes
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def set_world_ranks(self) -> None:
        host.set_world_ranks(self)

    @override
    def setup_environment(self) -> None:
        # Under torchrun/SLURM this worker ends with its launcher (with a preemption watch: as if preempted).
        guard_outside_launcher(clean_stop=PreemptionWatch.current() is not None)
        super().setup_environment()
        self.set_world_ranks()
        self._exception = None
        self.unparallelize_previous()

        def check(dims: ParallelDims) -> None:  # the layout, and the model against it, before any process group
            self.validate_model(dims)
            self.fault_tolerance.setup_environment()
            reset_seed()

        # a group started here: under torchrun --max-restarts, in a store namespace of this attempt (no-op otherwise)
        host.start_layout(self, self, check, lambda: init_process_group_per_attempt(
            "gpu" if self.root_device.type == "cuda" else "cpu", self._timeout_s))
        if self.lightning_module is not None:  # as Lightning's ModelParallelStrategy: visible in configure_model
            set_module_device_mesh(self.lightning_module, self.device_mesh)

    def unparallelize_previous(self) -> None:
        """A module another run parallelised (a second Trainer on it) goes back to its plain form first, the one this
        strategy parallelised is kept (:func:`lightning_par.runtime.host.unparallelize_previous`, which raises)."""
        host.unparallelize_previous(self.lightning_module, self.parallel)

    def validate_model(self, dims: ParallelDims) -> None:
        """Check the LightningModule against the layout before the process group starts (when ``configure_model``
        builds the layers, :meth:`setup` does). Raises the ``ValueError`` of :func:`lightning_par.runtime.host.
        validate_model`."""
        module = self.lightning_module
        later = module is not None and is_overridden("configure_model", module)
        if host.validate_model(self, dims, module, lambda: self.root_device, self._scaler, later):
            self._validated = module

    @property
    def _scaler(self) -> bool:
        return getattr(self.precision_plugin, "scaler", None) is not None

    @override
    def setup(self, trainer: Any) -> None:
        assert self.model is not None and self.accelerator is not None and self.parallel_dims is not None
        check_precision(self.precision, self.parallel_dims.pp_size, self._scaler)
        self.accelerator.setup(trainer)
        if not host.is_set_up(self.model, self.parallel):  # fit / validate again on this Trainer: reused as it is
            self.model = self.precision_plugin.convert_module(self.model)
            self.model_to_device()
        self.parallel = host.setup_parallel_model(
            self.model, self.parallel, self.parallel_dims, self.precision_options(), device=self.root_device,
            step_context=self._step_context, check=self._validated is not self.lightning_module,
        )
        if trainer.state.fn == TrainerFn.FITTING:
            check_callbacks(trainer.callbacks, self.model, self.parallel_dims, self.options)
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None and dist.get_world_size() > 1:
            # Each rank sees only its gradient shard (ZeRO, TP): skip a step on every rank or on none.
            self.precision_plugin.scaler = distributed_scaler(scaler)
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)
            self.fault_tolerance.setup(self.lightning_module, lambda: self.optimizers, dist.get_rank(),
                                       dist.get_world_size())
        route_clipping(self.precision_plugin, self.parallel, step.clip_grad_norm_, step.clip_grad_value_)  # whole model
        install_model_summary(trainer)  # Lightning's ModelSummary counts the whole model, not this rank's part

    @property
    def precision(self) -> str:
        """Lightning's precision of this run (``"32-true"`` before the Trainer attaches its plugin)."""
        return str(getattr(self.precision_plugin, "precision", "32-true"))

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        assert self.parallel is not None
        for optimizer in self.optimizers:
            step.setup_optimizer(self.parallel, plain_optimizer(optimizer))

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
        a module this strategy parallelised stays where it is (:func:`lightning_par.runtime.host.is_set_up`; a new
        Trainer takes it back to its plain form first). After the run's error every part is tried, the parameters
        resharded first (:func:`lightning_par.runtime.host.run_parts`)."""
        module, parallel, failed = self.lightning_module, self.parallel, self._exception is not None
        keep = module is not None and host.is_set_up(module, parallel)
        host.run_parts([
            ("fault tolerance manager", self.fault_tolerance.teardown),
            ("reshard", (lambda: parallel.engine.reshard()) if failed and parallel is not None else None),
            ("cluster environment", self.cluster_environment.teardown if self.cluster_environment else None),
            ("optimizers to CPU", lambda: optimizers_to_device(self.optimizers, torch.device("cpu"))),
            ("module to CPU", module.cpu if module is not None and not keep else None),
            ("precision", self.precision_plugin.teardown),
            ("accelerator", self.accelerator.teardown if self.accelerator is not None else None),
            ("checkpoint io", self.checkpoint_io.teardown),
        ], failed)

    # ------------------------------------------------------------------ steps (the parallel model's step hooks)
    def loss_context(self) -> Any:
        """The context the loss must run in (:func:`lightning_par.runtime.host.loss_context`)."""
        return host.loss_context(self.parallel)

    def _step_context(self) -> Any:
        return host.step_context(self.precision_plugin, self.parallel)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.parallel is not None
        batch, rest, kwargs = host.split_batch(args, kwargs)
        batch_idx = rest[0] if rest else kwargs.get("batch_idx", 0)
        batch_idx, rest, kwargs = self.fault_tolerance.training_step(self.lightning_module, batch_idx, rest, kwargs)
        out = self.parallel.steps.training_step(
            self, lambda b: super(MeshStrategy, self).training_step(b, *rest, **kwargs), batch, batch_idx
        )
        for name, value in self.parallel.step_figures().items():
            log_host_number(self.lightning_module, f"parallel/{name}", value, on_step=True, on_epoch=False,
                            prog_bar=self.prog_bar)
        return out

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Under fault tolerance, a training window's first batch takes the quorum of the live replica groups first,
        and a group that joins there trains on the live group's place in the data
        (:meth:`lightning_par.fault_tolerance.hooks.FaultToleranceHooks.batch_to_device`)."""
        batch = self.fault_tolerance.batch_to_device(self.lightning_module, batch, dataloader_idx)
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
        """The gradient finishers after ``closure`` (:func:`lightning_par.runtime.step.finishing`), before clipping and
        the step; under fault tolerance, the mean over the live replica groups and the commit vote around it."""
        if self.parallel is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        return self.fault_tolerance.optimizer_step(
            self.lightning_module, optimizer, step.finishing(self.parallel, closure),
            lambda c: super(MeshStrategy, self).optimizer_step(optimizer, c, model, **kwargs),
        )

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

    def _eval_step(self, stage: str, step: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        assert self.parallel is not None
        batch, rest, kwargs = host.split_batch(args, kwargs)
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
        (:meth:`~lightning_par.fault_tolerance.hooks.FaultToleranceHooks.on_train_start`)."""
        super().on_train_start()
        loader = getattr(self.lightning_module.trainer, "train_dataloader", None) if self.lightning_module else None
        self.options.check_batch_size(getattr(loader, "batch_size", None), self._sizes["pp_size"])
        self.fault_tolerance.on_train_start(self.lightning_module.trainer)

    @override
    def on_predict_start(self) -> None:
        """Refuse predicting under a layout that cannot, before the first batch (:func:`lightning_par.runtime.host.
        refuse_stage`: a ``ValueError``)."""
        super().on_predict_start()
        host.refuse_stage(self.parallel, "predict")

    @override
    def on_validation_end(self) -> None:
        host.reshard(self.parallel)

    @override
    def on_test_end(self) -> None:
        host.reshard(self.parallel)

    @override
    def on_predict_end(self) -> None:
        host.reshard(self.parallel)

    # ------------------------------------------------------------------ collectives
    @override
    def barrier(self, name: str | None = None) -> None:
        collectives.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return collectives.broadcast(obj, src)

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        """As Lightning's; a DTensor (the vocab-parallel loss is a replicated one) is made plain first."""
        return collectives.reduce(tensor, group, reduce_op)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register every name of :attr:`registry_names` with its preset options (names already taken are kept)."""
        for name, presets in cls.registry_entries(strategy_registry):
            strategy_registry.register(name, cls, description=cls.description, **presets)
