"""The one place that touches torch's private names, gated by the torch version (the register's torch part; Lightning's,
transformers' and torchft's private names are in :mod:`~lightning_par.compat.lightning`,
:mod:`~lightning_par.compat.fabric`, :mod:`~lightning_par.compat.transformers` and :mod:`~lightning_par.compat.torchft`;
tests/compat/test_private_api.py fails on a private name of those libraries used outside this folder).

lightning_par builds on torch's distributed engines where they are public; where a feature is only reachable through
a private name (a DeviceMesh flatten, a DTensor's local shard without a dispatch, the pipelining runtime), that name
is used here and nowhere else, so a torch upgrade that moves it breaks one module with a clear message instead of
seventeen.

Supported: torch ``>= 2.10, < 2.16`` (pyproject.toml; the suite passed on 2.10.0, 2.13.0 and 2.15.0). Each helper
says which private name it wraps and since when torch has it; "present in 2.10" means it exists in every supported
torch but was not traced further back. Where a name moved between versions, both places are tried, newest first.

The multi-tensor kernels torch's own optimizers and gradient scaler call (``torch._foreach_copy_``, ``_foreach_mul_``,
``_foreach_norm``, ``_amp_foreach_non_finite_check_and_unscale_``; public in all but name) are wrapped here too
(:func:`foreach_copy_` ...), and so are a module's copy with tables of its own (:func:`module_copy`), a module's
own tables of parameters and buffers that :mod:`lightning_par.restore` records and puts back in place
(:func:`parameter_table`, :func:`buffer_table`) and the input and output hooks of torch's tensor-parallel styles
(:func:`parallel_style_hooks`). The private methods a subclass of ours overrides or extends
(``DataLoader._index_sampler``, ``ShardedGradScaler._unscale_grads_``, ``ParallelStyle._apply``) only work at their
definition, so they stay in the subclass; each has its entry and canary in :data:`PRIVATE_USES`.
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_par.compat import register as _register

try:  # a public home, should torch give the pytree utilities one
    from torch.utils.pytree import tree_leaves  # type: ignore[import-not-found]
except ImportError:
    from torch.utils._pytree import tree_leaves

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Store
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.placement_types import Placement

__all__ = [
    "FUNCTIONAL_COLLECTIVES",
    "FUNCTIONAL_COLLECTIVES_NAMESPACE",
    "HigherOrderOperator",
    "PRIVATE_NAMES",
    "TORCH_VERSION",
    "TorchDispatchMode",
    "concatenate_meshes",
    "default_store",
    "disable_lightning_signal_handlers",
    "dtensor_spec",
    "fake_store",
    "foreach_copy_",
    "foreach_mul_",
    "foreach_norm",
    "foreach_non_finite_check_and_unscale_",
    "clear_dtensor_sharding_cache",
    "flash_attention_cpu",
    "flash_attention_cpu_backward",
    "flatten_mesh",
    "forget_composable_state",
    "has_composable_state",
    "is_compiled_module",
    "forward_only_schedule",
    "grad_scaler_init_kwargs",
    "grouped_mm",
    "grouped_mm_runs_on_cpu",
    "is_view",
    "local_chunk",
    "local_tensor",
    "module_copy",
    "PARAMETER_TABLE",
    "buffer_table",
    "parameter_table",
    "parallel_style_hooks",
    "multi_device_replicator",
    "op_name",
    "pipeline_stage_meta",
    "profiler_enabled",
    "replicated_tensors",
    "resolve_process_group",
    "stage_to_rank_mapping",
    "strided_shard",
    "tree_leaves",
]


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


#: ``(major, minor)`` of the installed torch.
TORCH_VERSION: tuple[int, int] = _version(torch.__version__)

#: Name of the functional collectives' operator namespace (``torch.ops._c10d_functional``: what DTensor and
#: ``torch.distributed._functional_collectives`` issue; present in 2.10, older torch had ``c10d_functional``).
FUNCTIONAL_COLLECTIVES_NAMESPACE = "_c10d_functional"

#: The functional collectives' operators (``torch.ops._c10d_functional``, e.g. ``.all_reduce``); resolved lazily
#: by torch, so importing this module registers nothing.
FUNCTIONAL_COLLECTIVES: Any = getattr(torch.ops, FUNCTIONAL_COLLECTIVES_NAMESPACE)

# Re-exported as they are, each present in 2.10: ``TorchDispatchMode`` (``torch.utils._python_dispatch``, the base
# of the byte counters), ``tree_leaves`` (``torch.utils._pytree``; ``torch.utils.pytree`` is tried first) and
# ``HigherOrderOperator`` (``torch._ops``: control-flow operators a dispatch mode passes through).


#: Every module-level private name wrapped here, and the modules it is looked up in (newest home first).
PRIVATE_NAMES: dict[str, tuple[str, ...]] = {
    "_StridedShard": ("torch.distributed.tensor.placement_types", "torch.distributed._tensor.placement_types"),
    "_resolve_process_group": ("torch.distributed.distributed_c10d",),
    "_get_default_store": ("torch.distributed.distributed_c10d",),
    "generate_stage_to_rank_mapping": (
        "torch.distributed.pipelining._utils",
        "torch.distributed.pipelining.schedules",
    ),
    "_PipelineScheduleRuntime": ("torch.distributed.pipelining.schedules",),
    "_Action": ("torch.distributed.pipelining.schedules",),
    "FORWARD": ("torch.distributed.pipelining.schedules",),
    "_add_send_recv": ("torch.distributed.pipelining.schedules",),
    "_GeneralMultiDeviceReplicator": ("torch.distributed.fsdp.sharded_grad_scaler",),
    "FakeStore": ("torch.testing._internal.distributed.fake_pg",),
    "_clear_sharding_prop_cache": ("torch.distributed.tensor.debug",),
    "_module_state_mapping": ("torch.distributed._composable_state",),
    "_grouped_mm": ("torch",),
    "_foreach_copy_": ("torch",),
    "_foreach_mul_": ("torch",),
    "_foreach_norm": ("torch",),
    "_amp_foreach_non_finite_check_and_unscale_": ("torch",),
}


#: torch's private methods that classes of ours override (an override only works at the definition, so it stays in
#: the subclass; the entry is its canary). tests/compat/test_private_api.py finds every override of a private method
#: of torch, Lightning, transformers or torchft and requires an entry here or in the library's register module.
PRIVATE_USES: tuple[_register.PrivateName, ...] = tuple(
    _register.PrivateName("torch", owner, name, "attribute", f"torch {torch.__version__.split('+')[0]}", helper)
    for owner, name, helper in (
        ("torch.distributed.tensor.parallel.style.ParallelStyle", "_apply",
         "overrides in lightning_par.tensor_parallel.styles and lightning_par.hf.tensor_parallel (the style contract)"),
        ("torch.distributed.tensor.parallel.style.ColwiseParallel", "_apply",
         "overrides in lightning_par.tensor_parallel.styles.Colwise/VocabParallelHead"),
        ("torch.distributed.tensor.parallel.style.RowwiseParallel", "_apply",
         "an override in lightning_par.tensor_parallel.styles.Rowwise"),
        ("torch.utils.data.dataloader.DataLoader", "_index_sampler",
         "an override in lightning_par.data.resumable.ResumableDataLoader"),
        ("torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler", "_unscale_grads_",
         "an override in lightning_par.precision.DistributedGradScaler"),
    )
)


def _private(name: str) -> Any:
    """``name`` from the first of its :data:`PRIVATE_NAMES` modules that has it (imported on first use).

    Raises:
        RuntimeError: none of them has it (the message names the torch version and the modules tried).
    """
    places = PRIVATE_NAMES[name]
    for module in places:
        try:
            value = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if value is not None:
            return value
    raise RuntimeError(
        f"torch {torch.__version__} has no {name} in {', '.join(places)}: lightning_par needs torch >= 2.10, < 2.16."
    )


# ------------------------------------------------------------------------------------------------ multi-tensor kernels
def foreach_copy_(dsts: list[Tensor], srcs: list[Tensor]) -> None:
    """``dst.copy_(src)`` for each pair in one kernel launch per device and dtype (``torch._foreach_copy_``, present
    in 2.10; what torch's optimizers use)."""
    _private("_foreach_copy_")(dsts, srcs)


def foreach_mul_(tensors: list[Tensor], scalar: Any) -> None:
    """``t.mul_(scalar)`` for each tensor in one launch (``torch._foreach_mul_``, present in 2.10)."""
    _private("_foreach_mul_")(tensors, scalar)


def foreach_norm(tensors: list[Tensor], ord: float = 2.0) -> list[Tensor]:  # noqa: A002 - torch's keyword
    """Each tensor's ``ord``-norm, a 0-dim tensor each, in one launch (``torch._foreach_norm``, present in 2.10; what
    ``clip_grad_norm_`` uses)."""
    return _private("_foreach_norm")(tensors, ord)


def foreach_non_finite_check_and_unscale_(grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    """Multiply each gradient by ``inv_scale`` in place and set ``found_inf`` to 1 if any is not finite
    (``torch._amp_foreach_non_finite_check_and_unscale_``, present in 2.10; the gradient scalers' kernel)."""
    _private("_amp_foreach_non_finite_check_and_unscale_")(grads, found_inf, inv_scale)


# ------------------------------------------------------------------------------------------------ grouped matmul
def grouped_mm(mat_a: Tensor, mat_b: Tensor, offs: Tensor) -> Tensor:
    """``torch._grouped_mm(mat_a, mat_b, offs=offs)``: one matmul per group of rows (2-d x 3-d), or per group of the
    reduced dimension (2-d x 2-d -> 3-d), the groups ending at ``offs`` (int32). Private ``torch._grouped_mm``; its
    CUDA kernels and autograd exist in every supported torch, its CPU forward (ATen's ``_grouped_mm_fallback``, no
    backward) in 2.13 at least (:func:`grouped_mm_runs_on_cpu` checks)."""
    return _private("_grouped_mm")(mat_a, mat_b, offs=offs)


def has_grouped_mm() -> bool:
    """Whether this torch has ``torch._grouped_mm`` at all."""
    return hasattr(torch, "_grouped_mm")


@functools.cache
def grouped_mm_runs_on_cpu() -> bool:
    """Whether :func:`grouped_mm` computes on CPU tensors in this torch (both forms, tried once on a 2 x 4 probe)."""
    try:
        a, b, offs = torch.ones(2, 4), torch.ones(1, 4, 4), torch.tensor([2], dtype=torch.int32)
        rows = grouped_mm(a, b, offs)  # (2, 4)
        return bool(rows.eq(4).all()) and grouped_mm(a.t(), torch.ones(2, 4), offs).shape == (1, 4, 4)
    except (RuntimeError, NotImplementedError):
        return False


# ------------------------------------------------------------------------------------------------ tensors, DTensor
def local_tensor(t: Tensor) -> Tensor:
    """The tensor this rank holds: a ``DTensor``'s local shard, or ``t`` itself for a plain tensor.

    Wraps ``DTensor._local_tensor`` (since DTensor's first release, torch 2.0): no dispatch, and autograd sees the
    shard's own data. Should a torch lack it, a DTensor falls back to the public ``to_local()``.
    """
    local = getattr(t, "_local_tensor", None)
    if local is not None:
        return local
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def dtensor_spec(t: Tensor) -> Any:
    """A ``DTensor``'s sharding spec (``DTensor._spec``, a ``DTensorSpec``: ``mesh``, ``placements``,
    ``num_shards_map``, ...; since torch 2.0)."""
    return t._spec  # type: ignore[attr-defined]


def strided_shard(dim: int, split_factor: int) -> Placement:
    """The placement FSDP2 gives dim ``dim`` of a parameter that tensor parallelism already split ``split_factor``
    ways (``_StridedShard``, present in 2.10, in ``torch.distributed.tensor.placement_types``; tried too in
    ``torch.distributed._tensor.placement_types``, DTensor's home before torch 2.5 made it public).

    Raises:
        RuntimeError: the installed torch has no ``_StridedShard``.
    """
    return _private("_StridedShard")(dim, split_factor=split_factor)


def local_chunk(t: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offsets, sizes)`` of the block of the global tensor that this rank holds: for a ``DTensor`` from its
    ``__create_chunk_list__`` (the dunder DCP plans reads with; one chunk per rank since torch 2.2), for a plain
    tensor the whole of it (zero offsets, its shape)."""
    create = getattr(t, "__create_chunk_list__", None)
    if create is None:
        return (0,) * t.dim(), tuple(t.shape)
    chunks = create()
    if len(chunks) != 1:
        raise RuntimeError(f"torch {torch.__version__} gives {len(chunks)} local chunks for a DTensor; expected 1.")
    return tuple(int(o) for o in chunks[0].offsets), tuple(int(s) for s in chunks[0].sizes)


def is_view(t: Tensor) -> bool:
    """Whether ``t`` is a view of another tensor's storage (``Tensor._base is not None``; since torch 1.x)."""
    return t._base is not None


# ------------------------------------------------------------------------------------------------ meshes, groups
def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """A 1-D mesh over the ranks of ``mesh`` (a sub-mesh of one or more axes), registered on the root mesh under
    ``name`` so that ``root[name]`` and ``root[(..., name)]`` find it (``DeviceMesh._flatten``, torch >= 2.5).

    Raises:
        RuntimeError: the installed torch has no ``DeviceMesh._flatten``.
    """
    flatten = getattr(mesh, "_flatten", None)
    if flatten is None:
        raise RuntimeError(f"torch {torch.__version__} has no DeviceMesh._flatten: lightning_par needs torch >= 2.10.")
    return flatten(name)


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh whose axes are those of ``meshes`` in order (sub-meshes of one root), as FSDP2 builds for FSDP + TP
    state (``DeviceMesh._concatenate``: absent in torch 2.7.1, present in 2.10).

    Raises:
        RuntimeError: the installed torch has no ``DeviceMesh._concatenate``.
    """
    from torch.distributed.device_mesh import DeviceMesh

    concatenate = getattr(DeviceMesh, "_concatenate", None)
    if concatenate is None:
        raise RuntimeError(
            f"torch {torch.__version__} has no DeviceMesh._concatenate: lightning_par needs torch >= 2.10."
        )
    return concatenate(meshes)


def is_compiled_module(module: Any) -> bool:
    """Whether ``module`` is what ``torch.compile`` returns for a module (``torch._dynamo.eval_frame.OptimizedModule``,
    present in 2.10; the compiled module's own is at ``._orig_mod``). Looked up only if dynamo is imported: without it
    nothing can have been compiled."""
    import sys

    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None) if eval_frame is not None else None
    return optimized is not None and isinstance(module, optimized)


def module_copy(module: torch.nn.Module, *, parameters: bool = True) -> torch.nn.Module:
    """A shallow copy of ``module`` (same class and attributes) with an empty table of children of its own, to fill
    with ``add_module``; ``parameters=False``: an empty table of parameters of its own too (``register_parameter``) and
    its own copy of the table of buffers. ``copy.copy`` alone shares the tables with ``module``: they are
    ``nn.Module``'s instance dicts ``_modules``, ``_parameters`` and ``_buffers`` (present in 2.10; a canary in
    tests/compat/test_compat.py)."""
    import copy
    from collections import OrderedDict

    out = copy.copy(module)
    out._modules = OrderedDict()
    if not parameters:
        out._parameters = OrderedDict()
        out._buffers = OrderedDict(module._buffers)
    return out


#: The key of a module's own table of parameters in its ``__dict__`` (``nn.Module._parameters``, present in 2.10): what
#: :func:`parameter_table` returns.
PARAMETER_TABLE = "_parameters"


def parameter_table(module: torch.nn.Module) -> dict[str, Any]:
    """``module``'s own table of parameters, name -> ``nn.Parameter`` or ``None`` (``nn.Module._parameters``, an
    ``OrderedDict``, present in 2.10), itself, not a copy: editing it edits the module. Unlike
    ``named_parameters(recurse=False)`` it keeps ``None`` entries (a parameter slot set to ``None``, as
    ``nn.Linear(bias=False)`` has) and can hold one without unregistering the name, and assigning into it skips
    ``register_parameter``'s checks (as :mod:`lightning_par.restore` needs when it puts a tree back)."""
    return module.__dict__[PARAMETER_TABLE]


def buffer_table(module: torch.nn.Module) -> dict[str, Any]:
    """``module``'s own table of buffers, name -> tensor or ``None`` (``nn.Module._buffers``, present in 2.10), itself
    (see :func:`parameter_table`)."""
    return module._buffers


def parallel_style_hooks(style: Any) -> tuple[Any, Any]:
    """``(input_fn, output_fn)`` of a torch tensor-parallel style (``ColwiseParallel``, ``RowwiseParallel`` and their
    subclasses) for ``distribute_module(module, mesh, partition_fn, input_fn, output_fn)``, exactly as the style's own
    ``_apply`` passes them: its ``_prepare_input_fn`` given ``input_layouts`` and ``desired_input_layouts``, its
    ``_prepare_output_fn`` given ``output_layouts`` and ``use_local_output`` (private static methods, present in
    2.10; a canary in tests/compat/test_compat.py).

    Raises:
        RuntimeError: the installed torch's style has no such methods.
    """
    prepare_input = getattr(style, "_prepare_input_fn", None)
    prepare_output = getattr(style, "_prepare_output_fn", None)
    if prepare_input is None or prepare_output is None:
        raise RuntimeError(
            f"torch {torch.__version__}'s {type(style).__name__} has no _prepare_input_fn/_prepare_output_fn: "
            f"lightning_par needs torch >= 2.10, < 2.16."
        )
    return (
        functools.partial(prepare_input, style.input_layouts, style.desired_input_layouts),
        functools.partial(prepare_output, style.output_layouts, style.use_local_output),
    )


def has_composable_state(module: Any) -> bool:
    """Whether a composable API (FSDP2's ``fully_shard``) registered its state for ``module`` in torch's table of
    module states (``torch.distributed._composable_state._module_state_mapping``, present in 2.10)."""
    return module in _private("_module_state_mapping")


def forget_composable_state(module: Any) -> None:
    """Drop ``module`` from torch's table of composable module states (see :func:`has_composable_state`), once its
    FSDP2 class and hooks are undone: ``fully_shard`` refuses a module already in the table."""
    _private("_module_state_mapping").pop(module, None)


def resolve_process_group(group_name: str) -> ProcessGroup:
    """The process group registered under ``group_name`` (the name functional collectives carry;
    ``torch.distributed.distributed_c10d._resolve_process_group``, present in 2.10).

    Raises:
        RuntimeError: the installed torch has no ``_resolve_process_group``.
        ValueError: (from torch) no group has that name.
    """
    return _private("_resolve_process_group")(group_name)


def default_store() -> Store:
    """The key-value store of the default process group (``torch.distributed.distributed_c10d._get_default_store``,
    since torch 1.x).

    Raises:
        RuntimeError: the default process group is not initialised (from torch), or the function is missing.
    """
    return _private("_get_default_store")()


def fake_store() -> Store:
    """A store for ``init_process_group("fake", store=..., rank=r, world_size=n)``: one process acting as rank ``r``
    of an ``n``-rank world whose collectives move no data (``torch.testing._internal.distributed.fake_pg.FakeStore``;
    importing that module registers the ``"fake"`` backend; present in 2.10). For dry runs of :func:`~lightning_par.
    parallelize.parallelize` at any world size (:mod:`lightning_par.planner.dry_run`).

    Raises:
        RuntimeError: the installed torch has no ``FakeStore``.
    """
    return _private("FakeStore")()


def clear_dtensor_sharding_cache() -> None:
    """Forget DTensor's cached sharding propagations (Python and C++ fast path;
    ``torch.distributed.tensor.debug._clear_sharding_prop_cache``, present in 2.13).

    The cache is keyed by specs whose meshes compare equal across process groups of the same shape, and its results
    carry the mesh they were computed on, with that mesh's process-group names: after a process group is destroyed
    (a dry run's fake world), a later group of the same shape in this process or a forked child would redistribute
    over the old, unregistered names ("Could not resolve the process group registered under the name ...").

    Raises:
        RuntimeError: the installed torch has no ``_clear_sharding_prop_cache``.
    """
    _private("_clear_sharding_prop_cache")()


# ------------------------------------------------------------------------------------------------ dispatcher
def op_name(func: Any) -> str:
    """An operator's name without namespace or overload, e.g. ``"allreduce_"`` for ``torch.ops.c10d.allreduce_.default``
    (``OpOverload._opname``, present in 2.10; otherwise parsed from ``str(func)``, ``"c10d.allreduce_.default"``)."""
    name = getattr(func, "_opname", None)
    return name if name is not None else str(func).split(".")[1]


def profiler_enabled() -> bool:
    """Whether a ``torch.profiler`` is recording (``torch._C._autograd._profiler_enabled``, since torch 1.x: a cheap
    check, unlike entering ``record_function`` unconditionally)."""
    return bool(torch._C._autograd._profiler_enabled())


# ------------------------------------------------------------------------------------------------ attention kernels
def flash_attention_cpu(
    q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float | None
) -> tuple[Tensor, Tensor]:
    """``(out, logsumexp)`` of the CPU fused attention kernel behind ``F.scaled_dot_product_attention``
    (``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu``, present in 2.10): ``out`` in ``q``'s dtype,
    ``logsumexp`` ``(batch, heads, seq_q)`` in float32 (float64 for float64 inputs). No dropout, no mask; with
    ``is_causal`` query ``i`` sees keys ``<= i``. Keeps no ``seq_q x seq_k`` tensor."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)


def flash_attention_cpu_backward(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, is_causal: bool, scale: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    """``(grad_q, grad_k, grad_v)`` of :func:`flash_attention_cpu` from its ``out`` and ``lse``
    (``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward``, present in 2.10). Given the ``out``
    and ``lse`` of a whole row (all key blocks merged), it returns one key block's share of the gradients, as
    FlashAttention's backward does per block."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, lse, 0.0, is_causal, scale=scale
    )


