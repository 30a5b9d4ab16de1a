"""``torch.compile`` in ``configure_model`` (Lightning's documented pattern): a layout that splits the model by its
structure (tp, pp, cp, ep, activation checkpointing) refuses it before any process starts, naming the compiled module
and what to do; the data-parallel modes accept it (parity: tests/core/test_compile_refusal_distributed.py)."""

from __future__ import annotations

import pytest
import torch

from lightning_par.parallel_dims import ParallelDims
from lightning_par.parallelize import ParallelOptions, validate
from tests.support.user_models import make_attention_lm, make_moe_lm


def _compiled_network():
    module = make_attention_lm()
    module.model = torch.compile(module.model, backend="aot_eager")  # compiles lazily, at the first call
    return module


def _compiled_block():
    module = make_attention_lm()
    module.model.layers["1"] = torch.compile(module.model.layers["1"], backend="aot_eager")
    return module


@pytest.mark.parametrize(("sizes", "options", "what"), [
    ({"tp_size": 2}, {}, r"tensor parallelism \(tp_size=2\)"),
    ({"pp_size": 2}, {"schedule": "1f1b", "num_microbatches": 2}, r"pipelining \(pp_size=2\)"),
    ({"cp_size": 2}, {}, r"context parallelism \(cp_size=2\)"),
    ({}, {"activation_checkpointing": "full"}, r"activation_checkpointing='full'"),
])
@pytest.mark.parametrize("build", [_compiled_network, _compiled_block])
def test_structural_layouts_refuse_a_compiled_module(sizes, options, what, build) -> None:
    module = build()
    name = "model" if build is _compiled_network else "model.layers.1"
    with pytest.raises(ValueError, match=rf"AttentionLM\.{name} is a torch.compile'd module .*which {what} cannot "
                                         rf"run.*_orig_mod.*Remove torch.compile.*strategy.compile.enabled=true"):
        validate(module, ParallelDims(world_size=2, **sizes), ParallelOptions.build(**options))


def test_expert_parallelism_refuses_a_compiled_module() -> None:
    module = make_moe_lm()
    module.model = torch.compile(module.model, backend="aot_eager")
    with pytest.raises(ValueError, match=r"expert parallelism \(ep_size=2\) cannot run"):
        validate(module, ParallelDims(world_size=2, ep_size=2), ParallelOptions.build(dp_mode="zero2"))


@pytest.mark.parametrize("dp_mode", ["ddp", "zero1", "zero2", "zero3"])
def test_data_parallel_modes_accept_a_compiled_network(dp_mode: str) -> None:
    validate(_compiled_network(), ParallelDims(world_size=2), ParallelOptions.build(dp_mode=dp_mode))
