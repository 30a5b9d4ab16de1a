""""Will it fit": the recipe's check, before any process starts, that a run's layout fits ``planner.device``.

:func:`check_fit` predicts the run's peak memory per device with the planner (:func:`~lightning_par.planner.plan.
predict` on the run's layout, :func:`~lightning_par.planner.run_config.layout_from_run`) and, when it does not fit,
raises a ``ValueError`` that names the largest memory terms of the fullest rank and the nearest layout that fits:
the planner's layouts of the same model, devices and global batch that fit, the one fewest steps away from the
requested one (:func:`layout_distance`; the faster of equals), with the overrides that run it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from lightning_par.planner.layouts import WORLD_SIZE_FIELDS, Layout, size_fields
from lightning_par.planner.plan import Prediction, plan, predict
from lightning_par.planner.precision import get_precision

__all__ = ["check_fit", "layout_distance", "memory_terms", "nearest_fitting"]

_GiB = float(1 << 30)


def layout_distance(a: Layout, b: Layout) -> float:
    """How far layout ``b`` is from ``a``: one per doubling or halving of the tp and pp sizes and of every size of
    :func:`~lightning_par.planner.layouts.size_fields` (cp, HSDP replicas, ep), one per change of dp mode or
    activation checkpointing, a half per change of schedule, micro-batch size or sequence parallelism."""
    def log_steps(size: str) -> float:
        return abs(math.log2(getattr(a, size)) - math.log2(getattr(b, size)))

    return (sum(log_steps(size) for size in ("tp_size", "pp_size", *size_fields()))
            + (a.dp_mode != b.dp_mode) + (a.activation_checkpointing != b.activation_checkpointing)
            + 0.5 * ((a.schedule != b.schedule) + (a.micro_batch_size != b.micro_batch_size)
                     + (a.sequence_parallel != b.sequence_parallel)))


def memory_terms(pred: Prediction, precision: Any) -> list[tuple[str, float]]:
    """The fullest rank's predicted memory as named terms in bytes, largest first: parameters, gradients, optimizer
    state (ZeRO's split of the model state over the ``dp_size * cp_size`` ranks of the layout's dp mode, the runtime's
    ``dp_cp`` mesh), activations, buffers."""
    prec = get_precision(precision)
    layout, mem = pred.layout, pred.memory
    d = layout.dims().size("dp_cp")
    shards = {"ddp": (1, 1, 1), "zero1": (1, 1, d), "zero2": (1, d, d), "zero3": (d, d, d)}[layout.dp_mode]
    terms = [
        ("parameters", mem.params * prec.param_bytes / shards[0]),
        ("gradients", mem.params * prec.grad_bytes / shards[1]),
        ("optimizer state", mem.params * prec.optimizer_bytes / shards[2]),
        ("activations", mem.activation_bytes),
        ("buffers", mem.buffer_bytes),
    ]
    return sorted(terms, key=lambda t: -t[1])


def nearest_fitting(model: Any, layout: Layout, device: str, devices_per_node: int, precision: Any,
                    seq_len: int | None = None) -> Prediction | None:
    """The planner's layout that fits ``device`` nearest to ``layout`` (:func:`layout_distance`; the faster of
    equals), for the same model, device count and global batch, among the layouts with each size of
    :func:`~lightning_par.planner.layouts.size_fields` that splits the world (cp's) at 1 or at ``layout``'s, and the
    sizes on borrowed ranks (HSDP, ep) at 1; ``None`` if none fits."""
    batch = layout.dp_size * layout.micro_batch_size * layout.num_microbatches
    sizes = {size: sorted({1, getattr(layout, size)}) for size in size_fields() if size in WORLD_SIZE_FIELDS}
    fitting = plan(model, num_devices=layout.world_size, devices_per_node=devices_per_node, device=device,
                   global_batch_size=batch, seq_len=seq_len, precision=precision, sizes=sizes, include_unfit=False)
    if not fitting:
        return None
    return min(enumerate(fitting), key=lambda t: (layout_distance(layout, t[1].layout), t[0]))[1]


def check_fit(run_config: Mapping[str, Any], device: str, devices_per_node: int = 8) -> Prediction:
    """Refuse a run whose layout the planner predicts not to fit ``device``.

    Args:
        run_config: the resolved run config as plain containers (``model``, ``parallel``, ``strategy``, ``data``,
            ``trainer``), as :func:`~lightning_par.planner.run_config.predict_run` reads it.
        device: a device preset name (:data:`~lightning_par.planner.devices.DEVICE_PRESETS`).
        devices_per_node: devices per node (for the nearest layout's ranking by step time).

    Returns:
        The run's :class:`~lightning_par.planner.plan.Prediction` (it fits).

    Raises:
        ValueError: the layout is predicted not to fit (the message gives the predicted and usable GiB per device,
            the largest terms and the nearest layout that fits, with its overrides), or a run the planner cannot read
            (a model other than the reference GPT's presets, an unknown device).
    """
    from lightning_par.planner.overrides import layout_overrides
    from lightning_par.planner.run_config import layout_from_run, model_from_run

    try:
        model = model_from_run(run_config)
    except ValueError as e:
        raise ValueError(f"planner.device={device!r}: the fit check cannot read this model ({e}). Set "
                         f"planner.device=null to start without the check.") from None
    layout = layout_from_run(run_config)
    precision = (run_config.get("trainer") or {}).get("precision", "32-true")
    pred = predict(model, layout, device=device, devices_per_node=devices_per_node, precision=precision)
    if pred.fits:
        return pred
    from lightning_par.planner.devices import get_device

    usable = get_device(device).usable_bytes
    terms = ", ".join(f"{name} {b / _GiB:.2f} GiB" for name, b in memory_terms(pred, precision)[:3])
    near = nearest_fitting(model, layout, device, devices_per_node, precision)
    if near is None:
        hint = f"no layout of {layout.world_size} devices fits; use more devices or a larger device"
    else:
        overrides = " ".join(layout_overrides(near.layout, None, model.n_layer))
        hint = (f"the nearest layout that fits is {near.layout.describe()} ({near.bytes_per_device / _GiB:.2f} GiB): "
                f"{overrides}")
    raise ValueError(
        f"The layout {layout.describe()} is predicted not to fit planner.device={device!r}: "
        f"{pred.bytes_per_device / _GiB:.2f} GiB on the fullest rank (pp rank {pred.memory.pp_rank}) > "
        f"{usable / _GiB:.2f} GiB usable. Largest terms: {terms}. {hint[0].upper() + hint[1:]}. "
        f"(planner.device=null skips this check.)"
    )
