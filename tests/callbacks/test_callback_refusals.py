"""The callbacks each axis refuses, read from the registry (:attr:`lightning_par.axis_registry.Axis.refused_callbacks`)
without processes: the table the Lightning feature matrix's refused cells (``tests/strategies/test_lightning_matrix.py``) were measured for."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import BackboneFinetuning, ModelPruning, StochasticWeightAveraging

from lightning_par.callbacks.refusals import check_callbacks, refused_callbacks
from lightning_par.parallel_dims import ParallelDims
from lightning_par.parallelize import ParallelOptions


def _refused(dp_mode: str = "ddp", **sizes: int) -> dict[str, list[str]]:
    world = 1
    for k, v in sizes.items():
        world *= v if k != "ep_size" else 1  # ep ranks are borrowed from dp_shard x cp
    dims = ParallelDims(world_size=world, dp_size=sizes.pop("dp_size", 1), **sizes)
    return refused_callbacks(dims, ParallelOptions.build(dp_mode, None, "none"))


@pytest.mark.parametrize(("dp_mode", "sizes", "expected"), [
    ("ddp", {}, {}),
    ("ddp", {"pp_size": 2}, {"weight_averaging": ["pp_size=2"], "finetuning": ["pp_size=2"], "pruning": ["pp_size=2"]}),
    ("ddp", {"tp_size": 2}, {"weight_averaging": ["tp_size=2"], "pruning": ["tp_size=2"]}),
    ("ddp", {"dp_size": 2}, {"finetuning": ["dp_mode='ddp' over 2 ranks that average gradients"]}),
    ("ddp", {"cp_size": 2}, {"finetuning": ["dp_mode='ddp' over 2 ranks that average gradients"]}),
    ("zero3", {"dp_size": 2}, {"weight_averaging": ["dp_mode='zero3'"], "pruning": ["dp_mode='zero3'"]}),
    ("zero1", {"dp_size": 2}, {"finetuning": ["dp_mode='zero1' over 2 ranks that average gradients"],
                               "pruning": ["dp_mode='zero1'"]}),
    ("ddp", {"dp_size": 2, "ep_size": 2}, {"finetuning": ["dp_mode='ddp' over 2 ranks that average gradients"],
                                           "weight_averaging": ["ep_size=2"]}),
])
def test_each_axis_refuses_its_callbacks(dp_mode, sizes, expected):
    assert _refused(dp_mode, **sizes) == expected


def test_the_refusal_names_the_callback_the_sizes_and_where_it_runs():
    dims = ParallelDims(world_size=4, dp_size=1, tp_size=2, pp_size=2)
    options = ParallelOptions.build("ddp", None, "none")
    module = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"StochasticWeightAveraging is not supported with pp_size=2, tp_size=2: .*"
                                         r"It runs under ddp_overlap"):
        check_callbacks([StochasticWeightAveraging(swa_lrs=0.1)], module, dims, options)
    with pytest.raises(ValueError, match=r"ModelPruning is not supported with pp_size=2, tp_size=2"):
        check_callbacks([ModelPruning("l1_unstructured")], module, dims, options)
    with pytest.raises(ValueError, match=r"BackboneFinetuning is not supported with pp_size=2:"):
        check_callbacks([BackboneFinetuning()], module, dims, options)
    check_callbacks([ModelPruning("l1_unstructured")], module, ParallelDims(world_size=2, dp_size=2), options)
