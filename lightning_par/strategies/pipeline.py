"""``PipelineStrategy``: pipeline parallelism (GPipe, 1F1B, interleaved 1F1B) on the pp axis, inside Lightning's loop.

Lightning removed its only pipeline strategy in 1.4 (Lightning issue #17180 asks for one). This one cuts the
LightningModule's network into stages (:mod:`lightning_par.pipeline_parallel.split`), runs a schedule of forwards and
backwards over micro-batches inside ``training_step`` (:mod:`~lightning_par.pipeline_parallel.runner`), and leaves the
rest to Lightning: the optimizer step, learning-rate schedulers, gradient accumulation and clipping, validation,
logging, callbacks and checkpoints.

How it fits Lightning's automatic optimization (``Closure``: ``training_step``, then ``zero_grad``, then ``backward``,
then clipping and ``optimizer.step``):

* :meth:`PipelineStrategy.training_step` runs the whole schedule, so forward and backward both happen there, and
  returns the batch loss (computed on the last stage, shared with every rank of the pipeline, logged as
  ``train_loss``).
* Lightning zeroes the gradients *after* ``training_step`` on the first batch of each accumulation window. The strategy
  therefore clears the stale gradients itself before that batch's schedule, holds the new gradients aside while
  Lightning's ``zero_grad`` runs, and hands them back in :meth:`PipelineStrategy.backward`, which runs no autograd
  (DeepSpeed's strategy makes ``backward`` a no-op in the same way). The result is exactly the gradients that one
  process would hold.
* Gradient accumulation stays Lightning's (``handles_gradient_accumulation`` is False): the loss of each batch is
  scaled by ``1 / accumulate_grad_batches`` inside the schedule, and the data-parallel all-reduce runs only on the
  batch that ends a window (Lightning wraps the others in :meth:`PipelineStrategy.block_backward_sync`).
* Norm clipping uses the norm of the whole model, combined over the pp group
  (:func:`~lightning_par.pipeline_parallel.clip.clip_grad_norm_across_ranks`), not the norm of one stage.
* Checkpoints hold the whole model under its usual parameter names, gathered over the pp group, and an optimizer
  state keyed by parameter name; each stage loads its own part back
  (:mod:`~lightning_par.pipeline_parallel.checkpoint`).

On the dp axis, gradients are averaged by the same bucketed all-reduce as ``ddp_overlap``
(:class:`~lightning_par.data_parallel.reducer.GradientReducer` over the dp group; torch's DDP does not compose with
pipelining). The schedule runs ``m`` backward passes per step, so the reducer stays off during the schedule and reduces
every gradient once after it (``reduce_all``).
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from typing_extensions import override

from lightning_par.data_parallel.compression import validate_comm_hook
from lightning_par.data_parallel.reducer import GradientReducer
from lightning_par.parallel_dims import ParallelDims
from lightning_par.pipeline_parallel.bubble import summarize_bubble
from lightning_par.pipeline_parallel.checkpoint import (
    gather_state_dicts,
    load_local_state_dict,
    merge_optimizer_states,
    optimizer_state_by_name,
    optimizer_state_from_names,
)
from lightning_par.pipeline_parallel.clip import clip_grad_norm_across_ranks
from lightning_par.pipeline_parallel.runner import PipelineRunner
from lightning_par.pipeline_parallel.schedules import bubble_formula, stage_ids, validate_schedule
from lightning_par.pipeline_parallel.split import (
    SPLIT_METHODS,
    cut_network,
    network_layers,
    plan_split,
    validate_split,
)
from lightning_par.strategies.base import MeshStrategy
from lightning_par.strategies.ddp_overlap import broadcast_from_dp_rank0

__all__ = ["PipelineStrategy", "pipeline_network"]

_CUT_MARK = "_lightning_par_pipeline_counts"


def pipeline_network(module: nn.Module, attr: str = "model") -> nn.Module:
    """The network a LightningModule keeps at ``attr``, checked to be splittable.

    Raises:
        ValueError: the module has no such attribute, no ``loss_fn``, or a network that cannot be split.
    """
    network = getattr(module, attr, None)
    if not isinstance(network, nn.Module):
        raise ValueError(
            f"PipelineStrategy(module_attr={attr!r}) is not valid for {type(module).__name__}: expected the "
            f"LightningModule to keep its network at .{attr} (an nn.Module)."
        )
    if not callable(getattr(module, "loss_fn", None)):
        raise ValueError(
            f"PipelineStrategy needs {type(module).__name__}.loss_fn(outputs, targets) -> scalar loss: the last "
            f"stage computes the loss itself (the LightningModule's training_step is not called)."
        )
    network_layers(network)  # raises for unsupported networks
    return network


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class PipelineStrategy(MeshStrategy):
    """Pipeline parallelism over the pp axis of the mesh, data parallelism over the dp axis.

    Registered as ``"gpipe"`` (``schedule="gpipe"``) and ``"1f1b"`` (``schedule="1f1b"``); pass
    ``schedule="interleaved_1f1b"`` for the interleaved schedule.

    The LightningModule keeps its network at ``.model`` (see ``module_attr``): the reference GPT, an ``nn.Sequential``
    or an ``nn.ModuleList``, and defines ``loss_fn(outputs, targets)``. Batches are ``(inputs, targets)``. The
    strategy logs ``train_loss`` (and ``val_loss``/``test_loss``), ``pp_bubble`` (measured idle share of the step,
    mean over stages) and ``pp_bubble_formula``; ``summary_extras()`` reports busy/idle time per stage and the peak
    number of micro-batches whose activations a stage held.

    Args:
        pp_size: pipeline ranks.
        dp_size: data-parallel replicas (``-1``: the rest of the processes).
        schedule: ``"gpipe"`` (Huang et al. 2019), ``"1f1b"`` (PipeDream-Flush, Narayanan et al. 2021) or
            ``"interleaved_1f1b"`` (Narayanan et al. 2021, §2.2).
        num_microbatches: micro-batches per batch; the batch size must be a multiple of it.
        virtual_stages: model chunks per rank for ``interleaved_1f1b`` (default 2); 1 (or None) otherwise.
        split: ``"params"`` (balance parameter counts), ``"time"`` (measured layer times, via fairscale),
            ``"size"`` (measured memory, via fairscale, CUDA only), or a list of layer counts per virtual stage.
        module_attr: attribute of the LightningModule holding the network.
        measure_bubble: start each step with a barrier over the pp group so the bubble is measured within the step.
        split_timeout_s: profiling time for ``split="time"``.
        bucket_cap_mb, gradient_as_bucket_view, comm_hook, powersgd_rank, powersgd_start_iter: the dp-axis
            all-reduce, as for :class:`~lightning_par.strategies.ddp_overlap.DDPOverlapStrategy`.
        **kwargs: see :class:`~lightning_par.strategies.base.MeshStrategy` (``timeout_s``, ...).

    Raises:
        ValueError: an invalid option (named in the message), here; a model that does not fit the pipeline (fewer
            layers than virtual stages, an explicit split that does not cover it), before the process group starts;
            a batch size that is not a multiple of ``num_microbatches``, before the first step.
    """

    strategy_name: ClassVar[str] = "gpipe"
    description: ClassVar[str] = "Pipeline parallel on the pp axis (gpipe / 1f1b / interleaved), bucketed all-reduce on dp"
    #: Lightning registry names and the options each one implies.
    registry_names: ClassVar[tuple[str, ...]] = ("gpipe", "1f1b")
    registry_presets: ClassVar[dict[str, dict[str, Any]]] = {
        "gpipe": {"schedule": "gpipe"},
        "1f1b": {"schedule": "1f1b"},
    }

    def __init__(
        self,
        pp_size: int = 2,
        dp_size: int = -1,
        schedule: str = "gpipe",
        num_microbatches: int = 4,
        virtual_stages: int | None = None,
        split: str | Sequence[int] = "params",
        module_attr: str = "model",
        measure_bubble: bool = True,
        split_timeout_s: float = 1.0,
        bucket_cap_mb: float = 25.0,
        gradient_as_bucket_view: bool = False,
        comm_hook: str = "none",
        powersgd_rank: int = 1,
        powersgd_start_iter: int = 2,
        **kwargs: Any,
    ) -> None:
        if not isinstance(pp_size, int) or isinstance(pp_size, bool) or pp_size < 1:
            raise ValueError(f"pp_size={pp_size!r} is not valid: expected an integer >= 1 (pipeline ranks).")
        super().__init__(dp_size=dp_size, tp_size=1, pp_size=pp_size, **kwargs)
        self.schedule = schedule
        self.strategy_name = schedule  # type: ignore[misc]  # summary.json's "strategy": the schedule actually run
        self.num_microbatches = num_microbatches
        self.virtual_stages = validate_schedule(schedule, pp_size, num_microbatches, virtual_stages)
        if not isinstance(split, str):
            split = list(split) if isinstance(split, Sequence) else split
        if isinstance(split, str) and split not in SPLIT_METHODS:
            raise ValueError(
                f"split={split!r} is not valid: expected one of {list(SPLIT_METHODS)} or a list of layer counts per "
                f"virtual stage."
            )
        if not isinstance(split, (str, list)):
            raise ValueError(f"split={split!r} is not valid: expected one of {list(SPLIT_METHODS)} or a list of ints.")
        self.split = split
        if not isinstance(module_attr, str) or not module_attr:
            raise ValueError(f"module_attr={module_attr!r} is not valid: expected an attribute name.")
        self.module_attr = module_attr
        if not _is_number(split_timeout_s) or split_timeout_s <= 0:
            raise ValueError(f"split_timeout_s={split_timeout_s!r} is not valid: expected seconds > 0.")
        self.split_timeout_s = float(split_timeout_s)
        self.measure_bubble = bool(measure_bubble)
        validate_comm_hook(comm_hook, powersgd_rank, powersgd_start_iter)
        if not _is_number(bucket_cap_mb) or bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r} is not valid: expected a number > 0 (MiB).")
        self._reducer_kwargs = dict(
            bucket_cap_mb=bucket_cap_mb,
            gradient_as_bucket_view=gradient_as_bucket_view,
            comm_hook=comm_hook,
            powersgd_rank=powersgd_rank,
            powersgd_start_iter=powersgd_start_iter,
        )
        self.reducer: GradientReducer | None = None
        self.runner: PipelineRunner | None = None
        self.layer_counts: list[int] | None = None
        self._sync_blocked = False
        self._held_grads: list[Tensor | None] | None = None
        self._step_stats: list[list[tuple[float, float, float, int]]] = []  # per step, per pp stage

    # ------------------------------------------------------------------ layout
    @property
    def num_stages(self) -> int:
        """Virtual stages of the pipeline, ``pp_size * virtual_stages``."""
        return self._sizes["pp_size"] * self.virtual_stages

    @override
    def validate_model(self, dims: ParallelDims) -> None:
        """Check the network against the pipeline before the process group starts.

        Raises:
            ValueError: an unsupported network or a missing ``loss_fn``; fewer layers than virtual stages; an explicit
                ``split`` that does not match the virtual stages or does not cover the layers.
        """
        assert self.lightning_module is not None
        network = pipeline_network(self.lightning_module, self.module_attr)
        counts = getattr(network, _CUT_MARK, None)
        num_layers = sum(counts) if counts is not None else len(network_layers(network))
        validate_split(self.split, num_layers, self.num_stages, dims.pp_size)

    @property
    def pp_rank(self) -> int:
        assert self.parallel_dims is not None
        return self.parallel_dims.coordinates(self.global_rank)["pp"]

    def _profile_sample(self, network: nn.Module) -> Tensor | None:
        sample = getattr(self.lightning_module, "example_input_array", None)
        if isinstance(sample, Tensor):
            return sample.to(self.root_device)
        config = getattr(network, "config", None)
        if config is not None and hasattr(config, "vocab_size"):
            return torch.randint(0, config.vocab_size, (1, config.block_size), device=self.root_device)
        raise ValueError(
            f"split={self.split!r} profiles the layers on a sample input: set the LightningModule's "
            f"example_input_array to one input batch, or use split='params'."
        )

    def _plan(self, network: nn.Module) -> list[int]:
        if not isinstance(self.split, str) or self.split == "params":
            return plan_split(network, self.num_stages, self.split)
        counts = None
        if self.global_rank == 0:  # profile once: timings differ between ranks, and every rank must cut alike
            counts = plan_split(
                network,
                self.num_stages,
                self.split,
                self._profile_sample(network),
                timeout_s=self.split_timeout_s,
                device=self.root_device,
                num_microbatches=self.num_microbatches,
            )
        return self.broadcast(counts, src=0)

    def _cut(self) -> None:
        """Cut the network into this rank's stages (once) and build the runner."""
        module = self.lightning_module
        assert module is not None
        network = pipeline_network(module, self.module_attr)
        if self.runner is not None and getattr(network, _CUT_MARK, None) is not None:
            return
        if getattr(network, _CUT_MARK, None) is not None:
            raise RuntimeError("This LightningModule's network was already cut by another PipelineStrategy.")
        counts = self._plan(network)
        dims = self.parallel_dims
        assert dims is not None
        pp_rank = self.pp_rank
        holder, chunks = cut_network(network, counts, stage_ids(pp_rank, dims.pp_size, self.virtual_stages))
        object.__setattr__(holder, _CUT_MARK, list(counts))
        setattr(module, self.module_attr, holder)
        self.layer_counts = list(counts)
        self.runner = PipelineRunner(
            chunks,
            pp_rank=pp_rank,
            pp_size=dims.pp_size,
            group=self.group("pp"),
            schedule=self.schedule,
            num_microbatches=self.num_microbatches,
            loss_fn=module.loss_fn,
            device=self.root_device,
            forward_context=self.precision_plugin.forward_context,
            barrier=self.measure_bubble,
        )

    @property
    def _holder(self) -> nn.Module:
        return getattr(self.lightning_module, self.module_attr)

    @override
    def parallelize(self) -> None:
        self._cut()
        dims = self.parallel_dims
        assert dims is not None
        if self.reducer is not None:
            self.reducer.remove_hooks()
            self.reducer = None
        if dims.dp_size > 1:
            broadcast_from_dp_rank0(self._holder, self.group("dp"))
            self.reducer = self._make_dp_reducer(list(self._holder.parameters()))

    def _make_dp_reducer(self, params: list[nn.Parameter]) -> GradientReducer:
        """The dp-axis gradient averaging (override to plug in another engine, e.g. ZeRO)."""
        return GradientReducer(params, self.group("dp"), **self._reducer_kwargs)

    @override
    def parallelize_for_eval(self) -> None:
        self._cut()
        dims = self.parallel_dims
        assert dims is not None
        if dims.dp_size > 1:
            broadcast_from_dp_rank0(self._holder, self.group("dp"))

    @override
    def setup(self, trainer: Any) -> None:
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError(
                f"precision={trainer.precision!r} is not valid with PipelineStrategy: fp16 loss scaling is not "
                f"supported inside the schedule; use precision='bf16-mixed' or '32-true'."
            )
        super().setup(trainer)
        # Norm clipping must see the whole model's norm, combined over the stages.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]

    def _clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        clip_grad_norm_across_ranks(params, float(clip_val), [self.group("pp")])

    # ------------------------------------------------------------------ training
    @property
    @override
    def handles_gradient_accumulation(self) -> bool:
        """False: Lightning keeps counting the accumulation window and stepping the optimizer at its end; the
        schedule scales each batch's loss by ``1 / accumulate_grad_batches`` and skips the dp all-reduce inside the
        window (see :meth:`block_backward_sync`)."""
        return False

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning enters this for every batch of an accumulation window but the last: no dp all-reduce then."""
        previous, self._sync_blocked = self._sync_blocked, True
        try:
            yield
        finally:
            self._sync_blocked = previous

    @staticmethod
    def _unpack(batch: Any) -> tuple[Tensor, Tensor]:
        if isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, Tensor) for t in batch):
            return batch[0], batch[1]
        raise ValueError(
            f"a batch of type {type(batch).__name__} is not valid for PipelineStrategy: expected (inputs, targets), "
            f"two tensors split into micro-batches along dimension 0."
        )

    def _chunks_mode(self) -> None:
        assert self.runner is not None and self.lightning_module is not None
        for chunk in self.runner.chunks:
            chunk.train(self.lightning_module.training)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        """Run the schedule on the batch (forward and backward) and return the batch's mean loss on every rank."""
        assert self.runner is not None and self.lightning_module is not None
        batch = args[0] if args else kwargs["batch"]
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        x, y = self._unpack(batch)
        trainer = self.lightning_module.trainer
        accumulate = trainer.accumulate_grad_batches
        params = [p for p in self._holder.parameters() if p.requires_grad]
        opens_window = batch_idx % accumulate == 0
        if opens_window:  # Lightning's zero_grad comes after this step; drop the old gradients now instead
            for p in params:
                p.grad = None
        self._chunks_mode()
        if self.reducer is not None:
            self.reducer.require_sync = False
        loss = self.runner.train_step(x, y, loss_scale=1.0 / accumulate)
        if self.reducer is not None and not self._sync_blocked:
            self.reducer.reduce_all()
        if opens_window:  # hold the new gradients aside while Lightning zeroes; backward() hands them back
            self._held_grads = [p.grad for p in params]
            for p in params:
                p.grad = None
        loss = self._share_step(loss)
        module = self.lightning_module
        module.log("train_loss", loss, prog_bar=True)
        if self.measure_bubble and self._step_stats:
            stages = self._step_stats[-1]
            window = max(s[0] for s in stages)
            if window > 0:
                measured = sum(1.0 - s[1] / window for s in stages) / len(stages)
                module.log("pp_bubble", measured, on_step=True, on_epoch=False)
                module.log("pp_bubble_formula", self.bubble_formula, on_step=True, on_epoch=False)
        return loss

    @property
    def bubble_formula(self) -> float:
        """``(p - 1) / (v m + p - 1)``, see :func:`~lightning_par.pipeline_parallel.schedules.bubble_formula`."""
        return bubble_formula(self._sizes["pp_size"], self.num_microbatches, self.virtual_stages)

    def _share_step(self, loss: Tensor | None) -> Tensor:
        """One all-gather over the pp group: the loss from the last stage, and every stage's step timings."""
        assert self.runner is not None
        record = self.runner.history[-1]
        mine = torch.tensor(
            [float(loss) if loss is not None else float("nan"), *record.compact()], dtype=torch.float64
        )
        dims = self.parallel_dims
        assert dims is not None
        parts = [torch.empty_like(mine) for _ in range(dims.pp_size)]
        dist.all_gather(parts, mine, group=self.group("pp"))
        self._step_stats.append([(p[1].item(), p[2].item(), p[3].item(), int(p[4].item())) for p in parts])
        return parts[-1][0].to(torch.float32).to(self.root_device)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        """No autograd here: the schedule already ran every backward in :meth:`training_step`. Hands back the
        gradients held aside during Lightning's ``zero_grad`` and runs the ``on_before/after_backward`` hooks."""
        module = self.lightning_module
        assert module is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        if self._held_grads is not None:
            params = [p for p in self._holder.parameters() if p.requires_grad]
            for p, g in zip(params, self._held_grads):
                if g is None:
                    continue
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)
            self._held_grads = None
        return self.precision_plugin.post_backward(closure_loss, module)

    @override
    def on_train_start(self) -> None:
        """Refuse a loader whose batch size is not a multiple of ``num_microbatches``, before any step."""
        super().on_train_start()
        module = self.lightning_module
        loader = getattr(module.trainer, "train_dataloader", None) if module is not None else None
        batch_size = getattr(loader, "batch_size", None)
        if isinstance(batch_size, int) and batch_size % self.num_microbatches != 0:
            raise ValueError(
                f"batch_size={batch_size} is not valid with num_microbatches={self.num_microbatches}: expected a batch "
                f"size that is a multiple of {self.num_microbatches}."
            )

    # ------------------------------------------------------------------ evaluation
    def _eval_loss(self, batch: Any) -> Tensor:
        assert self.runner is not None
        x, _ = self._unpack(batch)
        self._chunks_mode()
        # Micro-batching does not change a forward-only result; use the largest count that divides this batch.
        m = max(d for d in range(1, self.num_microbatches + 1) if x.shape[0] % d == 0)
        with self.precision_plugin.forward_context():
            loss = self.runner.eval_step(*self._unpack(batch), num_microbatches=m)
        value = torch.tensor([float(loss) if loss is not None else 0.0], dtype=torch.float32)
        dims = self.parallel_dims
        assert dims is not None
        pp_group = self.group("pp")
        dist.broadcast(value, src=dist.get_global_rank(pp_group, dims.pp_size - 1), group=pp_group)
        return value[0].to(self.root_device)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Tensor:
        """Forward-only through the stages; logs ``val_loss`` (mean over batches and dp replicas)."""
        loss = self._eval_loss(args[0] if args else kwargs["batch"])
        assert self.lightning_module is not None
        self.lightning_module.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Tensor:
        """Forward-only through the stages; logs ``test_loss``."""
        loss = self._eval_loss(args[0] if args else kwargs["batch"])
        assert self.lightning_module is not None
        self.lightning_module.log("test_loss", loss, sync_dist=True)
        return loss

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "PipelineStrategy does not support predict: the outputs live on the last stage only. Load the "
            "checkpoint (a whole-model state dict) into the module and predict with one process."
        )

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole model's state dict (every stage's entries, gathered over the pp group), on every rank."""
        assert self.lightning_module is not None
        local = self.lightning_module.state_dict()
        if self.parallel_dims is None:
            return local
        return gather_state_dicts(local, self.group("pp"))

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer state of the whole model, keyed by parameter name (gathered over the pp group)."""
        assert self.lightning_module is not None
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        local = optimizer_state_by_name(optimizer, self.lightning_module)
        if self.parallel_dims is None:
            return local
        parts: list[Any] = [None] * self.parallel_dims.pp_size
        dist.all_gather_object(parts, local, group=self.group("pp"))
        return merge_optimizer_states(parts)

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        assert self.lightning_module is not None
        if strict:
            load_local_state_dict(self.lightning_module, checkpoint["state_dict"])
        else:
            own = self.lightning_module.state_dict()
            self.lightning_module.load_state_dict(
                {k: v for k, v in checkpoint["state_dict"].items() if k in own}, strict=False
            )

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        assert self.lightning_module is not None
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer_state_from_names(getattr(optimizer, "_optimizer", optimizer), self.lightning_module, state)

    # ------------------------------------------------------------------ reporting
    @override
    def summary_extras(self) -> dict[str, Any]:
        """Schedule, split and bubble figures for ``summary.json`` (the first step, with its one-off costs, is left
        out of the timings when there are others)."""
        extras = super().summary_extras()
        extras.update(
            pp_schedule=self.schedule,
            num_microbatches=self.num_microbatches,
            virtual_stages=self.virtual_stages,
            pp_layers_per_stage=self.layer_counts,
            pp_bubble_formula=self.bubble_formula,
        )
        steps = self._step_stats[1:] or self._step_stats
        if steps:
            per_stage = [[step[s] for step in steps] for s in range(len(steps[0]))]
            extras.update(summarize_bubble(per_stage))
            extras["pp_bubble_measured_steps"] = len(steps)
        return extras