# ------------------------------------------------------------------------------------------------ pipelining
def stage_to_rank_mapping(pp_size: int, num_stages: int, style: str = "loop") -> dict[int, int]:
    """Stage index -> pipeline rank for ``num_stages`` stages on ``pp_size`` ranks, ``style`` ``"loop"`` or ``"v"``
    (``generate_stage_to_rank_mapping``: ``torch.distributed.pipelining._utils``, present in 2.10; also tried in
    ``torch.distributed.pipelining.schedules``).

    Raises:
        RuntimeError: the installed torch has neither.
    """
    return _private("generate_stage_to_rank_mapping")(pp_size, num_stages, style=style)


def forward_only_schedule(stages: list[Any], num_microbatches: int, stage_to_rank: dict[int, int]) -> Any:
    """A schedule that runs, on every rank, each of its stages' forwards for every micro-batch in turn (stage by
    stage, lowest index first), with the sends and receives between them, on torch's action runtime.

    Wraps ``torch.distributed.pipelining.schedules``' ``_PipelineScheduleRuntime``, ``_Action``, ``FORWARD`` and
    ``_add_send_recv`` (present in 2.10): no public multi-stage schedule runs forward only in an arbitrary stage
    placement.

    Args:
        stages: this rank's ``PipelineStage`` objects.
        num_microbatches: micro-batches per step.
        stage_to_rank: every stage's pipeline rank (:func:`stage_to_rank_mapping`).

    Returns:
        The schedule (``step(...)`` as any torch pipeline schedule).

    Raises:
        RuntimeError: the installed torch lacks one of the names.
    """
    runtime, action, forward, add_send_recv = (
        _private(n) for n in ("_PipelineScheduleRuntime", "_Action", "FORWARD", "_add_send_recv")
    )
    num_stages = len(stage_to_rank)
    order = {
        rank: [
            action(s, forward, i)
            for s in sorted(k for k, r in stage_to_rank.items() if r == rank)
            for i in range(num_microbatches)
        ]
        for rank in sorted(set(stage_to_rank.values()))
    }
    schedule = runtime(stages=stages, n_microbatches=num_microbatches, loss_fn=None, scale_grads=False)
    schedule.stage_index_to_group_rank = stage_to_rank
    for stage in stages:
        stage.stage_index_to_group_rank = stage_to_rank
    schedule.pipeline_order = order
    schedule.pipeline_order_with_comms = add_send_recv(
        {r: list(a) for r, a in order.items()}, stage_to_rank=lambda s: stage_to_rank[s], num_stages=num_stages
    )
    return schedule


