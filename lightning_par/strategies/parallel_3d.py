"""``Parallel3DStrategy``: tensor parallelism inside each pipeline stage, pipelining across stages, data parallelism
across replicas (ddp overlap, ZeRO-1, ZeRO-2 or ZeRO-3), on one ``("pp", "dp", "tp")`` mesh.

The layout of Megatron-LM's "PTD-P" (Narayanan et al. 2021, §2.3: tp innermost, pp outermost) built from the
project's single-technique pieces, applied to each rank's part of the model in this order:

1. cut this rank's pipeline stage(s) out of the network (:func:`~lightning_par.pipeline_parallel.split.cut_network`;
   parameter names stay those of the whole model);
2. split the stage over the tp sub-mesh (:func:`~lightning_par.tensor_parallel.apply_tensor_parallel` with
   ``skip_absent=True``: plan entries for the parts another stage holds are skipped);
3. the dp mode over the dp sub-mesh: ``"ddp"``, the bucketed all-reduce of
   :class:`~lightning_par.data_parallel.reducer.GradientReducer` (torch DDP does not compose with TP or PP), run once
   after the schedule; ``"zero1"``/``"zero2"``/``"zero3"``, :func:`~lightning_par.data_parallel.zero.apply_zero` on
   the stage (stages 1 and 2 reduce once after the schedule, ``defer_sync``/``reduce_now``; stage 3 is FSDP2, which
   reduce-scatters after each micro-batch's backward and accumulates the gradient shard).

The schedule (GPipe, 1F1B, interleaved 1F1B) runs inside Lightning's ``training_step`` as in
:class:`~lightning_par.strategies.pipeline.PipelineStrategy`, of which this is a subclass; forward and backward both
run under the vocab-parallel loss context when the plan has a ``vocab_head``. ``pp_size=1`` is micro-batched
gradient accumulation (one stage), so TP x DP and DP alone are special cases of the same code.

Checkpoints are sharded directories written with ``torch.distributed.checkpoint`` (DCP), keyed by the one-process
parameter names (``model.blocks.3.attn.q_proj.weight`` on whichever stage holds block 3), with each tensor a DTensor
of its global shape: they load into any other layout (dp, tp, pp sizes, dp mode) or into one process
(:func:`lightning_par.checkpoint.load_model_weights`). A checkpoint is written into a staging directory and renamed
into place once every rank has finished (:mod:`lightning_par.checkpoint.atomic`), so a crash during a save leaves the
previous checkpoint usable. Vocabulary padding (a vocab not divisible by ``tp_size``) changes global shapes, so such a
model is refused at save time: keep the vocabulary divisible by every tp size involved (256 is).
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any, ClassVar

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_par.checkpoint.atomic import commit_checkpoint_dir, staging_dir
from lightning_par.checkpoint.sharded import load_sharded, save_sharded
from lightning_par.data_parallel.zero import ZeroEngine, apply_zero
from lightning_par.data_parallel.zero_options import ZeroOptions, resolve_zero_options
from lightning_par.models.gpt import GPT
from lightning_par.models.gpt_tp_plan import gpt_tp_plan, validate_gpt_tp
from lightning_par.parallel_dims import ParallelDims, _check_int
from lightning_par.pipeline_parallel.fsdp_stages import fully_shard_chunks
from lightning_par.strategies.ddp_overlap import broadcast_from_dp_rank0
from lightning_par.strategies.pipeline import PipelineStrategy, pipeline_network
from lightning_par.tensor_parallel import (
    VOCAB_SIZE_ATTR,
    apply_tensor_parallel,
    check_plan_styles,
    sync_tp_partial_grads,
    uses_vocab_parallel_loss,
    validate_plan,
    vocab_parallel_loss,
)

__all__ = ["DP_MODES", "Parallel3DStrategy", "validate_3d_options"]

#: Data-parallel modes of the dp axis.
DP_MODES: tuple[str, ...] = ("ddp", "zero1", "zero2", "zero3")

_TP_APPLIED = "_lp_parallel_3d_tp"


def validate_3d_options(schedule: str, dp_mode: str, reshard_after_forward: bool) -> None:
    """Check the combinations of options the 3D layout refuses (no process group needed).

    Raises:
        ValueError: an unknown ``dp_mode``; ``schedule="interleaved_1f1b"`` with ``dp_mode="zero3"`` and
            ``reshard_after_forward=True``: interleaved schedules run several chunks' forwards before their backwards,
            and FSDP2 units that reshard after forward then need re-gathering in an order FSDP2 does not support
            correctly (pytorch/pytorch#164756, open).
    """
    if dp_mode not in DP_MODES:
        raise ValueError(f"dp_mode={dp_mode!r} is not valid: expected one of {list(DP_MODES)}.")
    if schedule == "interleaved_1f1b" and dp_mode == "zero3" and reshard_after_forward:
        raise ValueError(
            "schedule='interleaved_1f1b' with dp_mode='zero3' and reshard_after_forward=True is not valid: "
            "interleaved schedules with resharding FSDP2 units give wrong gradients or hang (open torch bug "
            "pytorch/pytorch#164756). Use reshard_after_forward=False, schedule='1f1b'/'gpipe', or dp_mode in "
            "['ddp', 'zero1', 'zero2']."
        )


def _local_loss(loss_fn: Any) -> Any:
    """``loss_fn`` whose result is a plain tensor: the vocab-parallel loss is a replicated DTensor, whose local value
    is the whole loss (``to_local`` is differentiable, so backward still reaches the sharded logits)."""

    def wrapped(outputs: Tensor, targets: Tensor) -> Tensor:
        loss = loss_fn(outputs, targets)
        return loss.to_local() if isinstance(loss, DTensor) else loss

    return wrapped


class Parallel3DStrategy(PipelineStrategy):
    """TP inside each pipeline stage, PP across stages, DP (``dp_mode``) across replicas: ``dp * tp * pp = world``.

    Registered as ``"parallel_3d"``. The LightningModule keeps its network at ``.model`` (a
    :class:`~lightning_par.models.gpt.GPT` for the default plan) and defines ``loss_fn(outputs, targets)``; batches
    are ``(inputs, targets)`` of a multiple of ``num_microbatches`` samples.

    Args:
        dp_size: data-parallel replicas (``-1``: ``world_size // (tp_size * pp_size)``).
        tp_size: tensor-parallel ranks per stage.
        pp_size: pipeline ranks (1: micro-batched gradient accumulation on one stage).
        dp_mode: ``"ddp"`` (bucketed all-reduce), ``"zero1"``, ``"zero2"`` or ``"zero3"`` (Rajbhandari et al. 2020).
        sequence_parallel: shard norms/dropouts over the sequence inside TP (Korthikanti et al. 2022).
        plan: a tensor-parallel plan relative to the network (``module_attr``); None: the GPT's
            (:func:`~lightning_par.models.gpt_tp_plan.gpt_tp_plan`).
        schedule, num_microbatches, virtual_stages, split, module_attr, measure_bubble, split_timeout_s: the pipeline,
            as for :class:`~lightning_par.strategies.pipeline.PipelineStrategy`.
        reshard_after_forward: zero3: free gathered parameters after each block's forward.
        mixed_precision: zero modes: ``None``, ``"bf16"``/``"fp16"`` or a dict (see
            :func:`~lightning_par.data_parallel.zero_options.resolve_zero_options`).
        bucket_cap_mb: bucket size in MiB of the dp reduction (ddp, zero1, zero2).
        gradient_as_bucket_view, comm_hook, powersgd_rank, powersgd_start_iter: the ddp reducer (``comm_hook`` also
            for zero1).
        **kwargs: see :class:`~lightning_par.strategies.base.MeshStrategy` (``timeout_s``, ...).

    Raises:
        ValueError: here, an invalid option or combination (:func:`validate_3d_options`, the pipeline's and ZeRO's
            checks); before the process group starts (:meth:`validate_model`), a model the plan, ``tp_size`` or the
            split does not fit.
    """

    strategy_name: ClassVar[str] = "parallel_3d"
    description: ClassVar[str] = "3D parallel: TP in each pipeline stage, PP across stages, ddp/zero1/zero2/zero3 on dp"
    registry_names: ClassVar[tuple[str, ...]] = ("parallel_3d",)
    registry_presets: ClassVar[dict[str, dict[str, Any]]] = {"parallel_3d": {}}

    def __init__(
        self,
        dp_size: int = -1,
        tp_size: int = 1,
        pp_size: int = 1,
        dp_mode: str = "ddp",
        sequence_parallel: bool = False,
        plan: Mapping[str, Any] | None = None,
        schedule: str = "1f1b",
        num_microbatches: int = 4,
        virtual_stages: int | None = None,
        split: str | Sequence[int] = "params",
        reshard_after_forward: bool = True,
        mixed_precision: str | dict[str, str] | None = None,
        bucket_cap_mb: float = 25.0,
        gradient_as_bucket_view: bool = False,
        comm_hook: str = "none",
        powersgd_rank: int = 1,
        powersgd_start_iter: int = 2,
        module_attr: str = "model",
        measure_bubble: bool = True,
        split_timeout_s: float = 1.0,
        **kwargs: Any,
    ) -> None:
        _check_int("tp_size", tp_size, 1)
        validate_3d_options(schedule, dp_mode, reshard_after_forward)
        if not isinstance(sequence_parallel, bool):
            raise ValueError(f"sequence_parallel={sequence_parallel!r} is not valid: expected True or False.")
        if dp_mode == "ddp" and mixed_precision is not None:
            raise ValueError(
                f"mixed_precision={mixed_precision!r} is not valid with dp_mode='ddp': expected None (use Trainer("
                f"precision='bf16-mixed') or a zero dp_mode for sharded mixed precision)."
            )
        super().__init__(
            pp_size=pp_size,
            dp_size=dp_size,
            schedule=schedule,
            num_microbatches=num_microbatches,
            virtual_stages=virtual_stages,
            split=split,
            module_attr=module_attr,
            measure_bubble=measure_bubble,
            split_timeout_s=split_timeout_s,
            bucket_cap_mb=bucket_cap_mb,
            gradient_as_bucket_view=gradient_as_bucket_view,
            comm_hook=comm_hook,
            powersgd_rank=powersgd_rank,
            powersgd_start_iter=powersgd_start_iter,
            **kwargs,
        )
        self._sizes["tp_size"] = tp_size
        self.strategy_name = "parallel_3d"  # type: ignore[misc]
        self.dp_mode = dp_mode
        self.sequence_parallel = sequence_parallel
        self._user_tp_plan = None if plan is None else check_plan_styles(plan)
        self.zero_options: ZeroOptions | None = None
        if dp_mode != "ddp":
            self.zero_options = resolve_zero_options(
                int(dp_mode[-1]),
                mixed_precision=mixed_precision,
                reshard_after_forward=reshard_after_forward,
                bucket_cap_mb=None if dp_mode == "zero3" else bucket_cap_mb,
                comm_hook=comm_hook if dp_mode == "zero1" else "none",
            )
        self.engine: ZeroEngine | None = None
        self._loss_parallel = False

    # ------------------------------------------------------------------ layout
    def _tp_plan(self, network: nn.Module) -> dict[str, Any]:
        if self._user_tp_plan is not None:
            return dict(self._user_tp_plan)
        if isinstance(network, GPT):
            return gpt_tp_plan()
        raise ValueError(
            f"Parallel3DStrategy(plan=None) is not valid for a network of type {type(network).__name__}: the default "
            f"plan is the reference GPT's. Pass plan={{module path relative to the network: style}}."
        )

    @override
    def validate_model(self, dims: ParallelDims) -> None:
        """The pipeline's checks (split, layers) and, with ``tp_size > 1``, the tensor-parallel ones (heads and
        widths divisible by ``tp_size``, the plan fits the network), before the process group starts.

        Raises:
            ValueError: see the class docstring.
        """
        super().validate_model(dims)
        if dims.tp_size == 1:
            return
        assert self.lightning_module is not None
        network = pipeline_network(self.lightning_module, self.module_attr)
        if getattr(network, _TP_APPLIED, False):
            return
        for sub in network.modules():
            if isinstance(sub, GPT):
                validate_gpt_tp(sub.config, dims.tp_size, self.sequence_parallel)
        validate_plan(network, self._tp_plan(network), dims.tp_size, self.sequence_parallel, skip_absent=True)

    def _apply_tp(self) -> None:
        """Split this rank's stage holder over the tp mesh (once)."""
        dims = self.parallel_dims
        assert dims is not None and self.runner is not None
        holder = self._holder
        if dims.tp_size > 1 and not getattr(holder, _TP_APPLIED, False):
            plan = self._tp_plan(holder)
            apply_tensor_parallel(holder, dims.get_mesh("tp"), plan, self.sequence_parallel, skip_absent=True)
            object.__setattr__(holder, _TP_APPLIED, True)
            self._loss_parallel = uses_vocab_parallel_loss(plan)
        elif dims.tp_size > 1:
            self._loss_parallel = uses_vocab_parallel_loss(self._tp_plan(holder))
        module = self.lightning_module
        assert module is not None
        self.runner.loss_fn = _local_loss(module.loss_fn)

    @override
    def parallelize(self) -> None:
        self._cut()
        self._apply_tp()
        dims = self.parallel_dims
        assert dims is not None
        if self.reducer is not None:
            self.reducer.remove_hooks()
            self.reducer = None
        holder = self._holder
        if self.engine is not None and self.engine.module is holder and self.dp_mode == "zero3":
            return  # FSDP2 already applied (fit after validate)
        if self.engine is not None:
            self.engine.remove()
            self.engine = None
        broadcast_from_dp_rank0(holder, self.group("dp"))
        if self.zero_options is not None:
            if self.zero_options.stage == 3:
                assert self.runner is not None
                fully_shard_chunks(self.runner.chunks, dims.get_mesh("dp"), self.zero_options)
            self.engine = apply_zero(holder, dims.get_mesh("dp"), self.zero_options)
        elif dims.dp_size > 1:
            self.reducer = self._make_dp_reducer(list(holder.parameters()))

    @override
    def parallelize_for_eval(self) -> None:
        self._cut()
        self._apply_tp()
        if self.dp_mode == "zero3":
            self.parallelize()
        else:
            broadcast_from_dp_rank0(self._holder, self.group("dp"))

    @override
    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)
        if self.engine is not None:
            for optimizer in self.optimizers:
                self.engine.shard_optimizer(getattr(optimizer, "_optimizer", optimizer))

    @override
    def _clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        if self.engine is None:
            super()._clip_grad_by_norm(optimizer, clip_val)
            return
        # ZeRO-1/2 optimizers step plain local shards: the engine knows how they add up (issue 11).
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.engine.clip_grad_norm_(params, float(clip_val), groups=[self.group("pp")])

    # ------------------------------------------------------------------ steps
    def loss_context(self) -> Any:
        """The vocab-parallel loss context when the plan has a ``vocab_head`` (both the forward and the backward of
        the loss must run inside it), else a no-op context."""
        return vocab_parallel_loss() if self._loss_parallel else nullcontext()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        """The schedule (forwards and backwards) under the loss context; ZeRO-1/2 defer their reduction to
        :meth:`backward` (after Lightning's ``zero_grad``, which clears the optimizer's shard gradients)."""
        defer = self.engine.defer_sync() if self.engine is not None else nullcontext()
        with self.loss_context(), defer:
            return super().training_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """Hand the schedule's gradients back (see the parent), then reduce them over dp once, on the batch that ends
        an accumulation window (ZeRO-1/2: ``reduce_now`` attaches the averaged shard gradients; ZeRO-3's FSDP2 has
        already reduce-scattered during the schedule)."""
        out = super().backward(closure_loss, optimizer, *args, **kwargs)
        if self.engine is not None and not self._sync_blocked:
            self.engine.reduce_now()
        dims = self.parallel_dims
        if not self._sync_blocked and dims is not None and dims.tp_size > 1:
            # Replicated parameters on sequence shards hold partial gradients: sum them over tp once (issue 11).
            sync_tp_partial_grads(self._holder, self.group("tp"), self.engine)
        return out

    @override
    def _share_step(self, loss: Tensor | None) -> Tensor:
        return super()._share_step(loss.full_tensor() if isinstance(loss, DTensor) else loss)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Tensor:
        with self.loss_context():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Tensor:
        with self.loss_context():
            return super().test_step(*args, **kwargs)

    def _reshard_eval(self) -> None:
        if self.engine is not None:
            self.engine.reshard()

    @override
    def on_validation_end(self) -> None:
        self._reshard_eval()

    @override
    def on_test_end(self) -> None:
        self._reshard_eval()

    # ------------------------------------------------------------------ state
    def _prefix(self, state: Mapping[str, Any]) -> dict[str, Any]:
        return {f"{self.module_attr}.{k}": v for k, v in state.items()}

    def _unprefix(self, state: Mapping[str, Any]) -> dict[str, Any]:
        cut = len(self.module_attr) + 1
        return {k[cut:]: v for k, v in state.items()}

    def _check_no_vocab_padding(self) -> None:
        for name, sub in self._holder.named_modules():
            vocab = getattr(sub, VOCAB_SIZE_ATTR, None)
            weight = getattr(sub, "weight", None)
            if vocab is not None and weight is not None and weight.shape[0] != vocab:
                raise ValueError(
                    f"{self.module_attr}.{name} has vocab_size={vocab} padded to {weight.shape[0]} for "
                    f"tp_size={self._sizes['tp_size']}: a sharded checkpoint would store the padded shape and not "
                    f"load into another tp size. Use a vocabulary divisible by every tp size involved (e.g. 256)."
                )

    def _model_state(self) -> dict[str, Any]:
        """This rank's model tensors keyed by one-process name, each a DTensor of its global shape (or plain)."""
        holder = self._holder
        if self.dp_mode == "zero3" and self.engine is not None:
            return self._prefix(self.engine.model_state_dict())
        return self._prefix(holder.state_dict())

    def _load_model_state(self, state: dict[str, Any]) -> None:
        if self.dp_mode == "zero3" and self.engine is not None:
            self.engine.load_model_state_dict(self._unprefix(state))
            return
        own = self._holder.state_dict()
        with torch.no_grad():
            for name, value in self._unprefix(state).items():
                target = own[name]
                dst = target._local_tensor if isinstance(target, DTensor) else target
                src = value._local_tensor if isinstance(value, DTensor) else value
                if src.data_ptr() != dst.data_ptr():
                    dst.copy_(src)
        if self.engine is not None:  # zero1/2: shard views share the rows; refresh fp32 masters if any
            shard_params = getattr(self.engine, "shard_params", {})
            layout = getattr(self.engine, "layout", None)
            if getattr(self.engine, "mixed", False) and layout is not None:
                with torch.no_grad():
                    for s in layout.shards:
                        local = s.param._local_tensor if isinstance(s.param, DTensor) else s.param
                        shard_params[s.name]._local_tensor.copy_(s.own_rows(local.data).float())

    def _optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        if self.engine is not None:
            state = self.engine.optimizer_state_dict(optimizer)
        else:
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            state = get_optimizer_state_dict(self._holder, optimizer)
        return _prefix_optimizer_state(state, self.module_attr)

    def _load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        state = _prefix_optimizer_state(state, self.module_attr, remove=True)
        if self.engine is not None:
            self.engine.load_optimizer_state_dict(optimizer, state)
        else:
            from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

            set_optimizer_state_dict(self._holder, optimizer, state)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Load after :meth:`setup`, into the cut, split and sharded model and optimizers."""
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's part of the model, keyed by one-process name (sharded tensors as global DTensors)."""
        if self.runner is None or self.parallel_dims is None:
            assert self.lightning_module is not None
            return self.lightning_module.state_dict()
        return self._model_state()

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """This rank's part of the optimizer state, keyed by one-process parameter name."""
        return self._optimizer_state(getattr(optimizer, "_optimizer", optimizer))

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write a sharded DCP directory at ``filepath`` through a staging directory (see the module docstring).
        Every rank calls it.

        Raises:
            TypeError: ``storage_options`` is given.
            ValueError: the model has vocabulary padding (see the module docstring).
        """
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(storage_options=...) is not supported.")
        self._check_no_vocab_padding()
        path = Path(self.broadcast(str(filepath)))
        staged = staging_dir(path)
        is_rank0 = self.global_rank == 0
        if is_rank0 and staged.exists():
            shutil.rmtree(staged)  # a save that crashed earlier
        self.barrier()
        save_sharded(staged, checkpoint, is_rank0=is_rank0)
        commit_checkpoint_dir(path, self.barrier, is_rank0)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded checkpoint of any layout into this rank's part of the model (and the optimizers when
        fitting); returns the rest for Lightning (loops, LR schedulers, ...)."""
        path = Path(self.broadcast(str(checkpoint_path)))
        model_state = self._model_state()
        optimizers = [o._optimizer if isinstance(o, LightningOptimizer) else o for o in self.optimizers]
        optimizer_states = [self._optimizer_state(o) for o in optimizers]
        # DCP keeps one copy of a non-tensor entry such as ``param_groups`` (the coordinator's): its parameter names
        # are those of one pipeline stage. Keep the saved hyper-parameters and this rank's own names.
        own_names = [[list(g["params"]) for g in state["param_groups"]] for state in optimizer_states]
        meta = load_sharded(path, model_state, optimizer_states)
        for state, names in zip(optimizer_states, own_names):
            if len(state["param_groups"]) != len(names):
                raise ValueError(
                    f"The checkpoint's optimizer has {len(state['param_groups'])} param groups, this one {len(names)}."
                )
            state["param_groups"] = [{**g, "params": n} for g, n in zip(state["param_groups"], names)]
        self._load_model_state(model_state)
        for optimizer, state in zip(optimizers, optimizer_states):
            self._load_optimizer_state(optimizer, state)
        return meta

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Nothing to do: :meth:`load_checkpoint` has loaded the model."""

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Nothing to do: :meth:`load_checkpoint` has loaded the optimizers."""

    def full_state_dict(self) -> dict[str, Tensor]:
        """Every parameter of the whole model in full, keyed by one-process name, on every rank. Collective over
        the whole world (tp/dp gathers, then the pp group)."""
        from lightning_par.pipeline_parallel.checkpoint import gather_state_dicts

        assert self.lightning_module is not None
        local = {}
        for name, p in self.lightning_module.named_parameters():
            local[name] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
        if self.engine is not None and getattr(self.engine, "mixed", False):
            for name, shard in getattr(self.engine, "shard_params", {}).items():
                local[f"{self.module_attr}.{name}"] = shard.full_tensor().detach().cpu().clone()
        return gather_state_dicts(local, self.group("pp"))

    # ------------------------------------------------------------------ reporting
    @override
    def summary_extras(self) -> dict[str, Any]:
        extras = super().summary_extras()
        extras.update(dp_mode=self.dp_mode, sequence_parallel=self.sequence_parallel)
        if self.engine is not None:
            extras.update(self.engine.summary())
        return extras



def _prefix_optimizer_state(state: dict[str, Any], attr: str, remove: bool = False) -> dict[str, Any]:
    """Rename the parameter keys of a name-keyed optimizer state (``get_optimizer_state_dict`` format)."""

    def rename(name: Any) -> Any:
        if not isinstance(name, str):
            return name
        if remove:
            return name[len(attr) + 1 :] if name.startswith(attr + ".") else name
        return f"{attr}.{name}"

    groups = [{**g, "params": [rename(n) for n in g["params"]]} for g in state["param_groups"]]
    return {"state": {rename(k): v for k, v in state["state"].items()}, "param_groups": groups}
