"""Lightning Fabric's adapter for the parallel runtime: the same layouts for a loop the user writes.

:class:`MeshStrategy` (a ``lightning.fabric.strategies.ParallelStrategy``) holds a *core*
(:class:`~lightning_par.runtime.core.StrategyCore`, or the Trainer preset a registry name stands for) that validates
the keywords as the Trainer's does; the model goes through :func:`lightning_par.parallelize.parallelize`, the step
through :mod:`lightning_par.runtime.step`, checkpoints through :mod:`lightning_par.runtime.checkpoint`. This module
only maps Fabric's calls onto them. Under ``pp_size > 1`` (a schedule runs forward and backward) and ``cp_size > 1``
(each rank holds a piece of every sequence, targets included) the step is one call,
:func:`lightning_par.fabric.train_step`; a training ``model(x)`` and ``fabric.backward`` raise a ``RuntimeError``
naming it, and cp with pp is refused at ``fabric.setup``.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.strategies.parallel import ParallelStrategy
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_par.compat.fabric import BackwardSyncControl, FabricSubprocessScriptLauncher
from lightning_par.parallel_dims import ParallelDims
from lightning_par.parallelize import ParallelModel, validate
from lightning_par.runtime import checkpoint, collectives, host, step
from lightning_par.runtime.core import StrategyCore

__all__ = ["MeshStrategy", "FABRIC_KEYS"]

#: Entry of a Fabric checkpoint's ``meta.pt``: which keys of the saved ``state`` held the module and the optimizers.
FABRIC_KEYS = checkpoint.STATE_KEYS


class MeshStrategy(host.HostDevices, ParallelStrategy):
    """Every registered axis on one mesh (pp and cp through :meth:`train_step`), for ``lightning.fabric.Fabric`` and
    any ``nn.Module`` meeting :mod:`lightning_par.contract` (under pipelining the network is at ``module_attr``).

    Args:
        *args, **kwargs: the keywords of the Trainer strategy (:class:`lightning_par.strategies.MeshStrategy`:
            ``dp_size``, ``tp_size``, ``dp_mode``, ``dp_replicate_size``, ``dp_shard_size``, ``ep_size``,
            ``timeout_s``, the option groups ...; or those of the preset given as ``_preset``).
        _preset: the class whose keywords and axes this is (a :class:`~lightning_par.runtime.core.StrategyCore`; a
            registry name gives its preset, the Trainer's too: ``Fabric(strategy="zero3")`` holds ``ZeroCore(stage=3)``
            of :mod:`lightning_par.runtime.presets`).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision: filled in by Fabric.

    Raises:
        ValueError: what the Trainer strategy raises for these keywords; at ``fabric.setup``, a model the layout
            cannot run (:func:`lightning_par.parallelize.validate`).
    """

    def __init__(
        self,
        *args: Any,
        _preset: type[StrategyCore] = StrategyCore,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision=precision)
        self.core: StrategyCore = _preset(*args, **kwargs)
        self._num_nodes = 1
        self._backward_sync_control = _MeshBackwardSyncControl(self)
        self.parallel_dims: ParallelDims | None = None
        self.parallel: ParallelModel | None = None
        self._names: dict[int, str] = {}  # id of each parameter given to setup_module -> its name
        self._sync_blocked = False
        self._grads_pending = False  # a synchronised backward ran and the gradient finishers have not
        self._in_step = False  # inside train_step's forward and backward

    # ------------------------------------------------------------------ layout and processes
    @property
    def strategy_name(self) -> str:
        return self.core.strategy_name

    @property
    def options(self) -> Any:
        return self.core.options

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Shard batches over the dp ranks only (``fabric.setup_dataloaders``): the tp ranks of a replica read the
        same samples."""
        dims = self.parallel_dims or self.core.resolve_parallel_dims(self.num_nodes * self.num_processes)
        return {"num_replicas": dims.dp_size, "rank": dims.coordinates(self.global_rank)["dp"]}

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = FabricSubprocessScriptLauncher(self.cluster_environment, self.num_processes,
                                                            self.num_nodes)

    @override
    def setup_environment(self) -> None:
        """Validate the layout against the world, then start the process group and build the mesh."""
        super().setup_environment()
        host.set_world_ranks(self)
        self.parallel_dims = host.start_layout(self.core, self)  # (lightning_par.runtime.host)

    @property
    def device_mesh(self) -> Any:
        """The DeviceMesh of the layout (after ``fabric.launch()``)."""
        return self.core.device_mesh

    # ------------------------------------------------------------------ model and optimizers
    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Parallelise ``module`` in place (:func:`lightning_par.parallelize.parallelize`: collective) and return it.

        Raises:
            ValueError: a model the layout cannot run (see :func:`lightning_par.parallelize.validate`), or a second
                model (one model per Fabric strategy).
        """
        assert self.parallel_dims is not None, "fabric.launch() first"
        if self.parallel is not None and self.parallel.module is not module:
            raise ValueError(
                f"{type(self).__name__} holds one model; fabric.setup was called with a second one "
                f"({type(module).__name__}): put both in one nn.Module."
            )
        if self.parallel is None:
            validate(module, self.parallel_dims, self.options)
            self._names = {id(p): n for n, p in module.named_parameters()}
            self.parallel = parallel = host.setup_parallel_model(
                module, None, self.parallel_dims, self.core.precision_options(self.precision_name),
                device=self.root_device, step_context=self._step_context, check=False,
            )
            step.check_loop(parallel)
            if parallel.pipeline is not None:
                module.register_forward_pre_hook(step.refuse_pipelined_forward)
            elif parallel.has_batch_transforms:  # cp: the step call splits inputs and targets
                module.register_forward_pre_hook(self._refuse_split_forward)
            buffers = parallel.engine.buffers
            if buffers is not None:  # torch DDP's buffer broadcast before each forward (not inside no_backward_sync)
                module.register_forward_pre_hook(lambda *_: buffers.before_forward())
        return module

    @property
    def precision_name(self) -> str:
        """Fabric's precision of this run (``"32-true"``, ``"bf16-mixed"``, ...)."""
        return str(getattr(self.precision, "precision", "32-true"))

    @override
    def module_to_device(self, module: nn.Module) -> None:
        if self.parallel is None or self.parallel.module is not module:
            module.to(self.root_device)

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Point ``optimizer`` at the parallel parameters (:func:`lightning_par.runtime.step.point_optimizer`), shard
        its state (ZeRO), run the axes' optimizer-step hooks after each of its steps, as the Trainer's does."""
        assert self.parallel is not None, "set up the model first: fabric.setup(model, optimizer)"
        step.point_optimizer(self.parallel, optimizer, self._names)
        step.setup_optimizer(self.parallel, optimizer)
        return optimizer

    # ------------------------------------------------------------------ steps (lightning_par.runtime.step)
    def loss_context(self) -> AbstractContextManager[Any]:
        """The context a loss is computed in (:func:`lightning_par.runtime.host.loss_context`); ``fabric.backward``
        enters it itself."""
        return host.loss_context(self.parallel)

    @override
    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Backward, then the end of the dp reduction (skipped inside ``fabric.no_backward_sync``)."""
        if self.parallel is None:
            return super().backward(tensor, module, *args, **kwargs)
        if self.parallel.pipeline is not None:
            raise RuntimeError(step.PIPELINED_STEP)
        if self.parallel.has_batch_transforms:
            raise RuntimeError(step.SPLIT_STEP.format(layout=self._layout()))
        self._backward(tensor, module, *args, **kwargs)

    def _backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Fabric's precision backward through the runtime's (:func:`lightning_par.runtime.step.backward`)."""
        precision = self.precision

        def run() -> None:
            precision.pre_backward(tensor, module)
            precision.backward(tensor, module, *args, **kwargs)

        step.backward(self.parallel, run, lambda _: precision.post_backward(tensor, module))
        if not self._sync_blocked:
            self._grads_pending = True

    def _step_context(self) -> AbstractContextManager[None]:
        """Around each pipeline schedule run: Fabric's precision (autocast) and the loss context."""
        return host.step_context(self.precision, self.parallel)

    def train_step(self, batch: Any, loss_scale: float = 1.0, loss_fn: Any = None) -> Tensor:
        """One forward and backward over ``batch`` (see :func:`lightning_par.fabric.train_step`): the runtime's
        :func:`lightning_par.runtime.step.train_step` with Fabric's precision and backward."""
        if self.parallel is None:
            raise RuntimeError("train_step before fabric.setup(model, ...): set up the model first.")
        self._in_step = True
        try:
            loss = step.train_step(
                self.parallel, batch, precision=self.precision, device=self.root_device, loss_scale=float(loss_scale),
                run_backward=lambda loss: self._backward(loss, self.parallel.module), loss_fn=loss_fn,
                sync=not self._sync_blocked,
            )
        finally:
            self._in_step = False
        if self.parallel.pipeline is not None and not self._sync_blocked:
            self._grads_pending = True
        return loss

    def token_mean(self, loss_sum: Tensor, tokens: Tensor | float) -> Tensor:
        """``loss_sum * dp_size / N`` (see :func:`lightning_par.fabric.token_mean_loss` and
        :func:`lightning_par.runtime.step.token_mean`)."""
        if self.parallel is None:
            raise RuntimeError("token_mean_loss before fabric.setup(model, ...): set up the model first.")
        return step.token_mean(self.parallel, loss_sum, tokens, self.root_device)

    def _refuse_split_forward(self, module: nn.Module, args: Any) -> None:
        """Forward pre-hook under cp: a training forward outside :meth:`train_step` would not split the sequence."""
        if not self._in_step and module.training and torch.is_grad_enabled():
            raise RuntimeError(f"{type(module).__name__}(...) was called for training: "
                               + step.SPLIT_STEP.format(layout=self._layout()))

    def _layout(self) -> dict[str, int]:
        """The sizes above 1 of the layout, for messages."""
        assert self.parallel_dims is not None
        return {k: v for k, v in self.parallel_dims.sizes().items() if v > 1}

    def finish_gradients(self) -> None:
        """The gradient finishers (tp's partial sums), once per synchronised backward: by ``fabric.clip_gradients``
        or the optimizer step, whichever comes first."""
        if self._grads_pending and self.parallel is not None:
            self.parallel.finish_gradients()
        self._grads_pending = False

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        self.finish_gradients()
        return super().optimizer_step(optimizer, **kwargs)

    @override
    def clip_gradients_norm(
        self, module: nn.Module, optimizer: Optimizer, max_norm: float | int, norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip by the whole model's norm (every dp and tp shard); returns the norm before clipping.

        Raises:
            RuntimeError: the norm is not finite and ``error_if_nonfinite``.
        """
        self.precision.unscale_gradients(optimizer)
        self.finish_gradients()
        return step.clip_grad_norm_(self.parallel, optimizer, float(max_norm), float(norm_type), error_if_nonfinite)

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        """Clamp every gradient to ``[-clip_val, clip_val]`` (each rank's shard: exactly the one process's)."""
        self.precision.unscale_gradients(optimizer)
        self.finish_gradients()
        step.clip_grad_value_(self.parallel, optimizer, float(clip_val))

    # ------------------------------------------------------------------ collectives
    @override
    def all_reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        return collectives.reduce(tensor, group, reduce_op)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        collectives.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return collectives.broadcast(obj, src)

    # ------------------------------------------------------------------ checkpoints (lightning_par.runtime.checkpoint)
    @override
    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any | None = None, filter: Any | None = None
    ) -> None:
        """Write ``state`` as a sharded checkpoint directory at ``path`` (:func:`lightning_par.runtime.checkpoint.
        save_state`: loadable at another layout, dp mode, strategy, and into one process). Collective.

        Raises:
            ValueError: ``storage_options`` or ``filter`` given, or ``state`` without exactly the set-up model.
        """
        if storage_options is not None or filter is not None:
            raise ValueError(
                f"fabric.save(..., filter=/storage_options=) is not supported by {type(self).__name__}: the sharded "
                f"checkpoint holds the whole model and optimizer state. Save without them."
            )
        checkpoint.split_state(self.parallel, state)  # refused before any collective
        target = Path(self.broadcast(str(path)))
        record = checkpoint.record(self.core, {"global_step": state.get("step", state.get("iter_num"))})
        record["fabric"] = True
        checkpoint.save_state(self.parallel, target, state, record, is_rank0=self.global_rank == 0,
                              barrier=self.barrier)

    @override
    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load a checkpoint of :meth:`save_checkpoint` into ``state`` (:func:`lightning_par.runtime.checkpoint.
        load_state`); returns the saved entries ``state`` did not name. Collective.

        Raises:
            KeyError, ValueError: see :func:`~lightning_par.runtime.checkpoint.load_state`; a module or optimizer
                given alone (pass a dict).
        """
        target = Path(self.broadcast(str(path)))
        if isinstance(state, (nn.Module, Optimizer)):
            raise ValueError(
                f"fabric.load(path, {type(state).__name__}) is not supported by {type(self).__name__}: pass a dict, "
                f"e.g. {{'model': model, 'optimizer': optimizer}}."
            )
        return checkpoint.load_state(self.parallel, target, state, strict)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any, presets: tuple[type[StrategyCore], ...] = ()) -> None:
        """Register this class under each registry name of ``presets`` (the Trainer's), with that name's preset."""
        for preset in presets:
            for name, options in preset.registry_entries(strategy_registry):
                strategy_registry.register(name, cls, description=f"{preset.description} (lightning_par, Fabric)",
                                           _preset=preset, **options)


class _MeshBackwardSyncControl(BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: no dp reduction (and no buffer broadcast) for the backward passes inside."""

    def __init__(self, strategy: MeshStrategy) -> None:
        self.strategy = strategy

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled or self.strategy.parallel is None:
            return nullcontext()
        return self._blocked()

    @contextmanager
    def _blocked(self) -> Generator[None, None, None]:
        strategy = self.strategy
        assert strategy.parallel is not None
        previous, strategy._sync_blocked = strategy._sync_blocked, True
        try:
            with strategy.parallel.block_sync():
                yield
        finally:
            strategy._sync_blocked = previous