def pipeline_stage_meta(stage: Any) -> Any:
    """The metadata a ``PipelineStage`` inferred on its first step (``_stage_meta``, present in 2.10: ``.outputs``
    holds a ``TensorMeta`` per output), or ``None`` before that or on a torch without it."""
    return getattr(stage, "_stage_meta", None)


def keep_buffers_through_metadata_inference(stage: Any) -> None:
    """Make ``stage``'s metadata inference leave its module's buffers as they were.

    A ``PipelineStage`` infers its tensor metadata on its first step by running its module's forward once more, in
    the module's mode (training), on the first micro-batch (stage 0) or on uninitialised tensors made from the
    received metadata (the later stages): a BatchNorm would count one batch too many on stage 0 and take NaN running
    statistics on the others (measured on 2.13). Wraps the instance's ``_forward_metadata_inference`` (2.13;
    ``_shape_inference`` in 2.10) to put every buffer back afterwards; a torch with neither is left alone.
    """
    for name in ("_forward_metadata_inference", "_shape_inference"):
        method = getattr(stage, name, None)
        if callable(method):
            break
    else:
        return

    def restoring(*args: Any, **kwargs: Any) -> Any:
        saved = [
            (module, name, buffer.detach().clone())
            for module in stage.submod.modules()
            for name, buffer in module.named_buffers(recurse=False)
        ]
        try:
            return method(*args, **kwargs)
        finally:
            # Rebind rather than copy in place: the inference's graph saved the buffers (BatchNorm's running
            # statistics), and torch's backward metadata inference runs backward through that graph next.
            for module, name, value in saved:
                setattr(module, name, value)

    setattr(stage, name, restoring)


