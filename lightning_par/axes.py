"""The axis registry: every parallelism lightning_par composes, each from its own folder.

:func:`~lightning_par.parallelize.parallelize` runs every entry's steps in the order of their phases
(:data:`~lightning_par.axis_registry.PHASES`); :func:`~lightning_par.parallelize.validate` runs every entry's check; a
strategy refuses a size or an option of an axis it does not have from the entries' ``size_fields`` and
``option_groups``. A new parallelism is one folder with an ``axis.py`` and one line here.
"""

from __future__ import annotations

from lightning_par.activation_checkpointing import ACTIVATION_CHECKPOINTING_STEP
from lightning_par.axis_registry import Axis
from lightning_par.data_parallel.axis import DATA_PARALLEL
from lightning_par.pipeline_parallel.axis import PIPELINE_PARALLEL
from lightning_par.tensor_parallel.axis import TENSOR_PARALLEL

__all__ = ["AXES", "axis_of_group", "axis_of_size"]

#: Every registered parallelism.
AXES: tuple[Axis, ...] = (PIPELINE_PARALLEL, DATA_PARALLEL, TENSOR_PARALLEL, ACTIVATION_CHECKPOINTING_STEP)


def axis_of_size(size_field: str) -> Axis | None:
    """The registered axis owning a :class:`~lightning_par.parallel_dims.ParallelDims` size field (``None``: no
    registered parallelism runs on it yet)."""
    return next((a for a in AXES if size_field in a.size_fields), None)


def axis_of_group(group: str) -> Axis | None:
    """The registered axis owning an option group."""
    return next((a for a in AXES if group in a.option_groups), None)
