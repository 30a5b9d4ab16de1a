"""Validated options of the dp axis: the gradient reducer (``ddp`` and ZeRO-1's all-reduce) and ZeRO sharding.

Each group validates itself when it is built (``__post_init__``), so a strategy constructor, a Hydra schema and a test
that build one raise the same ``ValueError`` before any process group starts.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from lightning_par.data_parallel.compression import COMM_HOOKS, validate_comm_hook
from lightning_par.validation import check_bool, check_choice, check_number

__all__ = [
    "DP_MODES",
    "DTYPE_NAMES",
    "ZERO_GROUP_DEFAULTS",
    "ZERO_STAGES",
    "ReducerOptions",
    "ZeroGroupOptions",
    "ZeroOptions",
    "parse_mixed_precision",
    "resolve_zero_options",
    "zero_dp_mode",
    "zero_stage",
]

#: Data-parallel modes of the dp axis: a bucketed all-reduce of replicated gradients, or a ZeRO stage.
DP_MODES: tuple[str, ...] = ("ddp", "zero1", "zero2", "zero3")

#: The ZeRO stages (Rajbhandari et al., SC'20, §5): 1 = optimizer state (P_os), 2 = + gradients (P_os+g),
#: 3 = + parameters (P_os+g+p).
ZERO_STAGES: tuple[int, ...] = (1, 2, 3)

#: Names accepted for a dtype in ``mixed_precision``.
DTYPE_NAMES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}


def zero_stage(dp_mode: str) -> int:
    """The ZeRO stage of a ``dp_mode`` (0 for ``"ddp"``).

    Raises:
        ValueError: ``dp_mode`` is not one of :data:`DP_MODES`.
    """
    check_choice("dp_mode", dp_mode, DP_MODES)
    return 0 if dp_mode == "ddp" else int(dp_mode[-1])


@dataclass(frozen=True)
class ReducerOptions:
    """The bucketed gradient reducer of the dp axis (``dp_mode="ddp"``; ``"zero1"`` all-reduces with it too).

    These defaults are the only ones: the Hydra schema ``strategy.reducer`` is this class (with ``bucket_cap_mb``
    unset, :class:`lightning_par.config.schema.ReducerGroup`), and
    :class:`~lightning_par.data_parallel.reducer.GradientReducer`, :class:`ZeroOptions` and the strategies take theirs
    from it.

    Attributes:
        bucket_cap_mb: bucket size in MiB of fp32 gradient (torch DDP's default, 25). With ``zero1``/``zero2`` also the
            bucket of the parameter all-gather and of ZeRO-2's reduce-scatter. ``None`` means this default (the Hydra
            schema leaves it at ``None``, unset, because ``zero3`` has no buckets and refuses a value).
        gradient_as_bucket_view: ``.grad`` tensors become views of the buckets: one copy per parameter per step and
            one gradient's memory less (profiled: the copies were about 2% of ``ddp_overlap``'s CPU time per step on
            the small GPT). The default, as in the ZeRO modes; torch's DDP defaults to False.
        static_graph: after the first step, rebuild the buckets in the order gradients arrived (DDP's rebuilding).
        comm_hook: ``"none"``, ``"fp16"``, ``"bf16"`` (cast the wire format) or ``"powersgd"`` (Vogels et al. 2019).
        powersgd_rank: rank of the PowerSGD approximation.
        powersgd_start_iter: optimizer steps with a plain all-reduce before PowerSGD starts.
        broadcast_buffers: before a forward, give every dp replica the module buffers (BatchNorm running statistics)
            of dp rank 0, as torch DDP does by default (:class:`~lightning_par.data_parallel.buffers.BufferSync`);
            in every dp mode, ``zero3`` included. ``False``: each replica keeps its own buffers after the start.

    Raises:
        ValueError: an invalid field (named in the message).
    """

    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    comm_hook: str = "none"
    powersgd_rank: int = 1
    powersgd_start_iter: int = 2
    broadcast_buffers: bool = True

    def __post_init__(self) -> None:
        cap = ReducerOptions.bucket_cap_mb if self.bucket_cap_mb is None else self.bucket_cap_mb
        object.__setattr__(self, "bucket_cap_mb", check_number("bucket_cap_mb", cap, unit="MiB"))
        check_bool("gradient_as_bucket_view", self.gradient_as_bucket_view)
        check_bool("static_graph", self.static_graph)
        check_bool("broadcast_buffers", self.broadcast_buffers)
        validate_comm_hook(self.comm_hook, self.powersgd_rank, self.powersgd_start_iter)

    def reducer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :class:`~lightning_par.data_parallel.reducer.GradientReducer`."""
        return dict(
            bucket_cap_mb=self.bucket_cap_mb,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            static_graph=self.static_graph,
            comm_hook=self.comm_hook,
            powersgd_rank=self.powersgd_rank,
            powersgd_start_iter=self.powersgd_start_iter,
        )


@dataclass(frozen=True)
class ZeroGroupOptions:
    """The ``zero`` option group as a user writes it (``strategy.zero.*``, ``ZeroStrategy(cpu_offload=...)``): the
    declaration of these options and their defaults, and the Hydra schema of ``strategy.zero`` itself. The stage comes
    from the strategy name or ``dp_mode``; the bucket and reducer fields of :class:`ZeroOptions` from the reducer
    group (:func:`resolve_zero_options` joins them).

    Attributes:
        cpu_offload: keep the shards in (pinned) CPU memory and step on the CPU (stage 3; needs an accelerator).
        mixed_precision: ``None`` (full precision), a dtype name (``"bf16"``, ``"fp16"``: parameters and reductions
            in that dtype) or ``{"param_dtype": ..., "reduce_dtype": ...}`` (:func:`parse_mixed_precision`); typed
            ``Any`` because OmegaConf has no union of a string and a mapping.
        reshard_after_forward: stage 3: free each block's gathered parameters after its forward (see
            :class:`ZeroOptions`).

    Raises:
        ValueError: a non-boolean flag or a bad ``mixed_precision`` (named in the message).
    """

    cpu_offload: bool = False
    mixed_precision: Any = None
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        check_bool("cpu_offload", self.cpu_offload)
        parse_mixed_precision(self.mixed_precision)
        check_bool("reshard_after_forward", self.reshard_after_forward)


@dataclass(frozen=True)
class ZeroOptions:
    """What a ZeRO dp axis does, as validated plain values (see :func:`resolve_zero_options` for the checks).

    Attributes:
        stage: 1, 2 or 3.
        cpu_offload: keep the parameter, gradient and optimizer-state shards in (pinned) CPU memory and step on the
            CPU (stage 3, FSDP2's ``CPUOffloadPolicy``; needs an accelerator).
        param_dtype: dtype of the parameters forward and backward compute with (``None``: unchanged). The optimizer
            then steps fp32 master shards (the paper's mixed-precision training, §3.1).
        reduce_dtype: dtype gradients are reduced in (``None``: the parameter dtype).
        reshard_after_forward: stage 3: free each block's gathered parameters after its forward and gather them
            again in backward (True, the paper's stage 3), or keep them until backward (False: one all-gather per
            step, more memory). Not used by stages 1 and 2, whose parameters are never sharded.
        bucket_cap_mb: bucket size in MiB for the gradient all-reduce (stage 1), the reduce-scatter (stage 2) and
            the parameter all-gather (stages 1 and 2). Stage 3 communicates per ``fully_shard`` unit (one block).
        gradient_as_bucket_view, static_graph, comm_hook: the reducer options of stage 1's all-reduce.

    Raises:
        ValueError: an invalid field or combination (see :func:`resolve_zero_options`).
    """

    stage: int
    cpu_offload: bool = ZeroGroupOptions.cpu_offload
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    reshard_after_forward: bool = ZeroGroupOptions.reshard_after_forward
    bucket_cap_mb: float = ReducerOptions.bucket_cap_mb
    gradient_as_bucket_view: bool = ReducerOptions.gradient_as_bucket_view
    static_graph: bool = ReducerOptions.static_graph
    comm_hook: str = ReducerOptions.comm_hook

    def __post_init__(self) -> None:
        _check_zero(self)


#: :class:`ZeroGroupOptions`'s fields and defaults, as a mapping (derived, not a second declaration).
ZERO_GROUP_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(ZeroGroupOptions)}


