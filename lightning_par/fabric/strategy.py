"""Lightning Fabric's adapter for the one strategy core: the same layouts for a loop the user writes.

:class:`MeshStrategy` here is a ``lightning.fabric.strategies.ParallelStrategy``. It holds the Trainer strategy of the
same name and keywords (:class:`lightning_par.strategies.MeshStrategy` or one of its presets) as its *core*: the core
validates the sizes and options (the same ``ValueError``s, before any process starts) and gives the layout
(:meth:`~lightning_par.strategies.MeshStrategy.resolve_parallel_dims`), the precision options and the checkpoint
record. The model goes through the same :func:`lightning_par.parallelize.parallelize` (the axis registry), and
checkpoints through the same :mod:`lightning_par.checkpoint` code; this module only maps Fabric's calls
(``fabric.setup``, ``fabric.backward``, ``fabric.clip_gradients``, ``fabric.no_backward_sync``, ``fabric.save`` /
``fabric.load``, the collectives) onto the :class:`~lightning_par.parallelize.ParallelModel`.

What differs from the Trainer:

* ``pp_size > 1``: a pipeline schedule runs forward and backward itself, micro-batch by micro-batch, so Fabric's
  ``model(x)`` then ``fabric.backward(loss)`` has no place for it. The step is one call instead,
  :func:`lightning_par.fabric.train_step` (``loss = train_step(model, batch)``): it runs the schedule and returns the
  global batch's token mean on every rank; ``model(x)`` and ``fabric.backward`` raise a ``RuntimeError`` naming it. The
  model given to ``fabric.setup`` keeps its network at ``module_attr`` (``.model``) and defines
  ``loss_fn(outputs, targets)`` (the model contract's pipeline loss, :mod:`lightning_par.contract`).
* ``cp_size > 1``: each rank holds a piece of every sequence, targets included, so the step is the same one call,
  ``loss = train_step(model, (x, y), loss_fn=loss_fn)``: it splits inputs and targets along dim 1, passes the kept
  tokens' global ``position_ids`` to the model, weighs the ranks' gradients by their counted tokens (the axes' step
  wrappers, as under the Trainer) and returns the global batch's token mean; a training ``model(x)`` and
  ``fabric.backward`` raise a ``RuntimeError`` naming it. cp together with pp is refused at ``fabric.setup``.
* the loss: in a plain loop the strategy never sees the targets, so a label mask makes the dp average the mean of
  the replicas' means; ``train_step`` weighs the ranks as the Trainer does, and
  :func:`lightning_par.fabric.token_mean_loss` does it for a plain loop.
"""

from __future__ import annotations

import atexit
from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_par.checkpoint.sharded import save_sharded
from lightning_par.compat.fabric import (
    BackwardSyncControl,
    FabricSubprocessScriptLauncher,
    default_process_group_backend_for_device,
    distributed_is_initialized,
    init_dist_connection,
    sync_ddp_if_available,
)
from lightning_par.checkpoint.strategy_io import load_parallel_state
from lightning_par.fault.process_group_exit import destroy_process_group_at_exit
from lightning_par.parallel_dims import ParallelDims
from lightning_par.parallelize import ParallelModel, parallelize, validate
from lightning_par.strategies import MeshStrategy as TrainerMeshStrategy

__all__ = ["MeshStrategy", "FABRIC_KEYS"]

#: Entry of a Fabric checkpoint's ``meta.pt``: which keys of the saved ``state`` held the module and the optimizers.
FABRIC_KEYS = "fabric_keys"


