"""The axis registry and the strategy's size checks: no processes."""

from __future__ import annotations

import dataclasses
import re

import pytest

from lightning_par.axes import AXES, axis_of_group, axis_of_size
from lightning_par.axis_registry import PHASES
from lightning_par.parallel_dims import ParallelDims
from lightning_par.parallelize import OPTION_GROUPS
from lightning_par.strategies import DDPOverlapStrategy, MeshStrategy, PipelineStrategy, ZeroStrategy


def test_every_registered_axis_names_real_fields_groups_and_phases():
    fields = {f.name for f in dataclasses.fields(ParallelDims) if f.init}
    for axis in AXES:
        assert set(axis.size_fields) <= fields, axis.name
        assert set(axis.option_groups) <= set(OPTION_GROUPS), axis.name
        assert {phase for phase, _ in axis.steps} <= set(PHASES), axis.name
    # every option group and every size field belongs to exactly one registered axis
    assert all(axis_of_group(g) is not None for g in OPTION_GROUPS)
    assert sum(len(a.size_fields) for a in AXES) == len({f for a in AXES for f in a.size_fields})
    assert {f for a in AXES for f in a.size_fields} == fields - {"world_size"}
    assert axis_of_size("cp_size").name == "cp" and axis_of_size("dp_replicate_size").name == "dp"


def test_a_size_on_an_axis_nothing_runs_on_is_refused_before_start():
    from lightning_par.axes import check_sizes

    # every size field of ParallelDims has its axis now; a field no axis owns (a future one) is refused
    with pytest.raises(ValueError, match=re.escape(
            "xp_size=2 is not valid: no registered parallelism runs on the xp_size axis in this version. Use "
            "xp_size=1.")):
        check_sizes({"xp_size": 2}, MeshStrategy.has_axis, "", "MeshStrategy")
    with pytest.raises(ValueError, match=re.escape("tp_size=2 is not valid for PipelineStrategy, which has no tp axis")):
        PipelineStrategy(tp_size=2)


@pytest.mark.parametrize("cls", [DDPOverlapStrategy, ZeroStrategy, PipelineStrategy, MeshStrategy])
def test_every_preset_takes_the_axes_added_on_the_registry(cls):
    """A preset excludes only the classic axes it is not named for; cp and ep (and the next axis) need no preset edit."""
    pp = 2 if cls is PipelineStrategy else 1
    dims = cls(cp_size=2, ep_size=2, pp_size=pp).resolve_parallel_dims(4 * pp)
    assert (dims.cp_size, dims.ep_size, dims.dp_size, dims.pp_size) == (2, 2, 2, pp)
    with pytest.raises(ValueError, match="xp_size=1 is not a valid option"):
        cls(xp_size=1)


@pytest.mark.parametrize("cls", [DDPOverlapStrategy, ZeroStrategy, MeshStrategy])
def test_hsdp_keywords_on_every_strategy_with_the_dp_axis(cls):
    strategy = cls(dp_replicate_size=2, dp_shard_size=2)
    dims = strategy.resolve_parallel_dims(4)
    assert (dims.dp_size, dims.dp_replicate_size, dims.dp_shard_size) == (4, 2, 2)


def test_a_preset_refuses_the_axes_it_does_not_have():
    with pytest.raises(ValueError, match=re.escape("tp_size=2 is not valid for ZeroStrategy, which has no tp axis")):
        ZeroStrategy(tp_size=2)
    with pytest.raises(ValueError, match="sequence_parallel is an option of the tp axis, which PipelineStrategy"):
        PipelineStrategy(sequence_parallel=True)