# ------------------------------------------------------------------------------------------------ gradient scaling
def multi_device_replicator(master: Tensor) -> Any:
    """A lazy per-device copy of ``master`` that also takes CPU tensors, as ``ShardedGradScaler`` uses
    (``torch.distributed.fsdp.sharded_grad_scaler._GeneralMultiDeviceReplicator``, present in 2.10):
    ``.get(device)`` returns (making on first use) ``master`` on ``device``; :func:`replicated_tensors` lists them."""
    return _private("_GeneralMultiDeviceReplicator")(master)


def replicated_tensors(replicator: Any) -> dict[torch.device, Tensor]:
    """The copies a :func:`multi_device_replicator` made, by device (its ``_per_device_tensors``): the mapping a
    gradient scaler's ``_unscale_grads_`` returns (present in 2.10)."""
    return replicator._per_device_tensors


def grad_scaler_init_kwargs(scaler: Any) -> dict[str, Any]:
    """``device`` and ``init_scale`` a ``torch.amp.GradScaler`` was built with (its ``_device`` and ``_init_scale``,
    present in 2.10; ``"cuda"`` and ``2**16``, torch's defaults, where missing), as keyword arguments for another."""
    return {"device": getattr(scaler, "_device", "cuda"), "init_scale": getattr(scaler, "_init_scale", 2.0**16)}


