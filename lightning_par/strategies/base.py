"""``MeshStrategy``: the one strategy core. Every lightning_par strategy is a preset of it.

It owns the validated :class:`~lightning_par.parallel_dims.ParallelDims`, the process group (with a collective timeout,
so a dead rank ends the job instead of hanging it), the ``("pp", "dp", "tp")`` device mesh, data sharding over the
**dp** axis only (the tp and pp ranks of one replica see the same batch), and drives the parallel model that
:func:`lightning_par.parallelize.parallelize` builds (pipeline cut -> tensor parallel -> dp mode -> schedule) from
Lightning's hooks:

* ``pp_size == 1``: Lightning calls the LightningModule's own ``training_step``; the dp engine's hooks run around each
  backward (the bucketed all-reduce overlaps it) and are skipped inside an accumulation window.
* ``pp_size > 1``: the schedule runs forward and backward inside ``training_step``
  (:class:`~lightning_par.strategies.pipelined.PipelinedSteps`); the LightningModule's ``training_step`` is not called.

Under a ``vocab_head`` plan the loss (forward and backward) runs inside the vocab-parallel loss context. Norm clipping
uses the whole model's norm. Checkpoints are sharded ``torch.distributed.checkpoint`` directories committed
atomically (:mod:`lightning_par.checkpoint`), loadable into any layout, strategy and one process.
"""

from __future__ import annotations

import atexit
import time
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_par.callbacks.metrics import log_comm_stats
from lightning_par.compat import default_store
from lightning_par.checkpoint.sharded import load_sharded, save_sharded
from lightning_par.fault.elastic import init_process_group_per_attempt
from lightning_par.parallel_dims import ParallelDims
from lightning_par.parallelize import OPTION_GROUPS, ParallelModel, ParallelOptions, parallelize, validate
from lightning_par.precision import check_precision, distributed_scaler, fsdp_mixed_precision
from lightning_par.strategies.pipelined import PipelinedSteps
from lightning_par.tensor_parallel.state_dict import unpad_vocab_state
from lightning_par.tensor_parallel.styles import sync_tp_partial_grads
from lightning_par.memory import model_state_bytes
from lightning_par.tensor_parallel.vocab import VOCAB_SIZE_ATTR, vocab_parallel_loss
from lightning_par.validation import check_int, check_number

__all__ = ["MeshStrategy"]

#: Set when Lightning reports an exception in this process: then nothing is synchronised at exit.
_FAILED: list[bool] = [False]
_EXIT_KEY = "lightning_par/exited"
#: The mesh axis each option group belongs to.
_GROUP_AXIS = {"reducer": "dp", "zero": "dp", "tensor_parallel": "tp", "pipeline": "pp"}


