"""``plan()``: every valid layout of a model on N devices, with predicted memory and step time, best first.

Pure Python: no torch import, no processes (``device="cpu"`` reads the calibration file written by
:func:`lightning_par.planner.calibrate.calibrate_cpu`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_par.planner.devices import DeviceSpec, get_device
from lightning_par.planner.layouts import axis_choices as axis_choice_defaults
from lightning_par.planner.layouts import (
    AXIS_OPTIONS,
    CHECKPOINTING,
    DP_MODES,
    Layout,
    check_layout,
    enumerate_layouts,
    size_fields,
)
from lightning_par.planner.memory import MemoryBreakdown, predict_memory
from lightning_par.planner.model import ModelSpec, model_spec
from lightning_par.planner.overrides import layout_notes
from lightning_par.planner.precision import Precision, get_precision
from lightning_par.planner.step_time import TimeBreakdown, bubble_fraction, predict_step_time

__all__ = ["Prediction", "plan", "predict"]

_GiB = 1 << 30


@dataclass(frozen=True)
class Prediction:
    """The planner's prediction for one layout.

    Attributes:
        layout: the layout (``dp_size``, ``tp_size``, ``pp_size`` and the other choices are also properties here).
        memory: predicted bytes on the fullest rank.
        time: predicted step time and its parts.
        fits: whether ``memory.total_bytes`` fits the device's usable memory.
        reason: why it does not fit (``None`` when it fits).
        tokens_per_s: global tokens per second.
        mfu: model FLOPs utilisation in [0, 1] (no recomputation counted; PaLM, App. B).
        hfu: hardware FLOPs utilisation (recomputation counted, as Megatron-LM's papers report).
        notes: what the emitted run cannot express (activation checkpointing).
    """

    layout: Layout
    memory: MemoryBreakdown
    time: TimeBreakdown
    fits: bool
    reason: str | None
    tokens_per_s: float
    mfu: float
    hfu: float
    notes: tuple[str, ...] = ()

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas."""
        return self.layout.dp_size

    @property
    def tp_size(self) -> int:
        """Tensor-parallel ranks per layer."""
        return self.layout.tp_size

    @property
    def pp_size(self) -> int:
        """Pipeline stages."""
        return self.layout.pp_size

    def __getattr__(self, name: str) -> Any:
        """The layout's fields of the axes added on the registry, like the properties above
        (:func:`~lightning_par.planner.layouts.size_fields` and their :data:`~lightning_par.planner.layouts.
        AXIS_OPTIONS`): ``cp_size`` (ranks each sequence is split over), ``cp_method`` (``ring`` or ``all_to_all``),
        ``dp_replicate_size`` (HSDP replicas, 1: none), ``ep_size`` (expert-parallel ranks).

        Raises:
            AttributeError: any other name.
        """
        if name in size_fields() or any(name == o.name for o in AXIS_OPTIONS):
            return getattr(self.layout, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def dp_mode(self) -> str:
        """``ddp``, ``zero1``, ``zero2`` or ``zero3``."""
        return self.layout.dp_mode

    @property
    def micro_batch_size(self) -> int:
        """Sequences per micro-batch."""
        return self.layout.micro_batch_size

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per replica per step."""
        return self.layout.num_microbatches

    @property
    def schedule(self) -> str:
        """Pipeline schedule (``none`` without pipelining)."""
        return self.layout.schedule

    @property
    def virtual_stages(self) -> int:
        """Model chunks per pipeline rank."""
        return self.layout.virtual_stages

    @property
    def activation_checkpointing(self) -> str:
        """``none``, ``selective`` or ``full``."""
        return self.layout.activation_checkpointing

    @property
    def sequence_parallel(self) -> bool:
        """Sequence parallelism inside tensor parallelism."""
        return self.layout.sequence_parallel

    @property
    def bytes_per_device(self) -> float:
        """Predicted peak bytes on the fullest device (model state + activations + buffers)."""
        return self.memory.total_bytes

    @property
    def step_time_s(self) -> float:
        """Predicted seconds per optimizer step."""
        return self.time.step_time_s

    @property
    def bubble(self) -> float:
        """Pipeline bubble fraction ``(p-1)/(v m + p - 1)`` (0 without pipelining)."""
        lay = self.layout
        return bubble_fraction(lay.pp_size, lay.num_microbatches, lay.virtual_stages) if lay.pp_size > 1 else 0.0


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is not valid: expected a positive integer.")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is not valid: expected True or False.")


def predict(
    model: Any,
    layout: Layout,
    device: str | DeviceSpec = "a100-80gb",
    devices_per_node: int = 8,
    precision: str | Precision | None = None,
    seq_len: int | None = None,
    calibration: Any = None,
    pp_scatter_gather: bool = False,
) -> Prediction:
    """Predict memory and step time of one layout.

    Args:
        model: a :class:`~lightning_par.planner.model.ModelSpec`, a ``GPTConfig`` or a ModelSpec-like object
            (see :func:`~lightning_par.planner.model.model_spec`).
        layout: the layout; checked with :func:`~lightning_par.planner.layouts.check_layout`.
        device: a :class:`~lightning_par.planner.devices.DeviceSpec`, a preset name or ``"cpu"``.
        devices_per_node: devices per node.
        precision: a :class:`~lightning_par.planner.precision.Precision` or name; None: the device's default.
        seq_len: training sequence length (None: the model's).
        calibration: for ``device="cpu"``: the calibration file or object (None: the default file).
        pp_scatter_gather: model pipeline sends as Megatron-LM's scatter/gather (Narayanan et al. 2021, §4.1), for
            comparing with runs of that implementation; lightning_par's pipeline sends whole activations.

    Returns:
        The :class:`Prediction`.

    Raises:
        ValueError: an invalid model, layout, device or precision (the message names the field and what is valid).
    """
    spec = model_spec(model, seq_len)
    _check_positive_int("devices_per_node", devices_per_node)
    _check_bool("pp_scatter_gather", pp_scatter_gather)
    check_layout(layout, spec)
    dev = get_device(device, min(layout.world_size, devices_per_node), calibration)
    prec = get_precision(precision if precision is not None else dev.default_precision)
    return _predict(spec, layout, dev, prec, devices_per_node, pp_scatter_gather)


def _predict(spec: ModelSpec, layout: Layout, dev: DeviceSpec, prec: Precision, devices_per_node: int,
             pp_scatter_gather: bool = False) -> Prediction:
    memory = predict_memory(spec, layout, prec)
    time = predict_step_time(spec, layout, dev, prec, devices_per_node, pp_scatter_gather)
    fits = memory.total_bytes <= dev.usable_bytes
    reason = None
    if not fits:
        reason = (
            f"needs {memory.total_bytes / _GiB:.1f} GiB on pp rank {memory.pp_rank} (state "
            f"{memory.model_state_bytes / _GiB:.1f}, activations {memory.activation_bytes / _GiB:.1f}, buffers "
            f"{memory.buffer_bytes / _GiB:.1f}) > {dev.usable_bytes / _GiB:.1f} GiB usable on {dev.name}"
        )
    tokens = layout.global_batch_size * spec.seq_len
    peak_total = time.step_time_s * layout.world_size * dev.peak_flops
    return Prediction(
        layout=layout,
        memory=memory,
        time=time,
        fits=fits,
        reason=reason,
        tokens_per_s=tokens / time.step_time_s,
        mfu=time.model_flops / peak_total,
        hfu=time.hardware_flops / peak_total,
        notes=tuple(layout_notes(layout)),
    )


def _axis_choices(given: Mapping[str, Sequence[Any]], sizes: Mapping[str, Sequence[int]] | None
                  ) -> tuple[dict[str, Sequence[int]], dict[str, Sequence[str]]]:
    """Check :func:`plan`'s axis choices (``<size>s`` and ``<option>s`` keywords of
    :func:`~lightning_par.planner.layouts.axis_choices`, and ``sizes`` by Layout field) and return ``(sizes by Layout
    field, options by plural keyword)`` for :func:`~lightning_par.planner.layouts.enumerate_layouts`.

    Raises:
        TypeError: a keyword that is no axis choice.
        ValueError: an unknown key of ``sizes``, sizes that are not a non-empty list of positive integers, options
            that are not a non-empty subset of their valid values (each naming the argument, its value and what is
            valid).
    """
    defaults = axis_choice_defaults()
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise TypeError(f"plan() got unexpected keyword arguments {unknown}: expected the usual ones or axis choices "
                        f"among {list(defaults)}.")
    fields = size_fields()
    unknown = sorted(set(sizes or {}) - set(fields))
    if unknown:
        raise ValueError(f"sizes={dict(sizes or {})!r} is not valid: {unknown} are not sizes of an axis added on the "
                         f"registry; expected keys among {list(fields)}.")
    layout_sizes = {}
    for field in fields:
        name, values = f"{field}s", given.get(f"{field}s", defaults[f"{field}s"])
        if field in (sizes or {}):
            name, values = f"sizes[{field!r}]", sizes[field]
        if not values or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in values):
            raise ValueError(f"{name}={list(values)!r} is not valid: expected a non-empty list of positive integers.")
        layout_sizes[field] = values
    options = {}
    for option in AXIS_OPTIONS:
        name = f"{option.name}s"
        values = given.get(name, option.values)
        if not values or any(x not in option.values for x in values):
            raise ValueError(
                f"{name}={list(values)!r} is not valid: expected a non-empty subset of {list(option.values)}."
            )
        options[name] = values
    return layout_sizes, options


def plan(
    model: Any,
    num_devices: int,
    devices_per_node: int = 8,
    device: str | DeviceSpec = "a100-80gb",
    global_batch_size: int = 512,
    seq_len: int | None = None,
    *,
    precision: str | Precision | None = None,
    dp_modes: Sequence[str] = DP_MODES,
    schedules: Sequence[str] = ("gpipe", "1f1b", "interleaved_1f1b"),
    checkpointing: Sequence[str] = CHECKPOINTING,
    micro_batch_sizes: Sequence[int] | None = None,
    max_tp_size: int | None = None,
    max_virtual_stages: int = 4,
    sequence_parallel: Sequence[bool] = (False, True),
    sizes: Mapping[str, Sequence[int]] | None = None,
    include_unfit: bool = True,
    calibration: Any = None,
    pp_scatter_gather: bool = False,
    **axis_choices: Sequence[Any],
) -> list[Prediction]:
    """Enumerate the valid layouts of ``model`` on ``num_devices`` devices and predict each; best first.

    Example::

        from lightning_par.models import GPTConfig
        from lightning_par.planner import plan

        best = plan(model=GPTConfig(n_layer=32, n_head=32, n_embd=4096, block_size=2048, vocab_size=50304),
                    num_devices=64, devices_per_node=8, device="h100-80gb", global_batch_size=512, seq_len=2048)[0]
        best.dp_size, best.tp_size, best.pp_size, best.dp_mode, best.bytes_per_device, best.step_time_s

    Args:
        model: a ``GPTConfig``, a :class:`~lightning_par.planner.model.ModelSpec` or a ModelSpec-like object.
        num_devices: devices ``N`` (a multiple of ``devices_per_node`` beyond one node).
        devices_per_node: devices per node ``G`` (NVLink domain).
        device: a preset name (``"a100-40gb"``, ``"a100-80gb"``, ``"h100-80gb"``, ``"h200"``), ``"cpu"`` (this
            machine, calibrated) or a :class:`~lightning_par.planner.devices.DeviceSpec`.
        global_batch_size: sequences per optimizer step ``B``.
        seq_len: tokens per sequence (None: the model's context length).
        precision: see :data:`lightning_par.planner.precision.PRECISIONS` (None: the device's default,
            ``"mixed-bf16"`` on GPUs, ``"fp32"`` on the CPU).
        dp_modes, schedules, checkpointing, micro_batch_sizes, max_virtual_stages, sequence_parallel: the choices
            to enumerate (see :func:`~lightning_par.planner.layouts.enumerate_layouts`).
        sizes: sizes to enumerate by Layout field, for any of :func:`~lightning_par.planner.layouts.size_fields`
            (e.g. ``{"ep_size": (1, 2)}``, the same as ``ep_sizes=(1, 2)``, which it overrides).
        axis_choices: the choices of the axes added on the registry
            (:func:`~lightning_par.planner.layouts.axis_choices`), each a non-empty sequence:

            * ``cp_sizes``: context-parallel sizes to enumerate (default ``(1,)``: none), e.g. ``(1, 2, 4)``;
            * ``cp_methods``: context-parallel attentions to enumerate when ``cp_size > 1``: a subset of
              :data:`~lightning_par.context_parallel.options.CP_METHODS` (default: all);
            * ``dp_replicate_sizes``: HSDP replica counts to enumerate (default ``(1,)``: none), e.g. ``(1, 2)``: the
              ZeRO modes then shard over ``dp_size / dp_replicate_size * cp_size`` ranks and all-reduce across the
              replicas;
            * ``ep_sizes``: expert-parallel sizes to enumerate for a MoE model (default ``(1,)``), e.g. ``(1, 2, 4)``.
        max_tp_size: largest tensor-parallel size (None: any divisor of ``devices_per_node``: tensor parallelism
            stays inside a node).
        include_unfit: also return the layouts that do not fit (after all that fit, each with its ``reason``).
        calibration: for ``device="cpu"``: the calibration file or object (None: the default file).
        pp_scatter_gather: model pipeline sends as Megatron-LM's scatter/gather (Narayanan et al. 2021, §4.1:
            ``b s h / t`` per tp rank across nodes, then an all-gather inside the node), to compare with that
            implementation's runs; False (lightning_par): each tp rank sends its whole activation.

    Returns:
        :class:`Prediction` s: those that fit by increasing predicted step time (ties: less memory first), then those
        that do not fit by increasing memory.

    Raises:
        ValueError: an invalid argument (named, with its value and what is valid), or no valid layout at all.
        TypeError: a keyword that is none of the above (nor an axis choice).
    """
    spec = model_spec(model, seq_len)
    for name, value in (("num_devices", num_devices), ("devices_per_node", devices_per_node),
                        ("global_batch_size", global_batch_size), ("max_virtual_stages", max_virtual_stages)):
        _check_positive_int(name, value)
    if num_devices > devices_per_node and num_devices % devices_per_node:
        raise ValueError(
            f"num_devices={num_devices} is not valid with devices_per_node={devices_per_node}: expected a multiple of "
            f"devices_per_node (whole nodes) or at most one node."
        )
    if max_tp_size is not None:
        _check_positive_int("max_tp_size", max_tp_size)
    _check_bool("pp_scatter_gather", pp_scatter_gather)
    for name, values, valid in (("dp_modes", dp_modes, DP_MODES), ("checkpointing", checkpointing, CHECKPOINTING),
                                ("schedules", schedules, ("gpipe", "1f1b", "interleaved_1f1b"))):
        bad = [x for x in values if x not in valid]
        if bad or not values:
            raise ValueError(f"{name}={list(values)!r} is not valid: expected a non-empty subset of {list(valid)}.")
    if micro_batch_sizes is not None:
        for b in micro_batch_sizes:
            _check_positive_int("micro_batch_sizes", b)
    layout_sizes, options = _axis_choices(axis_choices, sizes)
    if any(e > 1 for e in axis_choices.get("ep_sizes", ())) and not spec.num_experts:
        raise ValueError(f"ep_sizes={list(axis_choices['ep_sizes'])!r} is not valid for a dense model "
                         f"(num_experts=0): expected [1].")
    dev = get_device(device, min(num_devices, devices_per_node), calibration)
    prec = get_precision(precision if precision is not None else dev.default_precision)
    layouts = list(enumerate_layouts(
        spec, num_devices, global_batch_size,
        max_tp_size=max_tp_size, devices_per_node=min(devices_per_node, num_devices),
        dp_modes=dp_modes, schedules=schedules, checkpointing=checkpointing, micro_batch_sizes=micro_batch_sizes,
        max_virtual_stages=max_virtual_stages, sequence_parallel=sequence_parallel, sizes=layout_sizes, **options,
    ))
    if not layouts:
        raise ValueError(
            f"no valid layout of {spec.describe()} on num_devices={num_devices} at global_batch_size="
            f"{global_batch_size}: tp_size must divide num_heads={spec.num_heads}, pp_size num_layers="
            f"{spec.num_layers}, dp_size global_batch_size; try another batch size or device count."
        )
    predictions = [_predict(spec, lay, dev, prec, devices_per_node, pp_scatter_gather) for lay in layouts]
    fit = sorted((x for x in predictions if x.fits), key=lambda x: (x.step_time_s, x.bytes_per_device))
    unfit = sorted((x for x in predictions if not x.fits), key=lambda x: x.bytes_per_device)
    return fit + unfit if include_unfit else fit