def _dtype(field: str, value: Any) -> torch.dtype | None:
    if value is None:
        return None
    if isinstance(value, torch.dtype) and value in DTYPE_NAMES.values():
        return value
    if isinstance(value, str) and value.lower() in DTYPE_NAMES:
        return DTYPE_NAMES[value.lower()]
    raise ValueError(f"{field}={value!r} is not valid: expected None or one of {sorted(DTYPE_NAMES)}.")


def parse_mixed_precision(value: Any) -> tuple[torch.dtype | None, torch.dtype | None]:
    """``(param_dtype, reduce_dtype)`` of a ``mixed_precision`` option.

    Args:
        value: ``None`` (full precision), a dtype name (``"bf16"``, ``"fp16"``, ...: parameters and reductions in
            that dtype), or a mapping ``{"param_dtype": ..., "reduce_dtype": ...}`` (either may be omitted or None).

    Raises:
        ValueError: an unknown dtype name or mapping key, or another type.
    """
    if value is None:
        return None, None
    if isinstance(value, (str, torch.dtype)):
        dtype = _dtype("mixed_precision", value)
        return dtype, dtype
    if hasattr(value, "keys"):
        unknown = sorted(set(value.keys()) - {"param_dtype", "reduce_dtype"})
        if unknown:
            raise ValueError(
                f"mixed_precision keys {unknown} are not valid: expected 'param_dtype' and/or 'reduce_dtype'."
            )
        return (
            _dtype("mixed_precision.param_dtype", value.get("param_dtype")),
            _dtype("mixed_precision.reduce_dtype", value.get("reduce_dtype")),
        )
    raise ValueError(
        f"mixed_precision={value!r} is not valid: expected None, a dtype name such as 'bf16', or a dict with "
        f"'param_dtype' and 'reduce_dtype'."
    )