def disable_lightning_signal_handlers(trainer: Any) -> None:
    """Stop ``trainer`` from installing Lightning's SIGTERM/SIGUSR1 handlers when ``fit`` starts.

    Lightning's ``_SignalConnector`` (lightning 2.5-2.6, ``Trainer._signal_connector``) handles SIGTERM by
    broadcasting from inside the handler, on the signalled rank only: a collective the other ranks never join.
    :class:`lightning_par.fault.preemption.PreemptionCallback` handles the signal instead. Call before ``fit`` runs
    its stage (a callback's ``setup`` hook is early enough). Does nothing if the trainer has no such connector.
    """
    connector = getattr(trainer, "_signal_connector", None)
    if connector is not None and hasattr(connector, "register_signal_handlers"):
        connector.register_signal_handlers = lambda: None


# ----------------------------------------------------------------- moved here from their users (one register, issue 46)
# Each present in torch 2.10 and checked on 2.13.0 (the lock); tests/compat/test_compat.py resolves every one.
from torch.overrides import _get_current_function_mode_stack as current_function_mode_stack  # noqa: E402
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten  # noqa: E402

__all__ += [
    "MuonReference",
    "compile_caches_off",
    "current_function_mode_stack",
    "dcp_metadata_path",
    "dcp_set_element",
    "dcp_storage_info_class",
    "dynamo_backends",
    "dynamo_config",
    "dynamo_counters",
    "muon_reference",
    "privateuse1_backend_name",
    "serialization_get_layout",
    "tree_flatten",
    "tree_map_only",
    "tree_unflatten",
]


