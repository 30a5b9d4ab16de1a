"""``TensorParallelStrategy``: Megatron tensor parallelism on the tp axis, bucketed data parallelism on the dp axis."""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any, ClassVar

from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_par.data_parallel.reducer import GradientReducer, reducer_options
from lightning_par.memory import model_state_bytes
from lightning_par.models.gpt import GPT
from lightning_par.models.gpt_tp_plan import gpt_tp_plan, validate_gpt_tp
from lightning_par.parallel_dims import ParallelDims
from lightning_par.pipeline_parallel.clip import clip_grad_norm_across_ranks
from lightning_par.strategies.base import MeshStrategy
from lightning_par.strategies.ddp_overlap import broadcast_from_dp_rank0
from lightning_par.strategies.reducer_hooks import ReducerHooks
from lightning_par.tensor_parallel import (
    VOCAB_SIZE_ATTR,
    apply_tensor_parallel,
    check_plan_styles,
    full_optimizer_state,
    full_state_dict,
    load_full_optimizer_state,
    load_full_state_dict,
    sync_tp_partial_grads,
    uses_vocab_parallel_loss,
    validate_plan,
    vocab_parallel_loss,
)

__all__ = ["TensorParallelStrategy"]

#: Attribute set on a module once the strategy has split it, so a second ``fit``/``validate`` does not split it again.
_APPLIED_ATTR = "_lp_tensor_parallel"


