"""Keyword defaults of the functions and constructors that take options: each is its options dataclass's default.

The config side (Hydra schemas, ``conf/strategy`` presets) is ``tests/config/test_option_defaults.py``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import pytest

from lightning_par.data_parallel.options import ReducerOptions, ZeroOptions, resolve_zero_options
from lightning_par.data_parallel.reducer import GradientReducer, reducer_options
from lightning_par.parallelize import ParallelOptions
from lightning_par.pipeline_parallel.options import PipelineOptions
from lightning_par.planner.memory import BUCKET_BYTES
from lightning_par.strategies import MeshStrategy, Parallel3DStrategy, PipelineStrategy


def _field_defaults(options: type) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(options) if f.default is not dataclasses.MISSING}


def _keyword_defaults(function: Callable[..., Any]) -> dict[str, Any]:
    return {k: p.default for k, p in inspect.signature(function).parameters.items()
            if p.default is not inspect.Parameter.empty}


@pytest.mark.parametrize(
    ("function", "options", "names"),
    [
        (GradientReducer.__init__, ReducerOptions,
         tuple(f.name for f in dataclasses.fields(ReducerOptions) if f.name != "broadcast_buffers")),
        (ZeroOptions, ReducerOptions, ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "comm_hook")),
        (resolve_zero_options, ZeroOptions,
         ("cpu_offload", "reshard_after_forward", "gradient_as_bucket_view", "static_graph", "comm_hook")),
        (ParallelOptions.build, ParallelOptions, ("dp_mode", "module_attr", "activation_checkpointing")),
        (MeshStrategy.__init__, ParallelOptions, ("dp_mode", "module_attr", "activation_checkpointing")),
        (Parallel3DStrategy.__init__, ParallelOptions, ("dp_mode",)),
    ],
    ids=["GradientReducer", "ZeroOptions", "resolve_zero_options", "ParallelOptions.build",
         "MeshStrategy", "Parallel3DStrategy"],
)
def test_keyword_defaults_are_the_options_defaults(function, options, names):
    keywords = _keyword_defaults(function)
    defaults = _field_defaults(options)
    for name in names or tuple(defaults):
        assert keywords[name] == defaults[name], f"{name}: {keywords[name]!r} != {options.__name__}.{name}"


def test_gradient_as_bucket_view_defaults_to_true_everywhere():
    """Measured better (one copy and one gradient's memory less per step): the reducer, ZeRO and the strategies."""
    assert ReducerOptions.gradient_as_bucket_view is True
    assert _keyword_defaults(GradientReducer.__init__)["gradient_as_bucket_view"] is True
    assert reducer_options()["gradient_as_bucket_view"] is True
    assert resolve_zero_options(1).gradient_as_bucket_view is True
    assert ParallelOptions.build().reducer.gradient_as_bucket_view is True


def test_none_means_the_default_bucket_size():
    """The keyword paths and the Hydra schema leave ``bucket_cap_mb`` at None, which ReducerOptions documents."""
    assert ReducerOptions(bucket_cap_mb=None).bucket_cap_mb == ReducerOptions.bucket_cap_mb
    assert resolve_zero_options(2, bucket_cap_mb=None).bucket_cap_mb == ReducerOptions.bucket_cap_mb
    assert ParallelOptions(dp_mode="zero1").zero.bucket_cap_mb == ReducerOptions.bucket_cap_mb


def test_planner_bucket_size_is_the_reducer_default():
    """The planner is torch-free and keeps its own copy of the bucket size: it must stay the reducer's default."""
    assert BUCKET_BYTES == ReducerOptions.bucket_cap_mb * (1 << 20)


def test_pipeline_schedule_defaults():
    """1f1b is the options default (the generic strategy=pipeline, parallel_3d); a bare PipelineStrategy() is its
    registry preset, gpipe, as documented."""
    assert PipelineOptions.schedule == "1f1b"
    assert ParallelOptions.build().pipeline.schedule == PipelineOptions.schedule
    assert Parallel3DStrategy(pp_size=2).options.pipeline.schedule == PipelineOptions.schedule
    assert PipelineStrategy().options.pipeline.schedule == PipelineStrategy.registry_presets["gpipe"]["schedule"]
    assert PipelineStrategy().options.pipeline.schedule == "gpipe"
