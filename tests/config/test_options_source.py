"""One source per option (issue 46, item 4): the options dataclasses are the Hydra schemas, Muon's options are declared
once, and the recipe builds one :class:`~lightning_par.parallel_dims.ParallelDims` per process.

The defaults and presets are ``tests/config/test_option_defaults.py``; this file checks that no second declaration
is left for them to agree with.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

import lightning_par
from lightning_par.compile import CompileOptions
from lightning_par.config.build import build_parallel_dims, build_strategy, build_trainer_kwargs
from lightning_par.config.schema import register_configs
from lightning_par.context_parallel.options import ContextParallelOptions
from lightning_par.fault_tolerance.options import FaultToleranceOptions
from lightning_par.data_parallel.options import ReducerOptions, ZeroGroupOptions
from lightning_par.float8 import Float8Options
from lightning_par.optim.muon import MuonOptions
from lightning_par.parallel_dims import ParallelDims
from lightning_par.pipeline_parallel.options import PipelineOptions
from lightning_par.tensor_parallel.options import TensorParallelOptions
from tests.config.test_compose import CONF
from tests.optim.test_adding_an_optimizer import code_names

PACKAGE = Path(lightning_par.__file__).parent

#: strategy.<group> -> the options dataclass that is its schema.
GROUP_CLASSES = {
    "zero": ZeroGroupOptions, "tensor_parallel": TensorParallelOptions, "pipeline": PipelineOptions,
    "context_parallel": ContextParallelOptions, "compile": CompileOptions, "float8": Float8Options,
    "fault_tolerance": FaultToleranceOptions,
}

register_configs()


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def test_the_stored_strategy_schema_nodes_are_the_options_dataclasses():
    """``strategy/schema_parallel_3d`` holds every group as a node of its options dataclass (no mirror class), and
    the reducer's as ReducerOptions itself (a subclass that only leaves ``bucket_cap_mb`` unset)."""
    node = ConfigStore.instance().repo["strategy"]["schema_parallel_3d.yaml"].node
    for group, cls in GROUP_CLASSES.items():
        assert OmegaConf.get_type(node[group]) is cls, group
    reducer = OmegaConf.get_type(node["reducer"])
    assert issubclass(reducer, ReducerOptions)
    assert set(reducer.__annotations__) == {"bucket_cap_mb"}  # the one field it declares again
    assert [f.name for f in dataclasses.fields(reducer)] == [f.name for f in dataclasses.fields(ReducerOptions)]
    assert node["reducer"]["bucket_cap_mb"] is None
    assert not (PACKAGE / "config" / "option_schema.py").exists()
    parallel = ConfigStore.instance().repo["parallel"]["schema_parallel.yaml"].node
    assert OmegaConf.get_type(parallel) is ParallelDims and parallel.dp_size == -1  # the declared default, unresolved
    assert set(parallel) == {f.name for f in dataclasses.fields(ParallelDims)}  # the sizes only, no mesh cache


def test_an_override_merges_into_a_frozen_options_node_and_a_bad_one_names_its_key():
    cfg = _compose("strategy=parallel_3d", "strategy.pipeline.num_microbatches=8", "strategy.float8.include=[mlp]")
    assert cfg.strategy.pipeline.num_microbatches == 8 and list(cfg.strategy.float8.include) == ["mlp"]
    with pytest.raises(ConfigCompositionException) as err:
        _compose("strategy=parallel_3d", "strategy.pipeline.num_microbatches=two")
    assert "num_microbatches" in str(err.value.__cause__ or err.value)
    with pytest.raises(ConfigCompositionException):
        _compose("strategy=parallel_3d", "strategy.pipeline.num_micro_batches=8")  # not a field of PipelineOptions
    with pytest.raises(ConfigCompositionException) as err:
        _compose("parallel.tp_size=two")  # the parallel group is ParallelDims
    assert "tp_size" in str(err.value.__cause__ or err.value)


def test_muon_options_are_declared_once():
    """Muon's keywords (``muon_lr``, ...) are generated from :class:`MuonOptions`: no module's code names one (before
    this, GPTLightningModule, HFCausalLM, the GPT factory and two schemas each declared them)."""
    keywords = {f"muon_{f.name}" for f in dataclasses.fields(MuonOptions)}
    assert keywords == {"muon_lr", "muon_weight_decay", "muon_momentum", "muon_adjust_lr_fn", "muon_ns_precision"}
    found = {str(p.relative_to(PACKAGE)): sorted(code_names(p) & keywords) for p in PACKAGE.rglob("*.py")}
    assert {k: v for k, v in found.items() if v} == {}
    cfg = _compose("model=tiny", "model.optimizer=muon", "model.muon_momentum=0.9")
    assert cfg.model.muon_momentum == 0.9 and cfg.model.muon_lr == MuonOptions.lr
    hf = _compose("model=hf")
    assert {k: hf.model[k] for k in keywords} == {f"muon_{f.name}": f.default for f in dataclasses.fields(MuonOptions)}
    with pytest.raises(ValueError, match=r"GPTLightningModule muon_momentum=1\.5 is not valid: expected a float in"):
        from lightning_par.models import GPTLightningModule

        GPTLightningModule(optimizer="muon", muon_momentum=1.5)
    with pytest.raises(ValueError, match="GPTLightningModule muon_lrr=0.1 is not valid"):
        GPTLightningModule(optimizer="muon", muon_lrr=0.1)


def test_the_recipe_builds_one_parallel_dims_per_process(monkeypatch):
    """What a rank of the recipe does (``train_worker``): the layout validated once, handed to the strategy (whose
    ``setup_environment`` meshes the same object) and to the Trainer arguments. Before: three on every rank."""
    built: list[ParallelDims] = []
    original = ParallelDims.__post_init__

    def counting(self: ParallelDims) -> None:
        built.append(self)
        original(self)

    monkeypatch.setattr(ParallelDims, "__post_init__", counting)
    cfg = _compose("parallel=tp2_dp2", "strategy=parallel_3d", "model=tiny", "data=synthetic", "trainer=smoke")
    dims = build_parallel_dims(cfg)
    strategy = build_strategy(cfg, dims)
    build_trainer_kwargs(cfg, env={}, dims=dims)
    assert strategy.resolve_parallel_dims(dims.world_size) is dims  # what setup_environment meshes
    assert built == [dims]
    with pytest.raises(ValueError, match="dp_size=4 of the layout handed in differs from the strategy.s dp_size=2"):
        strategy.use_parallel_dims(ParallelDims(world_size=4, dp_size=4))
