"""The dp axis behind one interface: what a strategy calls, whatever the dp mode.

:class:`DataParallelEngine` is what the strategy core drives from Lightning's hooks. Its implementations:

* :class:`DDPEngine` (``dp_mode="ddp"``): full replicas; gradients averaged by the bucketed, overlapped
  :class:`~lightning_par.data_parallel.reducer.GradientReducer` (torch's DDP does not compose with DTensor tensor
  parallelism or pipelining: it wraps the module, and there it crashes or trains with silently wrong losses);
* :class:`~lightning_par.data_parallel.zero.ZeroShardedDataParallel` (``"zero1"``, ``"zero2"``);
* :class:`~lightning_par.data_parallel.fsdp.FSDPZero` (``"zero3"``, FSDP2 ``fully_shard``).

Every engine keys model and optimizer state by parameter name (relative to the module it was applied to), with
sharded tensors as DTensors of their global shape, so ``torch.distributed.checkpoint`` reshards a checkpoint across
dp sizes, modes, tensor- and pipeline-parallel layouts and into one process.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_par.compat import local_tensor
from lightning_par.data_parallel.buffers import BufferSync
from lightning_par.data_parallel.meshes import DataParallelMeshes
from lightning_par.data_parallel.options import ReducerOptions, ZeroOptions, zero_stage
from lightning_par.data_parallel.reducer import CommStats, GradientReducer
from lightning_par.parallel_dims import broadcast_from_rank0

__all__ = ["DDPEngine", "DataParallelEngine", "ZeroEngine", "broadcast_from_dp_rank0", "values_copy"]


#: Every replica starts from dp rank 0's parameters and buffers.
broadcast_from_dp_rank0 = broadcast_from_rank0


@contextmanager
def sync_off(reducer: Any) -> Generator[None, None, None]:
    """Within the block, ``reducer``'s gradient hooks do not communicate (its ``require_sync`` is off); the previous
    setting comes back after it. A no-op for ``None`` (a dp size of 1 has no reducer)."""
    if reducer is None:
        yield
        return
    previous, reducer.require_sync = reducer.require_sync, False
    try:
        yield
    finally:
        reducer.require_sync = previous



def values_copy(t: Tensor) -> Tensor:
    """A detached copy of ``t``'s values; a quantized tensor subclass with a ``get_original_weight`` (torchao's NF4
    weight of a QLoRA base) as its dequantized values, since NF4's ``clone`` re-quantizes with default block sizes
    (and fails on weights whose scalers do not divide by 256)."""
    dequantize = getattr(t, "get_original_weight", None)
    return dequantize().detach() if callable(dequantize) else t.detach().clone()

class DataParallelEngine:
    """What a strategy needs from the dp axis; every method has a default that suits full replicas.

    Attributes:
        module: the model (a LightningModule or any ``nn.Module``); state keys are relative to it.
        dp_mesh: the 1-D data-parallel mesh.
        buffers: the module buffers' broadcast before each forward (set by :func:`lightning_par.data_parallel.apply.apply_data_parallel`).
    """

    #: ZeRO stage (0: not sharded).
    stage: int = 0

    def __init__(self, module: nn.Module, dp_mesh: DeviceMesh) -> None:
        self.module = module
        self.dp_mesh = dp_mesh
        self.buffers: BufferSync | None = None

    # ------------------------------------------------------------------ training
    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Make ``optimizer`` (built on the module's parameters, before its first step) step this rank's shard."""

    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Gradient-accumulation micro-steps that may skip gradient communication."""
        yield

    def pre_backward(self) -> None:
        """Called before each backward."""

    def post_backward(self) -> CommStats | None:
        """Called after each backward; returns the communication statistics of a synchronised backward."""
        return None

    @contextmanager
    def defer_sync(self) -> Generator[None, None, None]:
        """Backward passes inside do not communicate; :meth:`reduce_now` then reduces what they accumulated (for a
        pipeline schedule, whose micro-batch backwards run outside Lightning's backward)."""
        yield

    def reduce_now(self) -> CommStats | None:
        """Reduce the gradients accumulated under :meth:`defer_sync` and make them ready for the optimizer."""
        return None

    def clip_grad_norm_(
        self,
        params: Iterable[nn.Parameter],
        max_norm: float,
        norm_type: float = 2.0,
        groups: Sequence[dist.ProcessGroup | None] = (),
    ) -> Tensor:
        """Clip the gradients of ``params`` (the optimizer's) by the norm of the whole model; return that norm.

        Args:
            params: the parameters the optimizer steps on this rank.
            max_norm: largest allowed total norm.
            norm_type: ``q`` of the q-norm.
            groups: process groups whose ranks hold *other* parameters (the pp group); DTensor gradients count in
                full over their own meshes.
        """
        from lightning_par.pipeline_parallel.clip import clip_grad_norm_across_ranks

        return clip_grad_norm_across_ranks(params, max_norm, groups, norm_type)

    def reshard(self) -> None:
        """Free any gathered parameters (stage 3 after an evaluation forward, which no backward follows)."""

    # ------------------------------------------------------------------ state
    def model_state_dict(self) -> dict[str, Any]:
        """Model state keyed by parameter / buffer name (sharded parameters as DTensors of their global shape)."""
        return self.module.state_dict()

    @torch.no_grad()
    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        """Apply a state of :meth:`model_state_dict`'s structure (as filled in place by DCP)."""
        own = self.module.state_dict()
        for name, value in state.items():
            target = own.get(name)
            if not isinstance(target, Tensor) or not isinstance(value, Tensor):
                continue
            dst = local_tensor(target)
            src = local_tensor(value)
            if src.data_ptr() != dst.data_ptr():
                dst.copy_(src)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``{"state": {name: {key: tensor}}, "param_groups": [{..., "params": [names]}]}`` (the format of
        ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``; state created if still empty)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.module, optimizer)

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Apply a state of :meth:`optimizer_state_dict`'s structure."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.module, optimizer, state)

    def full_state_dict(self) -> dict[str, Tensor]:
        """Every parameter of the module gathered in full (fp32 masters under mixed precision), keyed by name, on
        every rank of the dp and tp meshes; collective. For tests and small models: checkpoints never gather."""
        return {
            name: values_copy(p.full_tensor() if isinstance(p, DTensor) else p)
            for name, p in self.module.named_parameters()
        }

    @torch.no_grad()
    def full_grads(self) -> dict[str, Tensor]:
        """Every parameter's gradient (averaged over dp, after the step's reduction) in full, keyed by name, on every
        rank of the dp and tp meshes; parameters without a gradient are left out. Collective (DTensor gradients are
        gathered over their meshes)."""
        return {
            name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach()
            for name, p in self.module.named_parameters() if p.grad is not None
        }

    # ------------------------------------------------------------------ reporting
    def summary(self) -> dict[str, Any]:
        """Figures for ``summary.json``."""
        return {"zero_stage": self.stage} if self.stage else {}

    def remove(self) -> None:
        """Detach hooks."""


