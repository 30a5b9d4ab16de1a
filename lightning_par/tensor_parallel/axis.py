"""The tp axis in the registry: its checks, its step in ``parallelize()`` and what it adds to a run."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_par import contract
from lightning_par.axis_registry import Axis, Build
from lightning_par.memory import model_state_bytes
from lightning_par.parallel_dims import ParallelDims
from lightning_par.tensor_parallel.apply import apply_tensor_parallel, reduce_partial_grads
from lightning_par.tensor_parallel.local_heads import local_heads_hint, split_modules
from lightning_par.tensor_parallel.plan import expand_plan, uses_vocab_parallel_loss, validate_plan
from lightning_par.tensor_parallel.planner import TENSOR_PARALLEL_TERMS
from lightning_par.tensor_parallel.state_dict import padded_parameters, unpad_vocab_state
from lightning_par.tensor_parallel.styles import sync_tp_partial_grads
from lightning_par.tensor_parallel.vocab import VOCAB_SIZE_ATTR, vocab_parallel_loss

__all__ = ["TENSOR_PARALLEL"]


def _check(module: nn.Module, network: nn.Module, dims: ParallelDims, options: Any) -> None:
    if not dims.tp_enabled:
        return
    contract.check_not_compiled(module, f"tensor parallelism (tp_size={dims.tp_size})",
                                "splits the modules its plan names by their paths")
    tp = options.tensor_parallel
    plan = contract.tp_plan(module, network, tp.plan)
    contract.check_tensor_parallel(network, dims.tp_size, tp.sequence_parallel, plan=plan)
    validate_plan(network, plan, dims.tp_size, tp.sequence_parallel)


def _read_plan(build: Build) -> None:
    """The plan of the whole network, before any pipeline cut: a model's ``tp_plan()`` may read its own structure."""
    if build.dims.tp_enabled:
        build.plan = contract.tp_plan(build.module, build.network, build.options.tensor_parallel.plan)


def _split(build: Build) -> None:
    """Megatron-LM's split of this rank's layers over the tp mesh, and what the run needs from it afterwards."""
    if build.plan is None:
        return
    dims, module, network = build.dims, build.module, build.network
    assert network is not None
    pipelined = dims.pp_enabled
    apply_tensor_parallel(
        network, dims.get_mesh("tp"), build.plan, build.options.tensor_parallel.sequence_parallel,
        skip_absent=pipelined, eager_grad_reduction=not pipelined,
    )
    if uses_vocab_parallel_loss(build.plan):
        build.loss_context = vocab_parallel_loss
    # A shape error from a split module (a reshape by the model's whole head count) names the local heads.
    split = split_modules(network, expand_plan(network, build.plan, skip_absent=pipelined))
    build.step_contexts.append(lambda: local_heads_hint(split, dims.tp_size))
    if pipelined:  # partial gradients of a user's DTensor SequenceParallel: once after the schedule
        build.after_schedule.append(lambda: reduce_partial_grads(network))
    if pipelined and build.options.tensor_parallel.sequence_parallel:
        # a stage that rebuilds the whole sequence's positions from its input (a Hugging Face model's stage) reads
        # how many ranks hold a share of it
        for part in (network, *(build.stage_modules or ())):
            for stage in part.modules():
                if isinstance(getattr(stage, "sequence_shards", None), int):
                    stage.sequence_shards = dims.tp_size
    tp_group = dims.group("tp")
    # Replicated parameters' partial gradients (sequence-parallel norms): summed once per optimizer step, after the
    # dp reduction (on the dp engine's local shards under ZeRO-1/2).
    build.finishers.append(lambda: sync_tp_partial_grads(module, tp_group, build.engine))
    build.state_transforms.append(lambda model, optimizers: unpad_vocab_state(module, model, optimizers))

    def cut_full(state: dict[str, Any]) -> None:
        for name, vocab in padded_parameters(module).items():
            if name in state:
                state[name] = state[name][:vocab].clone()

    build.full_state_transforms.append(cut_full)

    def summary() -> dict[str, Any]:
        out: dict[str, Any] = {"param_bytes_per_rank": model_state_bytes(module)["param_bytes"]}
        padded = {
            name: f"{getattr(m, VOCAB_SIZE_ATTR)} -> {m.weight.shape[0]}"
            for name, m in module.named_modules()
            if getattr(m, VOCAB_SIZE_ATTR, None) is not None and m.weight.shape[0] != getattr(m, VOCAB_SIZE_ATTR)
        }
        if padded:
            out["vocab_padding"] = padded
        return out

    build.summaries.append(summary)


def _refused_callbacks(dims: Any, options: Any) -> dict[str, str]:
    """Weight averaging and pruning: parameters are DTensor shards, which an averaged copy of whole tensors and a
    pruning mask's in-place update refuse."""
    return dict.fromkeys(("weight_averaging", "pruning"), f"tp_size={dims.tp_size}") if dims.tp_size > 1 else {}


#: Megatron-style tensor parallelism inside each pipeline stage (DTensor styles from the model's plan).
TENSOR_PARALLEL = Axis(
    name="tp",
    size_fields=("tp_size",),
    option_groups=("tensor_parallel",),
    check=_check,
    steps=(("read", _read_plan), ("split", _split)),
    planner=TENSOR_PARALLEL_TERMS,
    refused_callbacks=_refused_callbacks,
)