class MeshStrategy(ParallelStrategy):
    """Every registered axis on one mesh (pp and cp through :meth:`train_step`), for ``lightning.fabric.Fabric`` and
    any ``nn.Module`` meeting :mod:`lightning_par.contract` (the network is the module itself, or its ``module_attr``
    attribute; under pipelining the network must be at ``module_attr``).

    Args:
        *args, **kwargs: the keywords of the Trainer strategy (:class:`lightning_par.strategies.MeshStrategy`:
            ``dp_size``, ``tp_size``, ``dp_mode``, ``dp_replicate_size``, ``dp_shard_size``, ``ep_size``,
            ``timeout_s``, the option groups ...; or those of the preset given as ``_preset``).
        _preset: the Trainer strategy class whose keywords and axes this is (the registry names fill it in:
            ``Fabric(strategy="zero3")`` is ``ZeroStrategy(stage=3)``'s).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision: filled in by Fabric.

    Raises:
        ValueError: what the Trainer strategy raises for these keywords; at ``fabric.setup``, a model the layout
            cannot run
            (:func:`lightning_par.parallelize.validate`).
    """

    def __init__(
        self,
        *args: Any,
        _preset: type[TrainerMeshStrategy] = TrainerMeshStrategy,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
        )
        self.core: TrainerMeshStrategy = _preset(*args, **kwargs)
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
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

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

    def _set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def setup_environment(self) -> None:
        """Validate the layout against the world (before the process group starts), start the process group with the
        core's collective timeout, build the mesh."""
        super().setup_environment()
        self._set_world_ranks()
        dims = self.core.resolve_parallel_dims(self.num_nodes * self.num_processes)
        self.options.check_layout(dims.pp_size)
        backend = self.core._process_group_backend or default_process_group_backend_for_device(self.root_device)
        self.core._process_group_backend = backend
        started = not dist.is_initialized()
        assert self.cluster_environment is not None
        init_dist_connection(self.cluster_environment, backend, timeout=timedelta(seconds=self.core._timeout_s))
        if started:
            atexit.register(destroy_process_group_at_exit)
        dims.build_mesh(self.root_device.type)
        self.parallel_dims = self.core.parallel_dims = dims

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
            self.parallel = parallelize(
                module, self.parallel_dims, self.core.precision_options(self.precision_name),
                device=self.root_device, step_context=self._step_context, check=False,
            )
            if self.parallel._batch_transforms and self.parallel.pipeline is not None:  # cp with pp
                sizes = {k: v for k, v in self.parallel_dims.sizes().items() if v > 1}
                raise ValueError(
                    f"this layout ({sizes}) splits every sequence over ranks (context parallelism) inside a pipeline "
                    f"schedule, which lightning_par.fabric.train_step does not run: use the Trainer for it, or a "
                    f"layout without one of the two (either alone runs through train_step)."
                )
            if self.parallel.pipeline is not None:
                module.register_forward_pre_hook(_refuse_pipelined_forward)
            elif self.parallel._batch_transforms:  # cp: the step call splits inputs and targets
                _check_positions(module)
                module.register_forward_pre_hook(self._refuse_split_forward)
            buffers = self.parallel.engine.buffers
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
        """Point ``optimizer`` at the parallel parameters (an optimizer built before ``fabric.setup`` holds the plain
        ones: they are replaced by name), shard its state (ZeRO) and run the axes' optimizer-step hooks after each of
        its steps (:meth:`~lightning_par.parallelize.ParallelModel.after_optimizer_step`: DeepSeek-V3's bias update of
        the MoE routers, float8's scales), as the Trainer's strategy does."""
        assert self.parallel is not None, "set up the model first: fabric.setup(model, optimizer)"
        params = dict(self.parallel.module.named_parameters())
        live = {id(p) for p in params.values()}
        for group in optimizer.param_groups:
            new = []
            for p in group["params"]:
                if id(p) in live:
                    new.append(p)
                elif id(p) in self._names and self._names[id(p)] in params:
                    if optimizer.state.get(p):
                        raise ValueError(
                            "optimizer has state already (it stepped before fabric.setup): build it fresh, or set "
                            "up the model first and build the optimizer over model.parameters()."
                        )
                    new.append(params[self._names[id(p)]])
                elif id(p) in self._names and self.parallel.pipeline is not None:
                    continue  # another pipeline stage's parameter: that stage's rank steps it
                else:
                    raise ValueError(
                        f"optimizer holds a parameter of shape {tuple(p.shape)} that is not one of the model's: "
                        f"build the optimizer over the model given to fabric.setup."
                    )
            group["params"] = new
        self.parallel.engine.shard_optimizer(optimizer)
        parallel = self.parallel
        if parallel.has_optimizer_step_hooks:  # as the Trainer's strategy: after the engine's own post-hook
            # (the MoE routers' bias update, float8's scales), also when the loop calls optimizer.step() itself
            optimizer.register_step_post_hook(lambda *_: parallel.after_optimizer_step())
        return optimizer

    # ------------------------------------------------------------------ steps
    def loss_context(self) -> AbstractContextManager[Any]:
        """The context the loss must be computed in: the vocab-parallel loss of a tp plan with a ``vocab_head``
        (``with fabric.strategy.loss_context(): loss = F.cross_entropy(logits, y)``); a no-op otherwise.
        ``fabric.backward`` enters it itself."""
        return self.parallel.loss_context() if self.parallel is not None else nullcontext()

    @override
    def backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Backward, then the end of the dp reduction (the bucketed reducer overlaps it; skipped inside
        ``fabric.no_backward_sync``)."""
        if self.parallel is None:
            return super().backward(tensor, module, *args, **kwargs)
        if self.parallel.pipeline is not None:
            raise RuntimeError(_PIPELINED_STEP)
        if self.parallel._batch_transforms:
            raise RuntimeError(_SPLIT_STEP.format(layout=self._layout()))
        self._backward(tensor, module, *args, **kwargs)

    def _backward(self, tensor: Tensor, module: nn.Module | None, *args: Any, **kwargs: Any) -> None:
        """Fabric's precision backward between the dp engine's hooks, in the loss context."""
        assert self.parallel is not None
        engine = self.parallel.engine
        with self.parallel.loss_context():
            engine.pre_backward()
            self.precision.pre_backward(tensor, module)
            self.precision.backward(tensor, module, *args, **kwargs)
            engine.post_backward()
            self.precision.post_backward(tensor, module)
        if not self._sync_blocked:
            self._grads_pending = True

    @contextmanager
    def _step_context(self) -> Generator[None, None, None]:
        """Around each pipeline schedule run: Fabric's precision (autocast under ``"bf16-mixed"``), as its
        ``model(x)`` would enter, and the loss context."""
        with self.precision.forward_context(), self.loss_context():
            yield

    def train_step(self, batch: Any, loss_scale: float = 1.0, loss_fn: Any = None) -> Tensor:
        """One forward and backward over ``batch`` (see :func:`lightning_par.fabric.train_step`): the pipeline
        schedule under ``pp_size > 1``, else the model's forward on this rank's piece of the batch (cp: its piece of
        every sequence) through the axes' step wrappers."""
        parallel = self.parallel
        if parallel is None:
            raise RuntimeError("train_step before fabric.setup(model, ...): set up the model first.")
        if parallel.pipeline is None:
            return self._step(batch, float(loss_scale), loss_fn)
        if loss_fn is not None:
            raise ValueError(
                f"train_step(..., loss_fn={getattr(loss_fn, '__name__', type(loss_fn).__name__)}) is not valid under "
                f"pipelining (pp_size={parallel.dims.pp_size}): the schedule's loss is the model's loss_fn (or "
                f"pipeline_loss), fixed at fabric.setup; define it on {type(parallel.module).__name__} and pass no "
                f"loss_fn."
            )
        from lightning_par import contract

        module = parallel.module
        prepared = parallel.prepare_batch(batch)
        inputs, targets = contract.pipeline_batch(module, prepared)
        for m in parallel.stage_modules:
            m.train(module.training)
        with parallel.engine.defer_sync():
            loss = parallel.pipeline.train_step(inputs, targets, loss_scale=float(loss_scale))
        for after in parallel.after_schedule:  # e.g. tp's partial gradients, deferred out of the schedule
            after()
        loss = parallel.steps._share_step(loss, self.root_device)
        if not self._sync_blocked:  # the end of an accumulation window: one dp reduction of what accumulated
            parallel.engine.reduce_now()
            self._grads_pending = True
        # the replica's token mean (the schedule weighs its micro-batches by their counted tokens) -> the global one
        return self._global_mean(loss, contract.batch_counted_tokens_tensor(module, prepared, self.root_device))

    def _step(self, batch: Any, loss_scale: float, loss_fn: Any) -> Tensor:
        """:meth:`train_step` without a pipeline: the batch through every axis's batch transform (cp: this rank's
        piece of each sequence, and its global ``position_ids``), ``loss_fn(model(*inputs), targets)`` in Fabric's
        precision and the loss context, through every axis's step wrapper (cp: the value becomes the token mean over
        the cp ranks; cp and dp: the gradient is weighed by each rank's share of the counted tokens), then backward."""
        from lightning_par import aux_loss, contract
        from lightning_par.data.doc_mask import batch_document_ids

        parallel = self.parallel
        assert parallel is not None
        module = parallel.module
        if loss_fn is None:
            loss_fn = next((m for m in (getattr(module, n, None) for n in ("pipeline_loss", "loss_fn")) if callable(m)),
                           None)
        if not callable(loss_fn):
            raise ValueError(
                f"train_step(model, batch) needs the loss: pass loss_fn=(outputs, targets) -> the batch's mean loss, "
                f"or define loss_fn(outputs, targets) on {type(module).__name__}; got loss_fn={loss_fn!r}."
            )
        precision = self.precision

        own: list[Tensor] = []  # this rank's loss, before the step wrappers

        def call(piece: Any) -> Any:
            args, kwargs, targets = _step_inputs(module, piece, split=bool(parallel._batch_transforms))
            args, kwargs = precision.convert_input((args, kwargs))
            with precision.forward_context():
                outputs = module(*args, **kwargs)
            loss = loss_fn(precision.convert_output(outputs), targets)
            own.append(loss)
            return loss

        prepared = parallel.transform_batch(batch)  # the buffer broadcast runs in the module's forward pre-hook
        previous_scale = aux_loss.aux_loss_scale()
        aux_loss.set_aux_loss_scale(loss_scale)  # an attached auxiliary loss (MoE) under the same factor
        self._in_step = True
        try:
            with parallel.loss_context(), parallel.steps._document_attention(batch_document_ids(prepared)):
                loss = parallel.run_step(call, prepared)
            if not (isinstance(loss, Tensor) and loss.numel() == 1 and loss.requires_grad):
                raise ValueError(
                    f"loss_fn(outputs, targets) must return a scalar tensor with a gradient; got "
                    f"{type(loss).__name__}{tuple(loss.shape) if isinstance(loss, Tensor) else ''}."
                )
            self._backward(loss * loss_scale if loss_scale != 1.0 else loss, module)
        finally:
            self._in_step = False
            aux_loss.set_aux_loss_scale(previous_scale)
        return self._global_mean(own[-1] if own else loss,
                                 contract.batch_counted_tokens_tensor(module, prepared, self.root_device))

    def _global_mean(self, local: Tensor, tokens: Tensor) -> Tensor:
        """``sum_r(L_r n_r) / sum_r(n_r)`` over the ranks holding other tokens of the global batch (the derived mesh
        ``dp_cp``; the tp and pp ranks of a replica hold the same): the global batch's token mean, on every rank.
        Collective over that mesh when it has more than one rank: one all-reduce of two numbers on the root device;
        ``tokens`` (this rank's counted tokens, a 0-dim tensor on the root device, from
        :func:`~lightning_par.contract.batch_counted_tokens_tensor`) and the result are never read to the host
        (``docs/host-syncs.md``); 0 where no rank counted a token."""
        assert self.parallel is not None
        value = local.detach().float().reshape(())
        mesh = self.parallel.dims.get_mesh("dp_cp")
        if mesh.size() == 1:
            return value
        n = tokens.detach().to(device=value.device, dtype=value.dtype).reshape(())
        # a rank that counted no token contributes 0 (its own mean is 0/0, NaN); the products in float32, the sums
        # in float64, as before the count stayed on the device
        both = torch.stack([torch.where(n > 0, value * n, torch.zeros_like(value)), n]).to(torch.float64)
        dist.all_reduce(both, group=mesh.get_group())
        return torch.where(both[1] > 0, both[0] / both[1], torch.zeros_like(both[1])).float()

    def token_mean(self, loss_sum: Tensor, tokens: Tensor | float) -> Tensor:
        """``loss_sum * dp_size / N`` where ``N`` is ``tokens`` summed over the dp ranks (see
        :func:`lightning_par.fabric.token_mean_loss`); ``loss_sum * 0`` (NaN taken as 0) where no dp rank counted a
        token. Collective over the dp group when ``dp_size > 1`` (one all-reduce of one number on the root device);
        the count stays a tensor on the root device and is never read to the host (``docs/host-syncs.md``)."""
        from lightning_par.data_parallel.token_mean import replicated_like

        parallel = self.parallel
        if parallel is None:
            raise RuntimeError("token_mean_loss before fabric.setup(model, ...): set up the model first.")
        dims = parallel.dims
        if parallel._batch_transforms:
            raise RuntimeError(
                f"token_mean_loss is for a loop of model(x) and fabric.backward, which this layout "
                f"({self._layout()}, context parallelism) does not run: train_step(model, (x, y), loss_fn=loss_fn) "
                f"already returns and differentiates the token mean."
            )
        count = torch.as_tensor(tokens, dtype=torch.float64, device=self.root_device).detach().reshape(()).clone()
        if dims.dp_size > 1:
            dist.all_reduce(count, group=dims.group("dp"))
        counted = count > 0
        # dp_size / N in float64 (as a Python float was), then in the loss's dtype; 0 where nothing was counted
        scale = torch.where(counted, dims.dp_size / count, torch.zeros_like(count)).to(loss_sum.dtype)
        scale, counted = replicated_like(scale, loss_sum), replicated_like(counted, loss_sum)
        return torch.where(counted, loss_sum * scale, loss_sum.nan_to_num(0.0) * 0.0)

    def _refuse_split_forward(self, module: nn.Module, args: Any) -> None:
        """Forward pre-hook under cp: a training forward outside :meth:`train_step` would not split the sequence."""
        if not self._in_step and module.training and torch.is_grad_enabled():
            assert self.parallel is not None
            raise RuntimeError(
                f"{type(module).__name__}(...) was called for training: "
                + _SPLIT_STEP.format(layout=self._layout())
            )

    def _layout(self) -> dict[str, int]:
        """The sizes above 1 of the layout, for messages."""
        assert self.parallel_dims is not None
        return {k: v for k, v in self.parallel_dims.sizes().items() if v > 1}

    def finish_gradients(self) -> None:
        """The gradient finishers (tp: the replicated parameters' partial gradients summed over tp), once per
        synchronised backward; run by ``fabric.clip_gradients`` and the optimizer step, whichever comes first."""
        if self._grads_pending and self.parallel is not None:
            self.parallel.finish_gradients()
        self._grads_pending = False

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        self.finish_gradients()
        return super().optimizer_step(optimizer, **kwargs)

    @staticmethod
    def _params(optimizer: Optimizer) -> list[Tensor]:
        optimizer = getattr(optimizer, "optimizer", optimizer)
        return [p for g in optimizer.param_groups for p in g["params"]]

    @override
    def clip_gradients_norm(
        self, module: nn.Module, optimizer: Optimizer, max_norm: float | int, norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip by the whole model's norm (every dp and tp shard); returns the norm before clipping.

        Raises:
            RuntimeError: the norm is not finite and ``error_if_nonfinite``.
        """
        assert self.parallel is not None
        self.precision.unscale_gradients(optimizer)
        self.finish_gradients()
        norm = self.parallel.clip_grad_norm_(self._params(optimizer), float(max_norm), float(norm_type))
        if error_if_nonfinite and not torch.isfinite(norm).all():
            raise RuntimeError(
                f"The total norm of order {float(norm_type)} of the gradients is non-finite ({float(norm):g}): "
                f"nothing was clipped. Pass error_if_nonfinite=False to clip anyway."
            )
        return norm

    @override
    def clip_gradients_value(self, module: nn.Module, optimizer: Optimizer, clip_val: float | int) -> None:
        """Clamp every gradient to ``[-clip_val, clip_val]`` (each rank's shard: exactly the one process's)."""
        assert self.parallel is not None
        self.precision.unscale_gradients(optimizer)
        self.finish_gradients()
        self.parallel.clip_grad_value_(self._params(optimizer), float(clip_val))

    # ------------------------------------------------------------------ collectives
    @override
    def all_reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        """Over the world by default (``"mean"``); a DTensor is made plain first."""
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        if isinstance(tensor, Tensor):
            return sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    # ------------------------------------------------------------------ checkpoints
    def _split_state(self, state: dict[str, Any]) -> tuple[str, list[str], list[str]]:
        modules = [k for k, v in state.items() if isinstance(v, nn.Module)]
        if len(modules) != 1 or self.parallel is None or state[modules[0]] is not self.parallel.module:
            raise ValueError(
                f"state={sorted(state)} is not valid here: expected exactly one model, the one given to fabric.setup "
                f"(found {len(modules)} nn.Module entries: {modules})."
            )
        optimizers = [k for k, v in state.items() if isinstance(v, Optimizer)]
        others = [k for k in state if k not in modules and k not in optimizers]
        return modules[0], optimizers, others

    @override
    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any | None = None, filter: Any | None = None
    ) -> None:
        """Write ``state`` as a sharded checkpoint directory at ``path``, committed atomically
        (:func:`lightning_par.checkpoint.save_sharded`): the model's and optimizers' shards keyed by one-process
        names (loadable at another layout, dp mode, strategy, and into one process with
        :func:`lightning_par.checkpoint.load_model_weights`), everything else in ``meta.pt``. Collective.

        Raises:
            ValueError: ``storage_options`` or ``filter`` given, or ``state`` without exactly the set-up model.
        """
        if storage_options is not None or filter is not None:
            raise ValueError(
                f"fabric.save(..., filter=/storage_options=) is not supported by {type(self).__name__}: the sharded "
                f"checkpoint holds the whole model and optimizer state. Save without them."
            )
        assert self.parallel is not None
        module_key, optimizer_keys, others = self._split_state(state)
        checkpoint: dict[str, Any] = {}
        for k in others:
            v = state[k]
            checkpoint[k] = v.state_dict() if hasattr(v, "state_dict") and callable(v.state_dict) else v
        checkpoint[FABRIC_KEYS] = {"module": module_key, "optimizers": optimizer_keys}
        checkpoint["state_dict"] = self.parallel.model_state_dict()
        checkpoint["optimizer_states"] = [
            self.parallel.optimizer_state_dict(getattr(state[k], "optimizer", state[k])) for k in optimizer_keys
        ]
        target = Path(self.broadcast(str(path)))
        record = self.core.checkpoint_record({"global_step": checkpoint.get("step", checkpoint.get("iter_num"))})
        record["fabric"] = True
        save_sharded(target, checkpoint, record, is_rank0=self.global_rank == 0, barrier=self.barrier)

    @override
    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load a checkpoint of :meth:`save_checkpoint` (any layout, dp mode or strategy that wrote it) into the
        set-up model and optimizers of ``state``; the other entries of ``state`` are replaced by the saved ones (an
        object with ``load_state_dict`` loads its saved state). Returns the saved entries ``state`` did not name.
        Collective.

        Raises:
            KeyError: ``strict`` and an entry of ``state`` the checkpoint lacks.
            ValueError: see :func:`lightning_par.checkpoint.load_sharded`; ``state`` without the set-up model, or
                with other optimizers than the saved ones.
        """
        from lightning_par.checkpoint.loading import read_full_checkpoint

        target = Path(self.broadcast(str(path)))
        if not state:  # the whole checkpoint, the model's weights in full
            checkpoint = read_full_checkpoint(target)
            keys = checkpoint.pop(FABRIC_KEYS, {"module": "state_dict"})
            checkpoint[keys["module"]] = checkpoint.pop("state_dict")
            return checkpoint
        if isinstance(state, (nn.Module, Optimizer)):
            raise ValueError(
                f"fabric.load(path, {type(state).__name__}) is not supported by {type(self).__name__}: pass a dict, "
                f"e.g. {{'model': model, 'optimizer': optimizer}}."
            )
        assert self.parallel is not None
        module_key, optimizer_keys, others = self._split_state(state)
        saved_keys: dict[str, Any] = {}

        def check(meta: dict[str, Any]) -> None:
            saved_keys.update(meta.get(FABRIC_KEYS) or {})
            saved_opt = list(saved_keys.get("optimizers", []))
            if sorted(saved_opt) != sorted(optimizer_keys) and (strict or not set(optimizer_keys) <= set(saved_opt)):
                raise ValueError(
                    f"checkpoint {str(target)!r} holds the optimizers {saved_opt}, state has {optimizer_keys}: pass "
                    f"the same keys."
                )
            missing = [k for k in others if k not in meta]
            if strict and missing:
                raise KeyError(
                    f"checkpoint {str(target)!r} has no entries {missing}; it has "
                    f"{sorted(k for k in meta if k != FABRIC_KEYS)}. Pass strict=False to skip them."
                )

        # The saved order of the optimizers (the checkpoint's optimizer_<i> entries).
        order = self._saved_optimizer_order(target, optimizer_keys)
        meta = load_parallel_state(
            self.parallel, target, [getattr(state[k], "optimizer", state[k]) for k in order], before_load=check
        )
        meta.pop(FABRIC_KEYS, None)
        for k in others:
            if k not in meta:
                continue
            value = meta.pop(k)
            if hasattr(state[k], "load_state_dict") and callable(state[k].load_state_dict):
                state[k].load_state_dict(value)
            else:
                state[k] = value
        return meta

    def _saved_optimizer_order(self, path: Path, optimizer_keys: list[str]) -> list[str]:
        """The keys of ``optimizer_keys`` in the order the checkpoint saved them (its ``optimizer_<i>`` entries)."""
        from lightning_par.checkpoint.safe import load_metadata_file
        from lightning_par.checkpoint.sharded import METADATA_FILENAME

        meta = load_metadata_file(path / METADATA_FILENAME)
        saved = list((meta.get(FABRIC_KEYS) or {}).get("optimizers", []))
        return [k for k in saved if k in optimizer_keys] if set(optimizer_keys) <= set(saved) else optimizer_keys

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register, under each Trainer registry name of lightning_par (``ddp_overlap``, ``zero1``-``zero3``,
        ``tensor_parallel``, ``parallel_3d``, ...), this class with that name's preset."""
        from lightning_par.strategies import STRATEGIES

        for preset in STRATEGIES:
            for name in preset.registry_names or (preset.strategy_name,):
                if name not in strategy_registry:
                    strategy_registry.register(
                        name, cls, description=f"{preset.description} (lightning_par, Fabric)", _preset=preset,
                        **preset.registry_presets.get(name, {}),
                    )


_PIPELINED_STEP = (
    "under pipelining (pp_size > 1) the schedule runs forward and backward itself, micro-batch by micro-batch: "
    "replace `loss = loss_fn(model(x), y); fabric.backward(loss)` by `loss = lightning_par.fabric.train_step(model, "
    "batch)` (the model's loss_fn makes each micro-batch's loss; inside fabric.no_backward_sync for accumulation, "
    "with loss_scale=1/accumulate), then fabric.clip_gradients / optimizer.step() as usual."
)


_SPLIT_STEP = (
    "under context parallelism (this layout: {layout}) each rank holds a piece of every sequence, inputs and targets "
    "alike, so the step is one call: replace `loss = loss_fn(model(x), y); fabric.backward(loss)` by `loss = "
    "lightning_par.fabric.train_step(model, (x, y), loss_fn=loss_fn)` (it splits the batch, passes position_ids to "
    "the model, returns the global batch's token mean; loss_scale=1/accumulate inside fabric.no_backward_sync), "
    "then fabric.clip_gradients / optimizer.step() as usual. Evaluation (model(x) under torch.no_grad() or "
    "model.eval()) runs on whole sequences."
)


def _check_positions(module: nn.Module) -> None:
    """Under cp, :meth:`MeshStrategy.train_step` passes the kept tokens' global positions as ``position_ids=`` to
    the module's forward, unless the module maps the batch itself (``pipeline_batch``).

    Raises:
        ValueError: neither is there.
    """
    import inspect

    if callable(getattr(module, "pipeline_batch", None)):
        return
    if "position_ids" not in inspect.signature(module.forward).parameters:
        raise ValueError(
            f"context parallelism in a Fabric loop is not valid for {type(module).__name__}: train_step passes each "
            f"rank's global token positions as position_ids=, and its forward takes no position_ids. Add a "
            f"position_ids argument to forward (hand it to the network), or define pipeline_batch(batch) -> "
            f"(inputs, targets) on it (the batch then ends with the positions, (seq / ranks,))."
        )


def _step_inputs(module: nn.Module, batch: Any, split: bool) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """``(args, kwargs, targets)`` of one step's ``batch`` (this rank's, after the batch transforms): through the
    module's ``pipeline_batch`` when defined; else ``batch`` is ``(inputs, targets)`` (under cp with the positions
    the split appended, passed as ``position_ids=``).

    Raises:
        ValueError: a batch of another structure and no ``pipeline_batch``.
    """
    from lightning_par import contract

    if callable(getattr(module, "pipeline_batch", None)):
        inputs, targets = contract.pipeline_batch(module, batch)
        return inputs, {}, targets
    kwargs: dict[str, Any] = {}
    if split and isinstance(batch, (tuple, list)) and len(batch) == 3:
        *batch, kwargs["position_ids"] = batch
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        inputs, targets = batch
        if isinstance(inputs, Tensor):
            return (inputs,), kwargs, targets
        if isinstance(inputs, (tuple, list)) and all(isinstance(t, Tensor) for t in inputs):
            return tuple(inputs), kwargs, targets
    raise ValueError(
        f"train_step(model, batch): a batch of type {type(batch).__name__} is not valid: expected (inputs, targets), "
        f"inputs a tensor or a tuple of tensors. Define {type(module).__name__}.pipeline_batch(batch) -> (inputs, "
        f"targets) to map another structure."
    )


def _refuse_pipelined_forward(module: nn.Module, args: Any) -> None:
    raise RuntimeError(
        f"{type(module).__name__}(...) was called: {_PIPELINED_STEP} Evaluation is not supported in a Fabric loop "
        f"under pipelining (this rank holds only its stages): evaluate with the Trainer, or load the checkpoint into "
        f"one process (lightning_par.checkpoint.load_model_weights)."
    )


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
