"""ZeRO on the dp axis: one object per model that shards optimizer state (stage 1), gradients (2), parameters (3).

ZeRO (Rajbhandari et al., SC'20) removes the ``N``-fold redundancy of data parallelism. With ``Psi`` parameters, fp32
Adam and ``N`` dp ranks, each rank holds (bytes, paper §5, with ``K = 8`` for fp32 Adam's two moments):

=========  =========================  =====================================================
stage      bytes per rank             communication per step (elements sent per rank, ring)
=========  =========================  =====================================================
DDP        ``(4 + 4 + 8) Psi``        all-reduce gradients: ``2 Psi (N-1)/N``
1          ``8 Psi + 8 Psi / N``      all-reduce gradients + all-gather parameters: ``3 Psi (N-1)/N``
2          ``4 Psi + 12 Psi / N``     reduce-scatter gradients + all-gather parameters: ``2 Psi (N-1)/N``
3          ``16 Psi / N``             all-gather forward + all-gather backward + reduce-scatter: ``3 Psi (N-1)/N``
=========  =========================  =====================================================

Stage 1 here all-reduces the gradients (the issue's choice, with ``ddp_overlap``'s bucketed, overlapped reducer,
so every rank still has the full averaged gradient, e.g. for logging) and then all-gathers the updated parameters:
``3 Psi (N-1)/N``, 1.5 times the paper's ``2 Psi (N-1)/N`` for P_os, which reduce-scatters (§7.2.1). Stage 2
reduce-scatters, so it sends the paper's ``2 Psi (N-1)/N``.

Two implementations behind one interface, :class:`ZeroEngine`:

* :class:`ZeroShardedDataParallel` (stages 1 and 2, this module): full parameters stay in the module; each rank's
  optimizer steps its ``Shard(0)`` chunk of every parameter (see :mod:`~lightning_par.data_parallel.shard_layout`),
  held as ``DTensor`` parameters on the dp mesh. The user's optimizer (any ``torch.optim.Optimizer`` built in
  ``configure_optimizers``) is kept and its ``param_groups`` are re-pointed at the chunks, so its class, hyper-
  parameters and LR schedulers keep working; its state is therefore created for the chunks only (``8 Psi / N`` bytes
  for Adam). A step post-hook all-gathers the updated chunks into the full parameters.
* :class:`~lightning_par.data_parallel.fsdp.FSDPZero` (stage 3): torch's FSDP2 ``fully_shard`` per block.

Both keep the optimizer state as ``Shard(0)`` DTensors keyed by parameter name, so checkpoints move between stages
and dp sizes (:mod:`lightning_par.checkpoint`).

Composition (the dp axis of a 2-D / 3-D layout): everything takes the module and the dp sub-mesh explicitly. A
tensor-parallel ``DTensor`` parameter is sharded along dim 0 of its local tensor, and its optimizer chunk is a
DTensor on the ``(dp, tp)`` mesh with FSDP2's placements (``_StridedShard`` when TP also split dim 0), so the
optimizer, norms and checkpoints see the whole tensor. A pipeline stage is just a smaller module: apply the engine
to it, run the schedule's backward pieces under :meth:`ZeroEngine.defer_sync` and call
:meth:`ZeroEngine.reduce_now` once (stage 3: FSDP2, which ``torch.distributed.pipelining`` drives itself).
Global-norm clipping over parameters on different meshes (TP and non-TP) needs each DTensor norm made whole before
summing (``torch.nn.utils.clip_grad_norm_`` stacks norms of one mesh only).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_par.data_parallel.reducer import CommStats, GradientReducer
from lightning_par.data_parallel.shard_layout import LayoutBucket, ParamShard, ShardLayout, local_tensor
from lightning_par.data_parallel.sharded_comm import ReduceScatterReducer, all_gather_params
from lightning_par.data_parallel.engine import ZeroEngine
from lightning_par.data_parallel.zero_options import ZeroOptions

__all__ = ["ZeroEngine", "ZeroShardedDataParallel", "apply_zero", "init_optimizer_state"]


def _shard_dtensor(local: Tensor, param: nn.Parameter, dp_mesh: DeviceMesh) -> DTensor:
    """``local`` (this rank's dim-0 chunk of ``param``'s local tensor) as a DTensor of ``param``'s global shape.

    A plain parameter gives ``Shard(0)`` on the dp mesh. A tensor-parallel DTensor parameter gives a DTensor on the
    concatenated ``(dp, *param mesh)`` mesh with placements ``(Shard(0) | _StridedShard(0), *param placements)``:
    FSDP2's layout for FSDP + TP, where ``_StridedShard`` records that dim 0 was first split by TP.
    """
    if isinstance(param, DTensor):
        spec = param._spec
        split = spec.num_shards_map[0]
        mesh = DeviceMesh._concatenate([dp_mesh, spec.mesh])
        placements = (_StridedShard(0, split_factor=split) if split > 1 else Shard(0), *spec.placements)
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=param.shape, stride=param.stride())
    return DTensor.from_local(local, dp_mesh, (Shard(0),), run_check=False, shape=param.shape, stride=param.stride())


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state of every parameter of ``optimizer`` without changing any value: one step with zero
    gradients and learning rate 0 (what ``torch.distributed.checkpoint.state_dict`` does before loading).

    The step counters this creates are overwritten by the checkpoint that is loaded next.

    Raises:
        ValueError: a param group has no ``"lr"``.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if all(len(optimizer.state.get(p, {})) > 0 for p in params):
        return
    if any("lr" not in group for group in optimizer.param_groups):
        raise ValueError(
            f"{type(optimizer).__name__} has a param group without 'lr': its state cannot be created without a step "
            f"that changes the parameters, so it cannot be loaded from a sharded checkpoint."
        )
    lrs = []
    for group in optimizer.param_groups:
        lrs.append(group["lr"])
        group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], Tensor) else 0.0
    grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer._zero_init = True  # type: ignore[attr-defined]  # tells post-step hooks to skip
    try:
        optimizer.step()
    finally:
        del optimizer._zero_init  # type: ignore[attr-defined]
        for group, lr in zip(optimizer.param_groups, lrs):
            group["lr"] = lr
        for p, g in zip(params, grads):
            p.grad = g


class ZeroShardedDataParallel(ZeroEngine):
    """ZeRO stage 1 or 2 for ``module`` over the dp mesh: full parameters, sharded optimizer state (and gradients).

    Set-up (the caller first makes the replicas equal, e.g. broadcast from dp rank 0):

    * the parameters are laid out in dim-0 chunks (:class:`~lightning_par.data_parallel.shard_layout.ShardLayout`);
      this rank's chunk of each is a ``DTensor`` parameter on the dp mesh, a *view* of the module parameter's rows,
      or, with ``param_dtype``, an fp32 master copy while the module's parameters are cast to ``param_dtype``;
    * stage 1: a :class:`~lightning_par.data_parallel.reducer.GradientReducer` all-reduces full gradients during
      backward (bucketed, overlapped, with the ``ddp_overlap`` options); the chunk gradients are views of them;
    * stage 2: a :class:`~lightning_par.data_parallel.sharded_comm.ReduceScatterReducer` reduce-scatters during
      backward into a ``Psi / N`` gradient shard and frees each full gradient as soon as it is packed.

    Per step: backward (reduced gradients) → :meth:`post_backward` attaches the chunk gradients → the optimizer
    steps the chunks (gradient clipping by norm over them is global: their DTensor norm sums the squares over dp) →
    its post-step hook all-gathers the chunks into the full parameters and drops the full gradients.

    Memory (fp32, Adam, counted from storages at the optimizer step): stage 1 ``4 Psi`` parameters + ``4 Psi``
    gradients (with ``gradient_as_bucket_view``, the default, the gradients are views of the reducer's buckets;
    without it the reducer's ``4 Psi`` of buckets come on top, attached to no tensor that is counted) + ``8 Psi / N``
    state; stage 2 ``4 Psi`` + ``4 Psi / N`` + ``8 Psi / N``, plus the buckets in flight during backward. Padding
    adds at most one row per tensor per rank. Under mixed precision the parameters and full gradients are in
    ``param_dtype`` and the fp32 masters (``4 Psi / N``) join the optimizer state, as in the paper's ``K = 12``.

    Args:
        module: the model; every parameter with ``requires_grad`` is sharded.
        dp_mesh: 1-D data-parallel mesh.
        options: stage 1 or 2 and the bucket / precision options.

    Raises:
        ValueError: no trainable parameter, a 0-dim or non-contiguous parameter, or ``options.stage`` not 1 or 2.
    """

    def __init__(self, module: nn.Module, dp_mesh: DeviceMesh, options: ZeroOptions) -> None:
        if options.stage not in (1, 2):
            raise ValueError(f"stage={options.stage} is not valid for ZeroShardedDataParallel: expected 1 or 2.")
        super().__init__(module, dp_mesh, options)
        group = dp_mesh.get_group()
        self.layout = ShardLayout(list(module.named_parameters()), group, options.bucket_cap_mb)
        self.mixed = options.param_dtype is not None
        self.shard_params: dict[str, nn.Parameter] = {}
        with torch.no_grad():
            for s in self.layout.shards:
                rows = s.own_rows(local_tensor(s.param).data)
                master = rows.to(torch.float32, copy=True) if self.mixed else rows
                self.shard_params[s.name] = nn.Parameter(_shard_dtensor(master, s.param, dp_mesh))
            if self.mixed:
                for s in self.layout.shards:
                    s.param.data = s.param.data.to(options.param_dtype)
                # The layout's buckets were sized and typed before the cast.
                self.layout = ShardLayout(list(module.named_parameters()), group, options.bucket_cap_mb)
        # What the optimizer may hold, by name: the shards, and frozen parameters (kept whole, never stepped).
        self._opt_params: dict[str, nn.Parameter] = {
            n: p for n, p in module.named_parameters() if not p.requires_grad
        } | self.shard_params
        self._name_of = {id(p): n for n, p in self._opt_params.items()}
        if options.stage == 1:
            self.reducer: GradientReducer | ReduceScatterReducer = GradientReducer(
                [s.param for s in self.layout.shards],
                group,
                bucket_cap_mb=options.bucket_cap_mb,
                gradient_as_bucket_view=options.gradient_as_bucket_view,
                static_graph=options.static_graph,
                comm_hook=options.comm_hook,
            )
        else:
            self.reducer = ReduceScatterReducer(
                self.layout, reduce_dtype=options.reduce_dtype, grad_dtype=torch.float32 if self.mixed else None
            )
        self._optimizer_buckets: dict[int, list[LayoutBucket]] = {}
        self._hooks: list[Any] = []
        self.gather_bytes = 0

    # ------------------------------------------------------------------ optimizer
    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Re-point ``optimizer``'s param groups at this rank's chunks and all-gather after each of its steps.

        Frozen parameters (``requires_grad=False``) stay in the optimizer unchanged: they get no gradient, so it never
        steps them.

        Raises:
            ValueError: the optimizer already has state (it has stepped), or holds a tensor that is not a parameter
                of the module.
        """
        if any(len(v) for v in optimizer.state.values()):
            raise ValueError("ZeRO must shard the optimizer before its first step, but it already has state.")
        buckets: set[int] = set()
        for group in optimizer.param_groups:
            new = []
            for p in group["params"]:
                if id(p) in self._name_of:  # already sharded, or frozen
                    new.append(p)
                    continue
                s = self.layout.by_param.get(id(p))
                if s is None:
                    raise ValueError(
                        f"The optimizer holds a tensor of shape {tuple(p.shape)} that is not a parameter of the "
                        f"module: ZeRO can only shard the module's own parameters."
                    )
                new.append(self.shard_params[s.name])
                buckets.add(s.bucket)
            group["params"] = new
        self._optimizer_buckets[id(optimizer)] = [self.layout.buckets[i] for i in sorted(buckets)]
        self._hooks.append(optimizer.register_step_post_hook(self._after_step))

    def _source(self, s: ParamShard) -> Tensor:
        return self.shard_params[s.name]._local_tensor

    @torch.no_grad()
    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if getattr(optimizer, "_zero_init", False):
            return
        buckets = self._optimizer_buckets.get(id(optimizer), self.layout.buckets)
        self.gather_bytes = all_gather_params(self.layout, self._source, buckets)
        for bucket in buckets:
            for s in bucket.shards:
                s.param.grad = None  # consumed by the step
        if isinstance(self.reducer, ReduceScatterReducer):
            self.reducer.reset()

    # ------------------------------------------------------------------ backward
    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Stage 1: skip the all-reduce while gradients accumulate. Stage 2 reduce-scatters every micro-batch (its
        full gradients are freed as soon as they are packed), so this does nothing there."""
        if not isinstance(self.reducer, GradientReducer):
            yield
            return
        with self.reducer.no_sync():
            yield

    def pre_backward(self) -> None:
        if self.reducer.require_sync:
            self.reducer.start_backward()

    @torch.no_grad()
    def post_backward(self) -> CommStats | None:
        """Finish the reduction and attach each chunk's averaged gradient (a DTensor) to its shard parameter."""
        if not self.reducer.require_sync:
            return None
        stats = self.reducer.finish()
        if stats is None:
            return None
        self._attach_shard_grads()
        return stats

    @contextmanager
    def defer_sync(self) -> Generator[None, None, None]:
        previous, self.reducer.require_sync = self.reducer.require_sync, False
        try:
            yield
        finally:
            self.reducer.require_sync = previous

    @torch.no_grad()
    def reduce_now(self) -> CommStats:
        stats = self.reducer.reduce_all()
        self._attach_shard_grads()
        return stats

    def _attach_shard_grads(self) -> None:
        for s in self.layout.shards:
            shard = self.shard_params[s.name]
            if isinstance(self.reducer, GradientReducer):
                grad = s.own_rows(local_tensor(s.param.grad))
            else:
                grad = self.reducer.shard_grad(s)
            if grad.dtype != shard.dtype:
                grad = grad.to(shard.dtype)
            shard.grad = _shard_dtensor(grad, s.param, self.dp_mesh)

    # ------------------------------------------------------------------ state
    def model_state_dict(self) -> dict[str, Any]:
        state = self.module.state_dict()
        for name, shard in self.shard_params.items():
            state[name] = shard.detach()
        return state

    @torch.no_grad()
    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        own = self.module.state_dict()
        for name, value in state.items():
            if name in self.shard_params:
                target = self.shard_params[name]._local_tensor
                source = value._local_tensor if isinstance(value, DTensor) else value
                if source.data_ptr() != target.data_ptr():
                    target.copy_(source)
            elif name in own and isinstance(value, Tensor) and value.data_ptr() != own[name].data_ptr():
                own[name].copy_(value)
        self.gather_bytes = all_gather_params(self.layout, self._source)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        init_optimizer_state(optimizer)
        state = {self._name_of[id(p)]: dict(optimizer.state[p]) for g in optimizer.param_groups for p in g["params"]}
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [self._name_of[id(p)] for p in g["params"]]}
            for g in optimizer.param_groups
        ]
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        init_optimizer_state(optimizer)
        _apply_optimizer_state(optimizer, state, self._name_of, lambda name: self._opt_params[name])

    def full_state_dict(self) -> dict[str, Tensor]:
        if self.mixed:
            out = {}
            for name, p in self.module.named_parameters():
                shard = self.shard_params.get(name)
                out[name] = (shard.full_tensor() if shard is not None else p).detach().clone()
            return out
        return {name: p.detach().clone() for name, p in self.module.named_parameters()}

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        history = self.reducer.history[1:] or self.reducer.history
        if history:
            comm = sum(s.comm_time_s for s in history)
            hidden = sum(s.hidden_time_s for s in history)
            out["comm_overlap_fraction"] = hidden / comm if comm > 0 else 0.0
            out["grad_comm_bytes_per_backward"] = history[-1].bytes_sent
        out["param_gather_bytes_per_step"] = self.gather_bytes
        out["num_buckets"] = len(self.layout.buckets)
        return out

    def remove(self) -> None:
        self.reducer.remove_hooks()
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _apply_optimizer_state(
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    name_of: dict[int, str],
    param_of: Any,
) -> None:
    """Copy a name-keyed optimizer state (``get_optimizer_state_dict`` format) into ``optimizer`` in place.

    Raises:
        ValueError: the param groups do not hold the same parameter names.
    """
    saved_groups = state["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"The checkpoint's optimizer has {len(saved_groups)} param groups, this one {len(optimizer.param_groups)}."
        )
    for group, saved in zip(optimizer.param_groups, saved_groups):
        names = [name_of[id(p)] for p in group["params"]]
        if list(saved["params"]) != names:
            raise ValueError("The checkpoint's optimizer param groups hold other parameters than this optimizer's.")
        for key, value in saved.items():
            if key != "params":
                group[key] = value
    for name, per_param in state["state"].items():
        target = optimizer.state[param_of(name)]
        for key, value in per_param.items():
            current = target.get(key)
            if isinstance(current, Tensor) and isinstance(value, Tensor):
                dst = current._local_tensor if isinstance(current, DTensor) else current
                src = value._local_tensor if isinstance(value, DTensor) else value
                if src.data_ptr() != dst.data_ptr() or src.numel() == 0:
                    dst.copy_(src)
            else:
                target[key] = value


def apply_zero(module: nn.Module, dp_mesh: DeviceMesh, options: ZeroOptions) -> ZeroEngine:
    """Shard ``module`` over ``dp_mesh`` as ``options.stage`` says and return the engine that runs it.

    Stages 1 and 2: :class:`ZeroShardedDataParallel`; stage 3: :class:`~lightning_par.data_parallel.fsdp.FSDPZero`
    (which changes ``module`` in place: FSDP2 ``fully_shard``). The replicas must be equal before the call.
    """
    if options.stage == 3:
        from lightning_par.data_parallel.fsdp import FSDPZero

        return FSDPZero(module, dp_mesh, options)
    return ZeroShardedDataParallel(module, dp_mesh, options)
