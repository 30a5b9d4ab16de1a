"""ParallelDims: the validation table, with the exact messages, and rank coordinates. No processes."""

from __future__ import annotations

import re

import pytest

from lightning_par.parallel_dims import ParallelDims


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (dict(dp_size=-1, tp_size=1, pp_size=1, world_size=8), (8, 1, 1)),
        (dict(dp_size=-1, tp_size=2, pp_size=2, world_size=8), (2, 2, 2)),
        (dict(dp_size=2, tp_size=4, pp_size=1, world_size=8), (2, 4, 1)),
        (dict(dp_size=1, tp_size=1, pp_size=8, world_size=8), (1, 1, 8)),
        (dict(world_size=1), (1, 1, 1)),
    ],
)
def test_valid_layouts(kwargs, expected):
    dims = ParallelDims(**kwargs)
    assert (dims.dp_size, dims.tp_size, dims.pp_size) == expected
    assert dims.dp_size * dims.tp_size * dims.pp_size == dims.world_size
    # (pp, dp_replicate, dp_shard, cp, tp): plain data parallelism is all dp_shard
    assert dims.shape == (expected[2], 1, expected[0], 1, expected[1])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(dp_size=2, tp_size=2, pp_size=1, world_size=8),
            "dp_size * tp_size * pp_size = 2 * 2 * 1 = 4 does not equal world_size=8. Each size must be one of the "
            "divisors [1, 2, 4, 8] and their product must be 8; dp_size=-1 infers the data-parallel size.",
        ),
        (
            dict(dp_size=-1, tp_size=3, pp_size=1, world_size=8),
            "dp_size=-1 cannot be inferred: world_size=8 is not divisible by tp_size * pp_size = 3 * 1 = 3. "
            "Choose tp_size and pp_size whose product divides 8.",
        ),
        (dict(tp_size=0, world_size=2), "tp_size=0 is not valid: expected an integer >= 1."),
        (dict(pp_size=-2, world_size=2), "pp_size=-2 is not valid: expected an integer >= 1."),
        (dict(dp_size=0, world_size=2), "dp_size=0 is not valid: expected an integer >= 1 or -1 (infer from world_size)."),
        (dict(dp_size="two", world_size=2), "dp_size='two' is not valid: expected an integer >= 1 or -1 (infer from world_size)."),
        (dict(tp_size=True, world_size=2), "tp_size=True is not valid: expected an integer >= 1."),
        (dict(world_size=0), "world_size=0 is not valid: expected an integer >= 1."),
    ],
)
def test_invalid_layouts_name_field_value_and_valid(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ParallelDims(**kwargs)


def test_coordinates_follow_pp_dp_tp_order():
    dims = ParallelDims(dp_size=2, tp_size=2, pp_size=2, world_size=8)
    assert [tuple(dims.coordinates(r)[a] for a in ("pp", "dp", "tp")) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)
    ]
    with pytest.raises(ValueError, match=re.escape("rank=8 is not valid: expected 0 <= rank < world_size=8.")):
        dims.coordinates(8)


def test_get_mesh_checks_axis_and_build():
    dims = ParallelDims(world_size=2)
    with pytest.raises(ValueError, match=re.escape(
            "axis='xy' is not valid: expected one of ['pp', 'dp_replicate', 'dp_shard', 'cp', 'tp', 'dp', "
            "'dp_shard_cp', 'dp_cp', 'ep', 'edp_shard', 'edp'].")):
        dims.get_mesh("xy")
    with pytest.raises(RuntimeError, match="before build_mesh"):
        dims.get_mesh("dp")


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        # (dp_size, dp_replicate_size, dp_shard_size, mesh shape (pp, dp_replicate, dp_shard, cp, tp))
        (dict(dp_replicate_size=2, dp_shard_size=2, world_size=4), (4, 2, 2, (1, 2, 2, 1, 1))),
        (dict(dp_replicate_size=2, world_size=4), (4, 2, 2, (1, 2, 2, 1, 1))),
        (dict(dp_size=4, dp_replicate_size=2, tp_size=2, world_size=8), (4, 2, 2, (1, 2, 2, 1, 2))),
        (dict(dp_replicate_size=2, dp_shard_size=1, pp_size=2, world_size=4), (2, 2, 1, (2, 2, 1, 1, 1))),
        (dict(dp_size=2, cp_size=2, tp_size=2, world_size=8), (2, 1, 2, (1, 1, 2, 2, 2))),
    ],
)
def test_hsdp_and_cp_layouts(kwargs, expected):
    dims = ParallelDims(**kwargs)
    assert (dims.dp_size, dims.dp_replicate_size, dims.dp_shard_size, dims.shape) == expected
    assert dims.size("dp") == dims.dp_size
    assert dims.size("dp_shard_cp") == dims.dp_shard_size * dims.cp_size
    assert dims.size("dp_cp") == dims.dp_size * dims.cp_size


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(dp_size=4, dp_replicate_size=3, world_size=4),
         "dp_replicate_size=3 is not valid with dp_size=4: expected a divisor of dp_size, one of [1, 2, 4]"),
        (dict(dp_size=4, dp_replicate_size=2, dp_shard_size=4, world_size=4),
         "dp_shard_size=4 is not valid: dp_size=4 with dp_replicate_size=2 leaves dp_shard_size=2"),
        (dict(dp_replicate_size=2, dp_shard_size=2, world_size=8),
         "dp_size * tp_size * pp_size = 4 * 1 * 1 = 4 does not equal world_size=8"),
        (dict(cp_size=3, world_size=8), "dp_size=-1 cannot be inferred: world_size=8 is not divisible by tp_size * "
                                        "cp_size * pp_size = 1 * 3 * 1 = 3"),
        (dict(dp_replicate_size=0, world_size=2), "dp_replicate_size=0 is not valid: expected an integer >= 1."),
    ],
)
def test_invalid_hsdp_layouts_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ParallelDims(**kwargs)


def test_coordinates_and_strides_of_every_axis_and_derived_mesh():
    """Global rank = ((((pp * R + r) * S + s) * C + c) * T + t): the innermost axis varies fastest."""
    dims = ParallelDims(dp_replicate_size=2, dp_shard_size=2, tp_size=2, world_size=8)
    c = dims.coordinates(6)  # pp 0, dp_replicate 1, dp_shard 1, cp 0, tp 0
    assert (c["pp"], c["dp_replicate"], c["dp_shard"], c["cp"], c["tp"]) == (0, 1, 1, 0, 0)
    assert (c["dp"], c["dp_shard_cp"], c["dp_cp"]) == (3, 1, 3)
    assert [dims.stride(n) for n in ("tp", "dp_shard", "dp_replicate", "dp", "dp_shard_cp", "pp")] == [1, 2, 4, 2, 2, 8]
    # a group's ranks: same coordinates on every other axis, `stride` apart
    for name in ("tp", "dp_shard", "dp_replicate", "dp"):
        group = [r for r in range(8) if all(dims.coordinates(r)[a] == c[a] for a in ("pp", "dp_replicate",
                 "dp_shard", "cp", "tp") if a not in {"dp": ("dp_replicate", "dp_shard")}.get(name, (name,)))]
        assert len(group) == dims.size(name) and all(b - a == dims.stride(name) for a, b in zip(group, group[1:]))
