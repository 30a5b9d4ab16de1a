"""The ep axis in the registry: its checks, its step in ``parallelize()`` and what it adds to a run."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from lightning_par import contract
from lightning_par.axis_registry import Axis, Build
from lightning_par.compile import refuse_fullgraph
from lightning_par.compat import local_tensor
from lightning_par.data_parallel.meshes import DataParallelMeshes
from lightning_par.expert_parallel.dispatch import ExpertDispatch
from lightning_par.expert_parallel.metrics import MoEFigures
from lightning_par.expert_parallel.planner import EXPERT_PARALLEL_TERMS, check_num_experts
from lightning_par.parallel_dims import ParallelDims

__all__ = ["EXPERT_PARALLEL"]


def _check(module: nn.Module, network: nn.Module, dims: ParallelDims, options: Any) -> None:
    if not dims.ep_enabled:
        return
    contract.check_not_compiled(module, f"expert parallelism (ep_size={dims.ep_size})",
                                "splits the experts modules named by their paths and exchanges tokens around them")
    refuse_fullgraph(options, f"ep_size={dims.ep_size}", "the expert all-to-all's split sizes are counted from the "
                     "routing inside each MoE block (lightning_par/expert_parallel/dispatch.py runs it eagerly)")
    for path in contract.expert_modules(network):
        check_num_experts(path, contract.num_experts(network, path), dims.ep_size, dims.size("dp_shard_cp"))


def _read(build: Build) -> None:
    """The experts of the whole network, before any pipeline cut (also at ``ep_size == 1`` when the network names
    them: its MoE figures are logged)."""
    if build.dims.ep_enabled:
        build.expert_paths = contract.expert_modules(build.network)
    elif callable(getattr(build.network, "expert_modules", None)):
        build.expert_paths = list(build.network.expert_modules()) or None


@torch.no_grad()
def _shard_experts(module: nn.Module, mesh: Any, rank: int, size: int) -> None:
    """Keep this ep rank's experts: every parameter's rows ``rank E/ep ... (rank+1) E/ep - 1`` as a DTensor ``Shard(0)``
    of the whole ``(E, ...)`` tensor over the ep mesh."""
    for name, param in list(module.named_parameters(recurse=False)):
        local = param.detach().chunk(size)[rank].clone()
        sharded = DTensor.from_local(local, mesh, (Shard(0),), run_check=False, shape=param.shape,
                                     stride=param.stride())
        module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def _balance_by_bias(build: Build) -> None:
    """After every optimizer step, DeepSeek-V3's bias update of each MoE layer with ``balance`` ``bias``/``both`` (the
    GPT's, :func:`lightning_par.models.moe.update_expert_bias`) and of each Hugging Face router whose bias
    :func:`lightning_par.hf.experts.balance_by_bias` enabled, their loads summed over ``dp_cp`` (the ranks holding other
    tokens; tp ranks route the same tokens, pp ranks hold other layers) in one all-reduce, so that every replica keeps
    the same bias."""
    from lightning_par.expert_parallel.balance import update_selection_biases
    from lightning_par.hf.experts import selection_bias_entry
    from lightning_par.models.moe import MoE

    assert build.network is not None
    entries = []  # (module, how to read its (load, bias, rate) at update time: buffers may be replaced by .to())
    for m in build.network.modules():
        if isinstance(m, MoE) and m.router.expert_bias is not None:
            entries.append(lambda m=m: (m.routed_load, m.router.expert_bias, m.bias_update_rate))
        elif selection_bias_entry(m) is not None:  # a Hugging Face router's bias (hf.experts.balance_by_bias)
            entries.append(lambda m=m: selection_bias_entry(m))
    if not entries or not build.training:
        return
    dims = build.dims
    group = dims.get_mesh("dp_cp").get_group() if dims.size("dp_cp") > 1 else None
    build.optimizer_step_hooks.append(lambda: update_selection_biases([read() for read in entries], group))


def _apply(build: Build) -> None:
    """Split each experts module's experts over the ep ranks, exchange tokens around it, and reduce its gradients over
    the ranks holding the same experts (``edp``)."""
    dims = build.dims
    _balance_by_bias(build)  # also without expert paths: a Hugging Face router's bias at ep_size == 1
    if build.expert_paths is None:
        return
    network = build.network
    assert network is not None
    figures = MoEFigures(network)
    build.step_logs.append(figures.step)
    build.summaries.append(figures.summary)
    if not dims.ep_enabled:
        return
    ep_mesh, edp_shard, replicate, fsdp = dims.expert_meshes()
    assert build.network is not None
    group, rank = ep_mesh.get_group(), ep_mesh.get_local_rank()
    modules, dispatchers = [], []
    for path in build.expert_paths:
        try:
            experts = build.network.get_submodule(path)
        except AttributeError:  # on another pipeline stage
            continue
        _shard_experts(experts, ep_mesh, rank, dims.ep_size)
        dispatch = ExpertDispatch(group, dims.ep_size)
        dispatch.attach(experts)
        modules.append(experts)
        dispatchers.append(dispatch)
    edp = dims.get_mesh("edp")
    build.dp_groups.append((modules, DataParallelMeshes(dp=edp, shard=edp_shard, replicate=replicate, fsdp=fsdp)))

    def step_log() -> dict[str, float]:
        sent = sum(d.bytes_sent for d in dispatchers)
        for d in dispatchers:
            d.reset_bytes()
        return {"ep_all_to_all_bytes": float(2 * sent)}  # backward repeats each exchange reversed

    build.step_logs.append(step_log)
    def local_bytes() -> int:
        return sum(local_tensor(p).numel() * p.element_size() for m in modules for p in m.parameters())

    build.summaries.append(lambda: {
        "ep_size": dims.ep_size,
        "expert_param_bytes_per_rank": local_bytes(),
        "experts_per_rank": {p: contract.num_experts(build.network, p) // dims.ep_size
                             for p in build.expert_paths or () if _has(build.network, p)},
    })


def _has(network: nn.Module, path: str) -> bool:
    try:
        network.get_submodule(path)
    except AttributeError:
        return False
    return True


def _refused_callbacks(dims: Any, options: Any) -> dict[str, str]:
    """Weight averaging: the experts are DTensor shards, which an averaged copy of whole tensors refuses."""
    return {"weight_averaging": f"ep_size={dims.ep_size}"} if dims.ep_size > 1 else {}


#: Expert parallelism: each mixture-of-experts layer's experts split over ep ranks borrowed from ``dp_shard x cp``.
EXPERT_PARALLEL = Axis(
    name="ep",
    size_fields=("ep_size",),
    option_groups=(),
    check=_check,
    steps=(("read", _read), ("context", _apply)),
    planner=EXPERT_PARALLEL_TERMS,
    refused_callbacks=_refused_callbacks,
)
