"""The axis registry: every parallelism lightning_par composes, each from its own folder.

:func:`~lightning_par.parallelize.parallelize` runs every entry's steps in the order of their phases
(:data:`~lightning_par.axis_registry.PHASES`); :func:`~lightning_par.parallelize.validate` runs every entry's check; a
strategy refuses a size or an option of an axis it does not have from the entries' ``size_fields`` and
``option_groups``. A new parallelism is one folder with an ``axis.py`` and one line here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_par.activation_checkpointing import ACTIVATION_CHECKPOINTING_STEP
from lightning_par.axis_registry import Axis
from lightning_par.compile import COMPILE
from lightning_par.context_parallel.axis import CONTEXT_PARALLEL
from lightning_par.data_parallel.axis import DATA_PARALLEL
from lightning_par.expert_parallel.axis import EXPERT_PARALLEL
from lightning_par.float8 import FLOAT8
from lightning_par.parallel_dims import AXIS_OF_SIZE
from lightning_par.pipeline_parallel.axis import PIPELINE_PARALLEL
from lightning_par.tensor_parallel.axis import TENSOR_PARALLEL

__all__ = ["AXES", "EVERY_AXIS", "axis_of_group", "axis_of_size", "check_options", "check_sizes"]

#: Every registered parallelism.
AXES: tuple[Axis, ...] = (
    PIPELINE_PARALLEL, DATA_PARALLEL, CONTEXT_PARALLEL, EXPERT_PARALLEL, TENSOR_PARALLEL,
    ACTIVATION_CHECKPOINTING_STEP, COMPILE, FLOAT8,
)

#: Where every axis is: named in refusals of a size or option the chosen strategy lacks.
EVERY_AXIS = "parallel_3d and MeshStrategy have every axis: " + ", ".join(a.name for a in AXES if a.size_fields)


def axis_of_size(size_field: str) -> Axis | None:
    """The registered axis owning a :class:`~lightning_par.parallel_dims.ParallelDims` size field (``None``: no
    registered parallelism runs on it yet)."""
    return next((a for a in AXES if size_field in a.size_fields), None)


def axis_of_group(group: str) -> Axis | None:
    """The registered axis owning an option group."""
    return next((a for a in AXES if group in a.option_groups), None)


def check_sizes(sizes: dict[str, Any], has_axis: Callable[[str], bool], prefix: str, label: str) -> None:
    """Refuse a size > 1 on an axis a strategy does not have, or on an axis no registered parallelism runs on (no
    process group needed).

    Args:
        sizes: size fields of :class:`~lightning_par.parallel_dims.ParallelDims` and their values.
        has_axis: whether the strategy has a registered axis (by ``Axis.name``).
        prefix: how the fields are named in the message (``"parallel."`` for a recipe).
        label: how the strategy is named in the message.

    Raises:
        ValueError: naming the field, the value, and what would be valid.
    """
    from lightning_par.validation import check_int

    for name, value in sizes.items():
        check_int(name, value, 1, allow_infer=name in ("dp_size", "dp_shard_size"))
        if value in (1, -1):
            continue
        axis = axis_of_size(name)
        if axis is None:
            raise ValueError(
                f"{prefix}{name}={value} is not valid: no registered parallelism runs on the "
                f"{AXIS_OF_SIZE.get(name, name)} axis in this version. Use {prefix}{name}=1."
            )
        if not has_axis(axis.name):
            raise ValueError(
                f"{prefix}{name}={value} is not valid for {label}, which has no {axis.name} axis: use "
                f"{prefix}{name}=1 or a strategy that has it ({EVERY_AXIS})."
            )


def check_options(keys: Any, groups: dict[str, Any], has_axis: Callable[[str], bool], label: str) -> None:
    """Refuse an option of an axis a strategy does not have (no process group needed).

    Args:
        keys: the option keys given, flat (``"sequence_parallel"``) or an option group's name (``"pipeline"``).
        groups: option group -> its option names (:data:`lightning_par.parallelize.OPTION_GROUPS`).
        has_axis: whether the strategy has a registered axis (by ``Axis.name``).
        label: how the strategy is named in the message.

    Raises:
        ValueError: naming the option, its axis, and the strategies that have it.
    """
    for key in keys:
        group = key if key in groups else next((g for g, names in groups.items() if key in names), None)
        axis = axis_of_group(group) if group is not None else None
        if axis is not None and not has_axis(axis.name):
            raise ValueError(
                f"{key} is an option of the {axis.name} axis, which {label} does not have: remove it, or use a "
                f"strategy with that axis ({EVERY_AXIS})."
            )
