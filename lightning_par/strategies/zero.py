"""``ZeroStrategy``: ZeRO stages 1, 2 and 3 on the dp axis of the ``("pp", "dp", "tp")`` mesh."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor
from typing_extensions import override

from lightning_par.callbacks.metrics import log_comm_stats
from lightning_par.checkpoint.sharded import load_sharded, save_sharded
from lightning_par.data_parallel.zero import ZeroEngine, apply_zero
from lightning_par.data_parallel.zero_options import ZeroOptions, resolve_zero_options
from lightning_par.parallel_dims import ParallelDims
from lightning_par.strategies.base import MeshStrategy
from lightning_par.strategies.ddp_overlap import broadcast_from_dp_rank0

__all__ = ["ZeroStrategy"]


class ZeroStrategy(MeshStrategy):
    """ZeRO (Rajbhandari et al., SC'20): shard optimizer state (stage 1), gradients (2) and parameters (3) over dp.

    A thin user of :mod:`lightning_par.data_parallel.zero`: after the dp ranks are made equal (broadcast from dp
    rank 0), ``apply_zero`` returns the engine, which Lightning's hooks drive.

    * stage 1: full parameters and gradients; gradients all-reduced during backward by the ``ddp_overlap`` reducer
      (bucketed, overlapped); the optimizer (the one ``configure_optimizers`` built, re-pointed at this rank's
      ``Shard(0)`` chunk of every parameter) steps ``1/N`` of the model; the chunks are all-gathered after the step.
    * stage 2: as stage 1, but the gradients are reduce-scattered during backward and only this rank's chunk is kept.
    * stage 3: FSDP2 ``fully_shard`` per block; parameters gathered just in time (the next block prefetched) and freed
      after use. See :mod:`lightning_par.data_parallel.fsdp` for how this differs from the paper.

    Gradient clipping by norm (``Trainer(gradient_clip_val=...)``) is global: the engine's ``clip_grad_norm_`` sums the
    squares of the optimizer's local shards over dp. Gradient accumulation works at every stage: stage 1 skips the
    all-reduce until the last micro-batch, stages 2 and 3 reduce-scatter every micro-batch and accumulate the shard.
    Checkpoints are sharded directories (``torch.distributed.checkpoint``) that load into another stage, dp size or a
    single process (:func:`lightning_par.checkpoint.load_model_weights`).

    Registered as ``"zero1"``, ``"zero2"`` and ``"zero3"`` (the stage preset).

    Args:
        stage: 1, 2 or 3.
        dp_size: data-parallel size (``-1``: all processes).
        cpu_offload: stage 3 only: keep the shards in CPU memory and step there (needs an accelerator).
        mixed_precision: ``None``, a dtype name (``"bf16"``, ``"fp16"``: parameters and gradient reductions in it;
            the optimizer steps fp32 master shards) or ``{"param_dtype": ..., "reduce_dtype": ...}``.
        reshard_after_forward: stage 3: free gathered parameters after each block's forward (True) or keep them
            until backward (False).
        bucket_cap_mb: stages 1 and 2: bucket size in MiB of the gradient reduction and parameter all-gather
            (``None``: 25). Not valid at stage 3.
        gradient_as_bucket_view, static_graph, comm_hook: stage 1's ``ddp_overlap`` reducer options.
        **kwargs: see :class:`~lightning_par.strategies.base.MeshStrategy` (``timeout_s``, ...).

    Raises:
        ValueError: an invalid option (see :func:`~lightning_par.data_parallel.zero_options.resolve_zero_options`);
            before the process group starts: ``cpu_offload=True`` on a CPU device, a model with no trainable
            parameter.
    """

    #: The first name :meth:`register_strategies` adds (``register_all`` checks it); instances report their stage's.
    strategy_name: ClassVar[str] = "zero1"
    description: ClassVar[str] = "ZeRO stage 1/2/3 (optimizer state / + gradients / + parameters sharded over dp)"
    #: Registry names and the options each one presets (read by ``lightning_par.config.build``).
    registry_names: ClassVar[tuple[str, ...]] = ("zero1", "zero2", "zero3")
    registry_presets: ClassVar[dict[str, dict[str, Any]]] = {f"zero{k}": {"stage": k} for k in (1, 2, 3)}

    def __init__(
        self,
        stage: int = 3,
        dp_size: int = -1,
        cpu_offload: bool = False,
        mixed_precision: str | dict[str, str] | None = None,
        reshard_after_forward: bool = True,
        bucket_cap_mb: float | None = None,
        gradient_as_bucket_view: bool = True,
        static_graph: bool = False,
        comm_hook: str = "none",
        **kwargs: Any,
    ) -> None:
        super().__init__(dp_size=dp_size, tp_size=1, pp_size=1, **kwargs)
        self.options: ZeroOptions = resolve_zero_options(
            stage,
            cpu_offload=cpu_offload,
            mixed_precision=mixed_precision,
            reshard_after_forward=reshard_after_forward,
            bucket_cap_mb=bucket_cap_mb,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
            comm_hook=comm_hook,
        )
        self.strategy_name = f"zero{self.options.stage}"  # type: ignore[misc]  # for summary.json
        self.engine: ZeroEngine | None = None

    # ------------------------------------------------------------------ set-up
    @override
    def validate_model(self, dims: ParallelDims) -> None:
        """Refuse, before the process group starts, what cannot run: offload without an accelerator, and a model
        with nothing to shard (checked in :meth:`parallelize` instead when ``configure_model`` builds the layers)."""
        if self.options.cpu_offload and self.root_device.type == "cpu":
            raise ValueError(
                "cpu_offload=True is not valid on a CPU device: FSDP2's CPUOffloadPolicy moves shards between an "
                "accelerator and the CPU. Run on a GPU or set cpu_offload=False."
            )
        module = self.lightning_module
        if module is not None and not is_overridden("configure_model", module):
            _check_trainable(module)

    @override
    def parallelize(self) -> None:
        assert self.model is not None and self.parallel_dims is not None
        _check_trainable(self.model)
        if self.engine is not None and self.engine.module is self.model and self.options.stage == 3:
            return
        if self.engine is not None:
            self.engine.remove()
        broadcast_from_dp_rank0(self.model, self.group("dp"))
        self.engine = apply_zero(self.model, self.parallel_dims.get_mesh("dp"), self.options)

    @override
    def parallelize_for_eval(self) -> None:
        """Stage 3 shards for evaluation too; stages 1 and 2 evaluate full replicas (no optimizer to shard)."""
        if self.options.stage == 3:
            self.parallelize()
        elif self.engine is None or self.engine.module is not self.model:
            assert self.model is not None
            broadcast_from_dp_rank0(self.model, self.group("dp"))

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        assert self.engine is not None
        for optimizer in self.optimizers:
            self.engine.shard_optimizer(optimizer)

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        # Norm clipping must see the whole model's norm: the optimizer steps this rank's shards (issue 11).
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        assert self.engine is not None
        self.engine.clip_grad_norm_(params, float(clip_val))

    # ------------------------------------------------------------------ backward
    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        if self.engine is None:
            yield
            return
        with self.engine.no_sync():
            yield

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        if self.engine is not None:
            self.engine.pre_backward()

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        if self.engine is None:
            return
        log_comm_stats(self.lightning_module, self.engine.post_backward())

    @override
    def on_validation_end(self) -> None:
        if self.engine is not None:
            self.engine.reshard()

    @override
    def on_test_end(self) -> None:
        if self.engine is not None:
            self.engine.reshard()

    @override
    def on_predict_end(self) -> None:
        if self.engine is not None:
            self.engine.reshard()

    # ------------------------------------------------------------------ state
    def full_state_dict(self) -> dict[str, Tensor]:
        """Every parameter in full (fp32 masters under mixed precision), keyed by name, on every rank. Collective."""
        if self.engine is None:
            assert self.model is not None
            return {n: p.detach().clone() for n, p in self.model.named_parameters()}
        return self.engine.full_state_dict()

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Load after :meth:`setup`, into the sharded model and optimizers."""
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        """:meth:`load_checkpoint` restores the optimizers itself."""
        return False

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Sharded model state (every rank holds its part)."""
        if self.engine is None:
            assert self.model is not None
            return self.model.state_dict()
        return self.engine.model_state_dict()

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Sharded optimizer state keyed by parameter name."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        assert self.engine is not None
        return self.engine.optimizer_state_dict(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write a sharded checkpoint directory (see :mod:`lightning_par.checkpoint.sharded`); every rank calls it.

        Raises:
            TypeError: ``storage_options`` is given (there is no ``CheckpointIO``).
        """
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(storage_options=...) is not supported.")
        path = Path(self.broadcast(str(filepath)))
        save_sharded(path, checkpoint, is_rank0=self.global_rank == 0)
        self.barrier()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded checkpoint of any stage and dp size into the model (and the optimizers when fitting);
        returns the rest (loops, LR schedulers, ...) for Lightning to restore."""
        path = Path(self.broadcast(str(checkpoint_path)))
        assert self.model is not None
        engine = self.engine if self.engine is not None and self.engine.module is self.model else None
        if engine is None:
            state = self.model.state_dict()
            meta = load_sharded(path, state)
            self.model.load_state_dict(state)
            return meta
        model_state = engine.model_state_dict()
        optimizers = [o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]
        optimizer_states = [engine.optimizer_state_dict(o) for o in optimizers]
        meta = load_sharded(path, model_state, optimizer_states)
        engine.load_model_state_dict(model_state)
        for optimizer, state in zip(optimizers, optimizer_states):
            engine.load_optimizer_state_dict(optimizer, state)
        return meta

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Nothing to do: :meth:`load_checkpoint` has loaded the model."""

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Nothing to do: :meth:`load_checkpoint` has loaded the optimizers."""

    @override
    def summary_extras(self) -> dict[str, Any]:
        extras = super().summary_extras()
        if self.engine is not None:
            extras.update(self.engine.summary())
        return extras



def _check_trainable(module: torch.nn.Module) -> None:
    if not any(p.requires_grad for p in module.parameters()):
        raise ValueError(
            f"{type(module).__name__} has no parameter that requires a gradient: ZeRO has nothing to shard. "
            f"Build the layers in __init__ or configure_model, or use a strategy without sharding."
        )