def zero_dp_mode(stage: Any) -> str:
    """The ``dp_mode`` of ZeRO ``stage`` (``"zero1"``, ...).

    Raises:
        ValueError: ``stage`` is not one of :data:`ZERO_STAGES`.
    """
    if isinstance(stage, bool) or stage not in ZERO_STAGES:
        raise ValueError(
            f"stage={stage!r} is not valid: expected one of {list(ZERO_STAGES)} (1: optimizer state, 2: + gradients, "
            f"3: + parameters). For plain data parallelism (stage 0) use strategy='ddp_overlap'."
        )
    return f"zero{stage}"


def _check_zero(o: ZeroOptions) -> None:
    stage = o.stage
    zero_dp_mode(stage)
    check_bool("cpu_offload", o.cpu_offload)
    if o.cpu_offload and stage < 3:
        raise ValueError(
            f"cpu_offload=True is not valid with stage={stage}: offloading the parameter, gradient and optimizer "
            f"shards is implemented for stage 3 only (FSDP2's CPUOffloadPolicy). Use stage=3 or cpu_offload=False."
        )
    _dtype("param_dtype", o.param_dtype)
    _dtype("reduce_dtype", o.reduce_dtype)
    if stage == 1 and o.reduce_dtype is not None and o.reduce_dtype != (o.param_dtype or torch.float32):
        raise ValueError(
            f"mixed_precision reduce_dtype={o.reduce_dtype} is not valid with stage=1 and param_dtype="
            f"{o.param_dtype}: stage 1 all-reduces the gradients in their own dtype (the param dtype). Use stage 2 or "
            f"3 for a separate reduce dtype, or comm_hook='bf16'/'fp16' to compress the wire."
        )
    check_bool("reshard_after_forward", o.reshard_after_forward)
    check_number("bucket_cap_mb", o.bucket_cap_mb, unit="MiB")
    check_bool("gradient_as_bucket_view", o.gradient_as_bucket_view)
    check_bool("static_graph", o.static_graph)
    if o.comm_hook not in COMM_HOOKS:
        raise ValueError(f"comm_hook={o.comm_hook!r} is not valid: expected one of {list(COMM_HOOKS)}.")
    if o.comm_hook != "none" and stage != 1:
        raise ValueError(
            f"comm_hook={o.comm_hook!r} is not valid with stage={stage}: comm hooks compress the all-reduce of stage "
            f"1. For stages 2 and 3 use mixed_precision={{'reduce_dtype': 'bf16'}}."
        )


def resolve_zero_options(
    stage: Any,
    *,
    cpu_offload: Any = ZeroOptions.cpu_offload,
    mixed_precision: Any = ZERO_GROUP_DEFAULTS["mixed_precision"],
    reshard_after_forward: Any = ZeroOptions.reshard_after_forward,
    bucket_cap_mb: Any = None,
    gradient_as_bucket_view: Any = ZeroOptions.gradient_as_bucket_view,
    static_graph: Any = ZeroOptions.static_graph,
    comm_hook: Any = ZeroOptions.comm_hook,
) -> ZeroOptions:
    """Check ZeRO options given as plain values and return them as :class:`ZeroOptions` (``bucket_cap_mb=None``:
    :class:`ReducerOptions`'s default at stages 1 and 2, and the only value stage 3 accepts).

    Raises:
        ValueError: naming the field, the value and what is valid, for: a stage other than 1, 2, 3; ``cpu_offload``
            below stage 3; a bad ``mixed_precision``; stage 1 with a ``reduce_dtype`` other than its
            ``param_dtype`` (stage 1 all-reduces the gradients where they live, with the ``ddp_overlap`` reducer);
            ``bucket_cap_mb`` not a number > 0, or given at stage 3; a ``comm_hook`` that is not one of
            :data:`~lightning_par.data_parallel.compression.COMM_HOOKS`, or not ``"none"`` above stage 1;
            a non-boolean flag.
    """
    param_dtype, reduce_dtype = parse_mixed_precision(mixed_precision)
    if bucket_cap_mb is not None and stage == 3:
        raise ValueError(
            f"bucket_cap_mb={bucket_cap_mb!r} is not valid with stage=3: stage 3 gathers and reduces one "
            f"fully_shard unit (one transformer block) at a time. Leave bucket_cap_mb=None."
        )
    return ZeroOptions(
        stage=stage,
        cpu_offload=cpu_offload,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        reshard_after_forward=reshard_after_forward,
        bucket_cap_mb=ZeroOptions.bucket_cap_mb if bucket_cap_mb is None else bucket_cap_mb,
        gradient_as_bucket_view=gradient_as_bucket_view,
        static_graph=static_graph,
        comm_hook=comm_hook,
    )
