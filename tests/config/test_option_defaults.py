"""One source per option: the strategy schemas and the ``conf/strategy`` presets agree with the options dataclasses.

Every default lives in an options dataclass (``ReducerOptions``, ``ZeroOptions`` / ``ZERO_GROUP_DEFAULTS``,
``TensorParallelOptions``, ``PipelineOptions``, ``ParallelOptions``) or, for the keywords only strategies have, in
``MeshStrategy``'s constructor. A preset YAML sets only what makes the preset (:data:`ON_PURPOSE`).
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lightning_par.config.schema import (
    STRATEGY_SCHEMAS, CompileGroup, ContextParallelGroup, FaultToleranceGroup, Float8Group, PipelineGroup, ReducerGroup,
    StrategyConfig, TensorParallelGroup, ZeroGroup,
    register_configs,
)
from lightning_par.compile import CompileOptions
from lightning_par.context_parallel.options import ContextParallelOptions
from lightning_par.float8 import Float8Options
from lightning_par.fault_tolerance import FaultToleranceOptions
from lightning_par.data_parallel.options import ZERO_GROUP_DEFAULTS, ReducerOptions, ZeroOptions, parse_mixed_precision
from lightning_par.parallelize import ParallelOptions
from lightning_par.pipeline_parallel.options import PipelineOptions
from lightning_par.strategies import MeshStrategy
from lightning_par.tensor_parallel.options import TensorParallelOptions

CONF = Path(__file__).resolve().parents[2] / "conf"
PRESETS = sorted(p.stem for p in (CONF / "strategy").glob("*.yaml"))

#: Option group -> its options dataclass.
GROUP_OPTIONS: dict[str, type] = {
    "reducer": ReducerOptions,
    "tensor_parallel": TensorParallelOptions,
    "pipeline": PipelineOptions,
    "context_parallel": ContextParallelOptions,
    "compile": CompileOptions,
    "float8": Float8Options,
    "fault_tolerance": FaultToleranceOptions,
}
#: Option group -> the schema generated from it.
GROUP_SCHEMAS: dict[str, type] = {
    "reducer": ReducerGroup,
    "zero": ZeroGroup,
    "tensor_parallel": TensorParallelGroup,
    "pipeline": PipelineGroup,
    "context_parallel": ContextParallelGroup,
    "compile": CompileGroup,
    "float8": Float8Group,
    "fault_tolerance": FaultToleranceGroup,
}
#: Schema fields left at None, which their options dataclass documents as its default.
NONE_IS_DEFAULT: dict[str, tuple[str, ...]] = {"reducer": ("bucket_cap_mb",)}
#: The strategy keywords that are not in an option group, and where their default lives.
TOP_LEVEL_SOURCES: dict[str, str] = {
    "timeout_s": "MeshStrategy", "module_attr": "ParallelOptions", "activation_checkpointing": "ParallelOptions",
    "prog_bar": "MeshStrategy", "dp_mode": "ParallelOptions",
}
#: (preset, dotted key) -> why the preset sets it although a default exists. ``name`` is every preset's own.
ON_PURPOSE: dict[tuple[str, str], str] = {
    ("gpipe", "pipeline.schedule"): "the gpipe preset runs GPipe; the schema's default (PipelineOptions) is 1f1b, "
                                    "which strategy.name=gpipe would refuse",
    ("1f1b", "pipeline.schedule"): "the point of the 1f1b preset: it names its schedule, as gpipe.yaml does "
                                   "(equal to today's default, but not because it is the default)",
}

register_configs()


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def _field_defaults(options: type) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(options) if f.default is not dataclasses.MISSING}


def _top_level_default(key: str) -> Any:
    if TOP_LEVEL_SOURCES[key] == "ParallelOptions":
        return _field_defaults(ParallelOptions)[key]
    return inspect.signature(MeshStrategy.__init__).parameters[key].default


def _zero_group_resolved(values: dict[str, Any]) -> dict[str, Any]:
    """The zero group as the ZeroOptions fields it stands for."""
    param_dtype, reduce_dtype = parse_mixed_precision(values["mixed_precision"])
    return {"cpu_offload": values["cpu_offload"], "reshard_after_forward": values["reshard_after_forward"],
            "param_dtype": param_dtype, "reduce_dtype": reduce_dtype}


def _assert_group_is_default(group: str, values: dict[str, Any], where: str, skip: tuple[str, ...] = ()) -> None:
    """Each value of ``values`` (a group's fields) equals its options dataclass's default."""
    if group == "zero":
        resolved, defaults = _zero_group_resolved(values), _field_defaults(ZeroOptions)
        for key, value in resolved.items():
            assert value == defaults[key], f"{where}: zero.{key}={value!r}, ZeroOptions.{key}={defaults[key]!r}"
        return
    options = GROUP_OPTIONS[group]
    defaults = _field_defaults(options)
    assert set(values) == set(defaults), f"{where}: {group} fields {sorted(values)} != {sorted(defaults)}"
    for key, value in values.items():
        if key in skip:
            continue
        if value is None and key in NONE_IS_DEFAULT.get(group, ()):
            value = getattr(options(**{key: None}), key)  # what the options dataclass makes of None
        if isinstance(defaults[key], tuple):  # a tuple field (float8.include) is a list in the config
            value = tuple(value)
        assert value == defaults[key], f"{where}: {group}.{key}={value!r}, {options.__name__}.{key}={defaults[key]!r}"


@pytest.mark.parametrize("preset", PRESETS)
def test_composed_preset_values_are_the_options_defaults(preset):
    """strategy=<preset>, composed: every value is its options dataclass's default, but for :data:`ON_PURPOSE`."""
    strategy = OmegaConf.to_container(_compose(f"strategy={preset}").strategy)
    assert strategy.pop("name") == preset
    purposeful = {key for (name, key) in ON_PURPOSE if name == preset}
    for key, value in strategy.items():
        if key in GROUP_SCHEMAS:
            skip = tuple(k.split(".", 1)[1] for k in purposeful if k.startswith(f"{key}."))
            _assert_group_is_default(key, value, f"strategy={preset}", skip)
        else:
            assert value == _top_level_default(key), f"strategy={preset}: {key}={value!r}"
    for key in purposeful:
        group, field = key.split(".")
        assert strategy[group][field] == preset  # both purposeful keys name the preset's schedule


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_yaml_sets_only_its_name_and_what_is_on_purpose(preset):
    """Nothing in ``conf/strategy/<preset>.yaml`` restates a default: its keys are ``name`` and :data:`ON_PURPOSE`'s."""
    raw = OmegaConf.to_container(OmegaConf.load(CONF / "strategy" / f"{preset}.yaml"))
    raw.pop("defaults")
    assert raw.pop("name") == preset
    written = {f"{group}.{key}" for group, values in raw.items() for key in values}
    assert written == {key for (name, key) in ON_PURPOSE if name == preset}


@pytest.mark.parametrize("group", sorted(GROUP_SCHEMAS))
def test_group_schema_defaults_are_the_options_defaults(group):
    """Field by field: ``strategy.<group>``'s schema default equals the options dataclass's."""
    schema = {
        f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        for f in dataclasses.fields(GROUP_SCHEMAS[group])
    }
    if group == "zero":
        assert schema == ZERO_GROUP_DEFAULTS
    for key in NONE_IS_DEFAULT.get(group, ()):
        assert schema[key] is None
    _assert_group_is_default(group, schema, f"{GROUP_SCHEMAS[group].__name__}")


def test_strategy_schema_defaults_are_the_constructor_defaults():
    """``StrategyConfig``'s fields (and ``Parallel3DConfig.dp_mode``) default to what the strategies do."""
    fields = {f.name: f.default for f in dataclasses.fields(StrategyConfig) if f.name not in GROUP_SCHEMAS}
    fields.pop("name")
    # the groups every strategy has (strategy.compile, strategy.float8) come from their options dataclass
    assert {f.name: f.default_factory for f in dataclasses.fields(StrategyConfig) if f.name in GROUP_SCHEMAS} == {
        "compile": CompileGroup, "float8": Float8Group}
    assert set(fields) | {"dp_mode"} == set(TOP_LEVEL_SOURCES)
    for key, value in fields.items():
        assert value == _top_level_default(key), f"StrategyConfig.{key}={value!r}"
    for name, schema in STRATEGY_SCHEMAS.items():
        for f in dataclasses.fields(schema):
            if f.name == "dp_mode":
                assert f.default == _top_level_default("dp_mode"), f"{schema.__name__}.dp_mode"
            elif f.name in GROUP_SCHEMAS:
                assert f.default_factory is GROUP_SCHEMAS[f.name], f"{schema.__name__}.{f.name} ({name})"