def _destroy_process_group() -> None:
    """At interpreter exit, after a successful run: wait (at most 30 s) until every rank got here, then destroy the
    default process group.

    Left to interpreter finalisation, a gloo process may abort after a successful fit ("terminate called without an
    active exception"): measured here with Lightning's own DDPStrategy in 6 of 12 two-process runs. The ranks meet
    through the rendezvous store, not a collective, so a peer that is still inside a collective can never match it.
    After a failure nothing is done: the peers learn of it from the closed connections.
    """
    if _FAILED[0] or not (dist.is_available() and dist.is_initialized()):
        return
    try:
        store = default_store()
        world = dist.get_world_size()
        store.add(_EXIT_KEY, 1)
        deadline = time.monotonic() + 30.0
        while store.add(_EXIT_KEY, 0) < world and time.monotonic() < deadline:
            time.sleep(0.02)
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort at exit (rank 0's store may already be gone)
        pass


class MeshStrategy(ParallelStrategy):
    """dp x tp x pp on one ``("pp", "dp", "tp")`` mesh, for any LightningModule meeting :mod:`lightning_par.contract`.

    Args:
        dp_size: data-parallel replicas; ``-1`` infers ``world_size // (tp_size * pp_size)``.
        tp_size: tensor-parallel ranks per stage.
        pp_size: pipeline ranks.
        dp_mode: ``"ddp"`` (bucketed all-reduce overlapped with backward), ``"zero1"``, ``"zero2"`` or ``"zero3"``.
        module_attr: attribute of the LightningModule holding the network (see :mod:`lightning_par.contract`).
        activation_checkpointing: ``"none"``, ``"full"`` (recompute every block in backward) or ``"selective"`` (the
            attention of every block); applied once, after tensor parallelism and before the dp mode
            (:mod:`lightning_par.activation_checkpointing`).
        timeout_s: seconds a collective may wait for a peer before it raises (gloo and nccl), so that a dead or
            stuck rank ends the job with an error instead of a hang.
        prog_bar: also show the strategy's own figures (``parallel/...``) in the progress bar.
        process_group_backend: ``"gloo"`` or ``"nccl"``; default: nccl on CUDA, gloo on CPU.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as for Lightning's
            ``DDPStrategy`` (the Trainer fills them in).
        **options: the option groups, flat or nested (:data:`lightning_par.parallelize.OPTION_GROUPS`):
            ``reducer`` (``bucket_cap_mb``, ``gradient_as_bucket_view``, ``static_graph``, ``comm_hook``,
            ``powersgd_rank``, ``powersgd_start_iter``), ``zero`` (``cpu_offload``, ``mixed_precision``,
            ``reshard_after_forward``), ``tensor_parallel`` (``sequence_parallel``, ``plan``), ``pipeline``
            (``schedule``, ``num_microbatches``, ``virtual_stages``, ``split``, ``split_timeout_s``,
            ``measure_bubble``).

    Raises:
        ValueError: here, an invalid size, option or combination, or an option of an axis this strategy does not
            have; before the process group starts (:meth:`validate_model`), a model the layout cannot run (see
            :func:`lightning_par.parallelize.validate`) or ``cpu_offload`` on a CPU device.
    """

    strategy_name: ClassVar[str] = "mesh"
    #: The mesh axes this strategy may use (a preset narrows them); a size > 1 or an option on another axis is refused.
    axes: ClassVar[tuple[str, ...]] = ("pp", "dp", "tp")
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
        dp_mode: str = "ddp",
        *,
        module_attr: str | None = "model",
        activation_checkpointing: str = "none",
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
        for name, value in sizes.items():
            check_int(name, value, 1, allow_infer=name == "dp_size")
            axis = name[:2]
            if axis not in self.axes and value != 1 and not (axis == "dp" and value == -1):
                raise ValueError(
                    f"{name}={value} is not valid for {type(self).__name__}, which has no {axis} axis: use {name}=1 "
                    f"or a strategy with that axis (parallel_3d has all three)."
                )
        for key in options:
            group = key if key in OPTION_GROUPS else next((g for g, n in OPTION_GROUPS.items() if key in n), None)
            if group is not None and _GROUP_AXIS[group] not in self.axes:
                raise ValueError(
                    f"{key} is an option of the {_GROUP_AXIS[group]} axis, which {type(self).__name__} does not have: "
                    f"remove it, or use a strategy with that axis (parallel_3d has all three)."
                )
        self.options = ParallelOptions.build(dp_mode, module_attr, activation_checkpointing, **options)
        self.options.check_layout(pp_size)
        self._sizes = sizes
        self._timeout_s = check_number("timeout_s", timeout_s, unit="seconds")
        self.prog_bar = bool(prog_bar)
        self._process_group_backend = process_group_backend
        self.parallel_dims: ParallelDims | None = None
        self.parallel: ParallelModel | None = None
        self._pipelined = PipelinedSteps(self)
        self.num_nodes = 1

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
        """The ``("pp", "dp", "tp")`` DeviceMesh.

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
        """Shard batches over the dp axis only: every tp and pp rank of a replica reads the same samples."""
        dims = self.parallel_dims
        assert dims is not None
        return {"num_replicas": dims.dp_size, "rank": dims.coordinates(self.global_rank)["dp"]}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def _pp(self) -> bool:
        return self.parallel is not None and self.parallel.pipeline is not None

    # ------------------------------------------------------------------ processes
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        # Validate the layout, and the model against it, before any process group starts.
        dims = self.resolve_parallel_dims(self.num_nodes * self.num_processes)
        self.validate_model(dims)
        reset_seed()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        assert self.cluster_environment is not None
        started = not dist.is_initialized()
        if started:  # under torchrun --max-restarts: a group in a store namespace of this attempt (no-op otherwise)
            accelerator = "gpu" if self.root_device.type == "cuda" else "cpu"
            init_process_group_per_attempt(accelerator, self._timeout_s)
        _init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=timedelta(seconds=self._timeout_s)
        )
        if started:
            atexit.register(_destroy_process_group)
        mesh = dims.build_mesh(self.root_device.type)
        self.parallel_dims = dims
        if self.lightning_module is not None:  # as Lightning's ModelParallelStrategy: visible in configure_model
            self.lightning_module._device_mesh = mesh

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
        if module is not None and not is_overridden("configure_model", module):
            validate(module, dims, self.options)

    @override
    def setup(self, trainer: Any) -> None:
        assert self.model is not None and self.accelerator is not None and self.parallel_dims is not None
        check_precision(self.precision, self.parallel_dims.pp_size,
                        getattr(self.precision_plugin, "scaler", None) is not None)
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self.parallel is None or self.parallel.module is not self.model:
            if self.parallel is not None:
                self.parallel.engine.remove()
            self.parallel = parallelize(
                self.model, self.parallel_dims, self.precision_options(), device=self.root_device,
                step_context=self._step_context,
            )
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None and dist.get_world_size() > 1:
            # Each rank sees only its gradient shard (ZeRO, TP): skip a step on every rank or on none.
            self.precision_plugin.scaler = distributed_scaler(scaler)
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        # Norm clipping must see the whole model's norm: every shard, every stage.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]

    @property
    def precision(self) -> str:
        """Lightning's precision of this run (``"32-true"`` before the Trainer attaches its plugin)."""
        return str(getattr(self.precision_plugin, "precision", "32-true"))

    def precision_options(self) -> ParallelOptions:
        """The options :func:`~lightning_par.parallelize.parallelize` runs with under this run's precision: with
        ``dp_mode="zero3"`` and no ``zero.mixed_precision`` of the user's, FSDP2's mixed precision policy of
        :func:`lightning_par.precision.fsdp_mixed_precision` (half-precision parameters for compute, fp32 gradient
        reduction) under ``"bf16-mixed"`` / ``"16-mixed"``; the options as given otherwise."""
        zero = self.options.zero
        policy = fsdp_mixed_precision(self.precision)
        if zero is None or zero.stage != 3 or policy is None or (zero.param_dtype, zero.reduce_dtype) != (None, None):
            return self.options
        return replace(self.options, zero=replace(zero, param_dtype=policy[0], reduce_dtype=policy[1]))

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        assert self.parallel is not None
        for optimizer in self.optimizers:
            self.parallel.engine.shard_optimizer(getattr(optimizer, "_optimizer", optimizer))

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Remember the failure: the exit hook then leaves the process group alone (see ``_destroy_process_group``)."""
        _FAILED[0] = True
        super().on_exception(exception)

    # ------------------------------------------------------------------ steps
    def loss_context(self) -> Any:
        """The vocab-parallel loss context when the plan has a ``vocab_head`` (the loss's forward and backward must
        run inside it), else a no-op context."""
        return vocab_parallel_loss() if self.parallel is not None and self.parallel.loss_parallel else nullcontext()

    @contextmanager
    def _step_context(self) -> Generator[None, None, None]:
        with self.precision_plugin.forward_context(), self.loss_context():
            yield

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pp:
            batch = args[0] if args else kwargs["batch"]
            return self._pipelined.training_step(batch, args[1] if len(args) > 1 else kwargs.get("batch_idx", 0))
        with self.loss_context():
            return super().training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Backward, then the end of the dp reduction, then ``on_after_backward``.

        Lightning's own ``Strategy.backward`` calls ``on_after_backward`` (in the precision plugin's ``post_backward``)
        before the strategy's ``post_backward``; under ``DDPStrategy`` and ``FSDPStrategy`` the reduction has ended
        inside backward by then, so a user's ``on_after_backward`` (gradient-norm logging, say) sees gradients averaged
        over dp. The dp engine here finishes after backward returns, so this runs it before that hook, as the
        pipelined path does; otherwise the hook would see this rank's unreduced gradients
        (tests/distributed/test_ddp_overlap.py). Replicated parameters' partial gradients over tp (sequence-parallel
        norms) are summed once per optimizer step, before ``on_before_optimizer_step`` (see :meth:`optimizer_step`).
        """
        if self._pp:
            return self._pipelined.backward(closure_loss)
        module = self.lightning_module
        with self.loss_context():
            self.pre_backward(closure_loss)
            closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
            self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
            if self.parallel is not None:
                self.log_comm(self.parallel.engine.post_backward())
            return self.precision_plugin.post_backward(closure_loss, module)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        if self.parallel is not None:
            self.parallel.engine.pre_backward()

    def log_comm(self, stats: Any) -> None:
        """Log a synchronised backward's exposed communication time as ``parallel/comm_exposed_ms``, every
        ``log_every_n_steps`` (see :func:`~lightning_par.callbacks.metrics.log_comm_stats`)."""
        log_comm_stats(self.lightning_module, stats, name="parallel/comm_exposed_ms", prog_bar=self.prog_bar)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Under tensor parallelism without pipelining, once the step's last backward and its dp reduction are done
        (inside ``closure``), sum the replicated parameters' partial gradients over tp (sequence-parallel norms),
        before clipping and the step. (Pipelined: in the schedule's ``backward``.)"""
        if self._pp or self.parallel is None or self.parallel_dims is None or not self.parallel_dims.tp_enabled:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        parallel = self.parallel

        def closure_then_sync() -> Any:
            out = closure()
            sync_tp_partial_grads(parallel.module, self.group("tp"), parallel.engine)
            return out

        return super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning enters this for every batch of an accumulation window but the last: no dp reduction then."""
        if self._pp:
            previous, self._pipelined.sync_blocked = self._pipelined.sync_blocked, True
            try:
                yield
            finally:
                self._pipelined.sync_blocked = previous
            return
        with self.parallel.engine.no_sync() if self.parallel is not None else nullcontext():
            yield

    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        """False: Lightning counts the accumulation window and steps the optimizer at its end."""
        return False

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        assert self.parallel is not None
        params = [p for group in optimizer.param_groups for p in group["params"]]
        groups = [self.group("pp")] if self.parallel_dims is not None and self.parallel_dims.pp_enabled else []
        self.parallel.engine.clip_grad_norm_(params, float(clip_val), 2.0, groups)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pp:
            loss = self._pipelined.eval_loss(args[0] if args else kwargs["batch"])
            self.lightning_module.log("val_loss", loss, prog_bar=True, sync_dist=True)
            return loss
        with self.loss_context():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pp:
            loss = self._pipelined.eval_loss(args[0] if args else kwargs["batch"])
            self.lightning_module.log("test_loss", loss, sync_dist=True)
            return loss
        with self.loss_context():
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pp:
            raise NotImplementedError(
                "predict is not supported under pipelining (pp_size > 1): the outputs live on the last stage only. "
                "Consolidate the checkpoint (python -m lightning_par.checkpoint.consolidate DIR FILE) and predict "
                "with one process or pp_size=1."
            )
        with self.loss_context():
            return super().predict_step(*args, **kwargs)

    @override
    def on_train_start(self) -> None:
        """Refuse, before any step, a pipelined loader whose batch size is not a multiple of ``num_microbatches``."""
        super().on_train_start()
        m = self.options.pipeline.num_microbatches
        loader = getattr(self.lightning_module.trainer, "train_dataloader", None) if self.lightning_module else None
        batch_size = getattr(loader, "batch_size", None)
        if self._sizes["pp_size"] > 1 and isinstance(batch_size, int) and batch_size % m != 0:
            raise ValueError(
                f"batch_size={batch_size} is not valid with num_microbatches={m}: expected a batch size that is a "
                f"multiple of {m}."
            )

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
        """The process group of one mesh axis (``"pp"``, ``"dp"`` or ``"tp"``) that contains this rank."""
        assert self.parallel_dims is not None
        return self.parallel_dims.get_mesh(axis).get_group()

    @override
    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
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
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ------------------------------------------------------------------ checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Load after :meth:`setup`, into the cut, split and sharded model and optimizers."""
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        """:meth:`load_checkpoint` restores the optimizers itself."""
        return False

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's part of the model, keyed by one-process name (sharded tensors as DTensors of their global
        shape, vocabulary padding cut off)."""
        if self.parallel is None:
            assert self.lightning_module is not None
            return self.lightning_module.state_dict()
        state = self.parallel.engine.model_state_dict()
        unpad_vocab_state(self.parallel.module, state, [])
        return state

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """This rank's part of the optimizer state, keyed by one-process parameter name."""
        assert self.parallel is not None
        state = self.parallel.engine.optimizer_state_dict(getattr(optimizer, "_optimizer", optimizer))
        unpad_vocab_state(self.parallel.module, {}, [state])
        return state

    def checkpoint_record(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """What this strategy writes into a checkpoint's record (``lightning_par.json``)."""
        dims = self.parallel_dims
        layout = {} if dims is None else {"dp_size": dims.dp_size, "tp_size": dims.tp_size, "pp_size": dims.pp_size}
        return {
            "strategy": self.strategy_name,
            "layout": layout,
            "dp_mode": self.dp_mode,
            "global_step": checkpoint.get("global_step"),
            "epoch": checkpoint.get("epoch"),
            "pp_schedule": self.options.pipeline.schedule if dims is not None and dims.pp_enabled else None,
            "sequence_parallel": self.options.tensor_parallel.sequence_parallel,
            "torch": torch.__version__,
        }

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write a sharded checkpoint directory at ``filepath`` atomically (see :mod:`lightning_par.checkpoint`).
        Every rank calls it.

        Raises:
            TypeError: ``storage_options`` is given (there is no ``CheckpointIO``).
        """
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(storage_options=...) is not supported.")
        path = Path(self.broadcast(str(filepath)))
        record = self.checkpoint_record(checkpoint)
        save_sharded(path, checkpoint, record, is_rank0=self.global_rank == 0, barrier=self.barrier)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint of any layout, dp mode or strategy into this rank's part of the model (and the optimizers
        when fitting); return the rest (loops, LR schedulers, ...) for Lightning to restore.

        Raises:
            FileNotFoundError, ValueError: a missing, torn, garbage or incompatible checkpoint (see
                :func:`lightning_par.checkpoint.read_record`), with what to do.
        """
        assert self.parallel is not None
        path = Path(self.broadcast(str(checkpoint_path)))
        engine = self.parallel.engine
        model_state = engine.model_state_dict()
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        optimizer_states = [engine.optimizer_state_dict(o) for o in optimizers]
        unpad_vocab_state(self.parallel.module, model_state, optimizer_states)
        # DCP keeps one copy of a non-tensor entry such as ``param_groups`` (the coordinator's): under pipelining its
        # parameter names are those of one stage. Keep the saved hyper-parameters and this rank's own names.
        own_names = [[list(g["params"]) for g in state["param_groups"]] for state in optimizer_states]
        meta = load_sharded(path, model_state, optimizer_states)
        for state, names in zip(optimizer_states, own_names):
            if len(state["param_groups"]) != len(names):
                raise ValueError(
                    f"checkpoint {str(path)!r} has an optimizer with {len(state['param_groups'])} param groups, this "
                    f"one has {len(names)}: configure_optimizers must build the same groups."
                )
            state["param_groups"] = [{**g, "params": n} for g, n in zip(state["param_groups"], names)]
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

    def full_state_dict(self) -> dict[str, Tensor]:
        """Every parameter of the whole model in full, keyed by one-process name, on every rank (fp32 masters under
        mixed precision). Collective over the whole world (tp/dp gathers, then the pp group); for tests and small
        models — checkpoints never gather."""
        assert self.parallel is not None
        local = {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
            for k, v in self.parallel.engine.full_state_dict().items()
        }
        from lightning_par.tensor_parallel.state_dict import padded_parameters

        for name, vocab in padded_parameters(self.parallel.module).items():
            if name in local:
                local[name] = local[name][:vocab].clone()
        if self.parallel_dims is None or not self.parallel_dims.pp_enabled:
            return local
        parts: list[Any] = [None] * self.parallel_dims.pp_size
        dist.all_gather_object(parts, local, group=self.group("pp"))
        return {k: v for part in parts for k, v in part.items()}

    # ------------------------------------------------------------------ reporting
    def summary_extras(self) -> dict[str, Any]:
        """Strategy figures for ``summary.json``: layout, dp mode, the dp engine's and the pipeline's figures."""
        dims = self.parallel_dims
        if dims is None:
            return {}
        extras: dict[str, Any] = {
            "dp_size": dims.dp_size,
            "tp_size": dims.tp_size,
            "pp_size": dims.pp_size,
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
            extras["activation_checkpointed_modules"] = len(self.parallel.checkpointed)
            extras.update(self.parallel.engine.summary())
            if self.parallel.pipeline is not None:
                extras.update(self._pipelined.summary())
            if dims.tp_enabled:
                extras["param_bytes_per_rank"] = model_state_bytes(self.parallel.module)["param_bytes"]
                module = self.parallel.module
                padded = {
                    name: f"{getattr(m, VOCAB_SIZE_ATTR)} -> {m.weight.shape[0]}"
                    for name, m in module.named_modules()
                    if getattr(m, VOCAB_SIZE_ATTR, None) is not None and m.weight.shape[0] != getattr(m, VOCAB_SIZE_ATTR)
                }
                if padded:
                    extras["vocab_padding"] = padded
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