class TensorParallelStrategy(ReducerHooks, MeshStrategy):
    """Tensor parallelism over the tp axis (Megatron-LM, Shoeybi et al. 2019, §3), data parallelism over dp (2D).

    Every layer listed in the plan is split across the ``tp_size`` ranks of the tp axis with DTensor (see
    :mod:`lightning_par.tensor_parallel`); with ``sequence_parallel`` the norms and dropouts run on sequence shards
    too (Korthikanti et al. 2022). When the plan has a ``vocab_head``, ``training_step``/``validation_step`` and
    backward run under the vocab-parallel loss context, so the LightningModule's ordinary ``F.cross_entropy`` never
    gathers the logits (the loss is then a replicated DTensor). On the dp axis, gradients of the local shards are
    averaged by the bucketed, overlapped :class:`~lightning_par.data_parallel.reducer.GradientReducer`, as in
    ``ddp_overlap`` (torch DDP does not compose with DTensor parameters).

    The plan: by default the reference GPT's (:func:`~lightning_par.models.gpt_tp_plan.gpt_tp_plan`, applied to the
    LightningModule's ``model`` attribute, a :class:`~lightning_par.models.gpt.GPT`); for another model pass
    ``plan``, a dict from module path *relative to the LightningModule* (``*`` matches any child) to a style name:
    ``"colwise"``, ``"rowwise"``, ``"colwise_input"``, ``"sequence_parallel"``, ``"position_embedding"``,
    ``"replicate"``, ``"vocab_embedding"``, ``"vocab_head"`` (see :mod:`lightning_par.tensor_parallel.plan`).

    Registered as ``"tensor_parallel"``.

    Args:
        tp_size: tensor-parallel size.
        dp_size: data-parallel size (``-1``: ``world_size // tp_size``).
        sequence_parallel: shard norms, dropouts and the activations between sub-blocks over the sequence.
        plan: a user plan (see above); None uses the reference GPT's.
        bucket_cap_mb, gradient_as_bucket_view, static_graph, comm_hook, powersgd_rank, powersgd_start_iter: the
            dp-axis reducer's options, as for ``ddp_overlap``.
        **kwargs: see :class:`~lightning_par.strategies.base.MeshStrategy` (``timeout_s``, ...).

    Raises:
        ValueError: here, an invalid option or plan style name; before the process group starts
            (:meth:`validate_model`), a model the plan or ``tp_size`` does not fit: ``n_head``/``n_embd`` not
            divisible by ``tp_size``, a plan naming a missing module or an unknown style, or sequence parallelism
            with a model it does not support. Each message names the field, the value and what would be valid.
    """

    strategy_name: ClassVar[str] = "tensor_parallel"
    description: ClassVar[str] = "Megatron tensor parallelism on tp (DTensor), data parallel on dp"

    def __init__(
        self,
        tp_size: int = 2,
        dp_size: int = -1,
        sequence_parallel: bool = False,
        plan: Mapping[str, Any] | None = None,
        bucket_cap_mb: float = 25.0,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        comm_hook: str = "none",
        powersgd_rank: int = 1,
        powersgd_start_iter: int = 2,
        **kwargs: Any,
    ) -> None:
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size={tp_size!r} is not valid: expected an integer >= 1.")
        super().__init__(dp_size=dp_size, tp_size=tp_size, pp_size=1, **kwargs)
        if not isinstance(sequence_parallel, bool):
            raise ValueError(f"sequence_parallel={sequence_parallel!r} is not valid: expected True or False.")
        self.sequence_parallel = sequence_parallel
        self._plan = None if plan is None else check_plan_styles(plan)
        self._reducer_kwargs = reducer_options(
            bucket_cap_mb, gradient_as_bucket_view, static_graph, comm_hook, powersgd_rank, powersgd_start_iter
        )
        self.reducer: GradientReducer | None = None
        self._loss_parallel = False

    # ------------------------------------------------------------------ plan
    def plan_target(self) -> tuple[nn.Module, dict[str, Any]]:
        """The module the plan applies to, and the plan.

        Raises:
            ValueError: no ``plan`` was given and the LightningModule's ``model`` is not the reference GPT.
        """
        module = self.lightning_module
        if module is None:
            raise RuntimeError("TensorParallelStrategy needs a LightningModule (Trainer.fit connects it).")
        if self._plan is not None:
            return module, self._plan
        model = getattr(module, "model", None)
        if isinstance(model, GPT):
            return model, gpt_tp_plan()
        raise ValueError(
            f"TensorParallelStrategy(plan=None) is not valid for {type(module).__name__}: the default plan is the "
            f"reference GPT's (a LightningModule whose `model` is lightning_par.models.GPT). Pass plan={{module path: "
            f"style}} with paths relative to the LightningModule."
        )

    @override
    def validate_model(self, dims: ParallelDims) -> None:
        """Check the model and plan against ``dims.tp_size`` before the process group starts (see class Raises)."""
        root, plan = self.plan_target()
        for sub in root.modules():
            if isinstance(sub, GPT):
                validate_gpt_tp(sub.config, dims.tp_size, self.sequence_parallel)
        validate_plan(root, plan, dims.tp_size, self.sequence_parallel)

    def _apply_tp(self) -> None:
        root, plan = self.plan_target()
        if not getattr(root, _APPLIED_ATTR, False):
            assert self.parallel_dims is not None
            apply_tensor_parallel(root, self.parallel_dims.get_mesh("tp"), plan, self.sequence_parallel)
            setattr(root, _APPLIED_ATTR, True)
        self._loss_parallel = uses_vocab_parallel_loss(plan)

    @override
    def parallelize(self) -> None:
        assert self.model is not None and self.parallel_dims is not None
        self._apply_tp()
        dp_group = self.group("dp")
        broadcast_from_dp_rank0(self.model, dp_group)
        if self.reducer is not None:
            self.reducer.remove_hooks()
            self.reducer = None
        if self.parallel_dims.dp_enabled:
            self.reducer = GradientReducer(list(self.model.parameters()), dp_group, **self._reducer_kwargs)

    @override
    def parallelize_for_eval(self) -> None:
        assert self.model is not None
        self._apply_tp()
        broadcast_from_dp_rank0(self.model, self.group("dp"))

    # ------------------------------------------------------------------ steps
    def loss_context(self) -> Any:
        """The vocab-parallel loss context when the plan has a ``vocab_head``, else a no-op context."""
        return vocab_parallel_loss() if self._loss_parallel else nullcontext()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.loss_context():
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.loss_context():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.loss_context():
            return super().test_step(*args, **kwargs)

    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        # Split parameters are DTensors, replicated ones plain (issue 11): torch's clip_grad_norm_ stacks the norms of
        # one kind only; this one makes each DTensor norm whole and counts plain gradients once.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        clip_grad_norm_across_ranks(params, float(clip_val), [])

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Replicated parameters on sequence shards hold partial gradients: once the last backward of the step and
        the dp reduction are done (inside ``closure``), sum them over tp, before clipping and the step (issue 11)."""

        def closure_then_sync() -> Any:
            out = closure()
            if self.parallel_dims is not None and self.parallel_dims.tp_size > 1:
                sync_tp_partial_grads(self.plan_target()[0], self.group("tp"))
            return out

        return super().optimizer_step(optimizer, closure_then_sync, model, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        # The vocab-parallel loss's backward ops must run inside the same context as its forward.
        with self.loss_context():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        """As the base strategy; a DTensor (the vocab-parallel loss is a replicated one) is made plain first."""
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The one-process model's state dict: DTensors gathered, vocabulary padding removed (all ranks call it)."""
        assert self.lightning_module is not None
        return full_state_dict(self.lightning_module)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.lightning_module is not None
        load_full_state_dict(self.lightning_module, checkpoint["state_dict"], strict=strict)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer state with DTensor entries gathered and unpadded (all ranks call it)."""
        assert self.lightning_module is not None
        return full_optimizer_state(self.lightning_module, getattr(optimizer, "_optimizer", optimizer))

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.lightning_module is not None
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            load_full_optimizer_state(self.lightning_module, optimizer, state)

    # ------------------------------------------------------------------ reporting
    @override
    def summary_extras(self) -> dict[str, Any]:
        extras = super().summary_extras()
        extras["sequence_parallel"] = self.sequence_parallel
        if self.model is not None and self.parallel_dims is not None:
            extras["param_bytes_per_rank"] = model_state_bytes(self.model)["param_bytes"]
            padded = {
                name: (getattr(m, VOCAB_SIZE_ATTR), m.weight.shape[0])
                for name, m in self.model.named_modules()
                if getattr(m, VOCAB_SIZE_ATTR, None) is not None
            }
            if padded:
                extras["vocab_padding"] = {name: f"{v} -> {p}" for name, (v, p) in padded.items()}
        extras.update(self.reducer_extras(prefix="dp_"))
        return extras