class ZeroEngine(DataParallelEngine):
    """Base of the ZeRO engines: a :class:`DataParallelEngine` with validated ZeRO options.

    Attributes:
        options: the :class:`~lightning_par.data_parallel.options.ZeroOptions`.
    """

    def __init__(self, module: nn.Module, dp_mesh: DeviceMesh, options: ZeroOptions) -> None:
        super().__init__(module, dp_mesh)
        self.options = options

    @property
    def stage(self) -> int:  # type: ignore[override]
        return self.options.stage


class DDPEngine(DataParallelEngine):
    """Full replicas on the dp axis, gradients averaged by a bucketed all-reduce launched during backward.

    Args:
        module: the model; with ``dp_mesh`` of size 1 nothing is communicated.
        dp_mesh: 1-D data-parallel mesh.
        options: the reducer's options.
        params: the parameters this engine reduces (default: every trainable one of ``module``).
    """

    def __init__(
        self,
        module: nn.Module,
        dp_mesh: DeviceMesh,
        options: ReducerOptions | None = None,
        params: Sequence[nn.Parameter] | None = None,
    ) -> None:
        super().__init__(module, dp_mesh)
        options = options or ReducerOptions()
        self.reducer: GradientReducer | None = None
        params = [p for p in (module.parameters() if params is None else params) if p.requires_grad]
        if dp_mesh.size() > 1 and params:
            self.reducer = GradientReducer(params, dp_mesh.get_group(), **options.reducer_kwargs())

    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        if self.reducer is None:
            yield
            return
        with self.reducer.no_sync():
            yield

    def pre_backward(self) -> None:
        if self.reducer is not None:
            self.reducer.start_backward()

    def post_backward(self) -> CommStats | None:
        return self.reducer.finish() if self.reducer is not None else None

    def defer_sync(self) -> AbstractContextManager[None]:
        return sync_off(self.reducer)

    def reduce_now(self) -> CommStats | None:
        return self.reducer.reduce_all() if self.reducer is not None else None

    def summary(self) -> dict[str, Any]:
        return self.reducer.overlap_summary() if self.reducer is not None else {}

    def remove(self) -> None:
        if self.reducer is not None:
            self.reducer.remove_hooks()