def privateuse1_backend_name() -> str:
    """The name the out-of-tree ``PrivateUse1`` device registered under (``torch._C._get_privateuse1_backend_name``;
    ``"privateuseone"`` when none did)."""
    return torch._C._get_privateuse1_backend_name()


def dynamo_backends(**kwargs: Any) -> list[str]:
    """``torch._dynamo.list_backends(**kwargs)``: the backend names ``torch.compile`` accepts."""
    import torch._dynamo

    return torch._dynamo.list_backends(**kwargs)


def dynamo_counters() -> Any:
    """Dynamo's process-wide counters (``torch._dynamo.utils.counters``: ``frames``, ``stats``, ``graph_break``...)."""
    from torch._dynamo.utils import counters

    return counters


def dynamo_config() -> Any:
    """Dynamo's settings module (``torch._dynamo.config``, e.g. ``recompile_limit``)."""
    import torch._dynamo.config

    return torch._dynamo.config


def compile_caches_off() -> None:
    """Turn off inductor's FX graph cache and AOTAutograd's cache for this process (``torch._inductor.config``,
    ``torch._functorch.config``), so that every compile is timed from scratch."""
    import torch._functorch.config
    import torch._inductor.config

    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False


class MuonReference:
    """torch's Muon internals (``torch.optim._muon``, torch >= 2.9): the Newton-Schulz coefficients ``a, b, c``,
    ``ns_steps``, ``eps`` and ``zeropower`` (``_zeropower_via_newtonschulz(grad, ns_coefficients, ns_steps, eps)``)."""

    def __init__(self) -> None:
        module = importlib.import_module("torch.optim._muon")
        self.a, self.b, self.c = module.DEFAULT_A, module.DEFAULT_B, module.DEFAULT_C
        self.ns_steps, self.eps = module.DEFAULT_NS_STEPS, module.EPS
        self.zeropower = module._zeropower_via_newtonschulz


def muon_reference() -> MuonReference:
    """torch's Muon internals (:class:`MuonReference`).

    Raises:
        ImportError: a torch without ``torch.optim._muon``.
    """
    return MuonReference()


def serialization_get_layout() -> Any:
    """``torch.serialization._get_layout``: what a pickled ``torch.layout`` is rebuilt with."""
    from torch.serialization import _get_layout

    return _get_layout


def dcp_storage_info_class() -> type:
    """DCP's ``torch.distributed.checkpoint.filesystem._StorageInfo`` (pickled into a checkpoint's ``.metadata``)."""
    import torch.distributed.checkpoint.filesystem as filesystem

    return filesystem._StorageInfo


def dcp_set_element(root: Any, path: Any, value: Any) -> None:
    """DCP's own ``_traverse.set_element``, as its default load planner uses it to place a loaded value."""
    from torch.distributed.checkpoint._traverse import set_element

    set_element(root, path, value)


def dcp_metadata_path(reader: Any, rank: int | None) -> Any:
    """The ``.metadata`` path a ``FileSystemReader`` reads (its ``_get_metadata_path(rank)``)."""
    return reader._get_metadata_path(rank)
