"""Every config option composes; bad overrides fail at compose time with a clear message."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf.errors import ValidationError

from lightning_par.config.build import build_module, build_parallel_dims, build_strategy, strategy_classes
from lightning_par.config.schema import register_configs

CONF = Path(__file__).resolve().parents[2] / "conf"
GROUPS = ("parallel", "strategy", "model", "data", "trainer")

register_configs()


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _strategy_for(cfg) -> str:
    """A strategy that can run the layout of ``cfg`` (the most general one registered)."""
    names = set(strategy_classes())
    if cfg.parallel.pp_size > 1:
        return next((n for n in ("parallel_3d", "gpipe") if n in names), cfg.strategy.name)
    if cfg.parallel.tp_size > 1:
        return next((n for n in ("parallel_3d", "tensor_parallel") if n in names), cfg.strategy.name)
    return cfg.strategy.name


@pytest.mark.parametrize(("group", "option"), [(g, o) for g in GROUPS for o in _options(g)])
def test_every_option_composes_and_builds(group, option):
    cfg = _compose(f"{group}={option}")
    dims = build_parallel_dims(cfg)
    assert dims.world_size == cfg.parallel.world_size
    if group == "parallel":
        cfg = _compose(f"{group}={option}", f"strategy={_strategy_for(cfg)}")
    if group in ("parallel", "strategy"):
        if cfg.parallel.pp_size > 1 and cfg.strategy.name not in ("parallel_3d", "gpipe", "1f1b"):
            pytest.skip(f"no registered strategy runs pp_size={cfg.parallel.pp_size} yet")
        build_strategy(cfg)  # option and layout validation, no processes


def test_recipes_compose():
    for recipe in _options("recipe") if (CONF / "recipe").is_dir() else []:
        cfg = _compose(f"+recipe={recipe}")
        build_parallel_dims(cfg)
        build_strategy(cfg)


def test_default_builds_the_small_gpt():
    cfg = _compose()
    module = build_module(cfg)
    assert module.config.n_layer == 4 and module.config.vocab_size == 256
    assert cfg.strategy.name == "ddp_overlap" and cfg.parallel.world_size == 2


def test_type_error_fails_at_compose_time():
    with pytest.raises((ValidationError, ConfigCompositionException), match="dp_size"):
        _compose("parallel.dp_size=two")


def test_unknown_key_fails_at_compose_time():
    with pytest.raises(ConfigCompositionException, match="bucket_cap"):
        _compose("strategy.bucket_cap=3")


def test_unknown_strategy_lists_the_options():
    with pytest.raises(MissingConfigException, match="ddp_overlap"):
        _compose("strategy=does_not_exist")


def test_impossible_layout_is_a_value_error_before_anything_starts():
    cfg = _compose("parallel.world_size=4", "parallel.dp_size=3")
    with pytest.raises(ValueError, match=re.escape("does not equal world_size=4")):
        build_parallel_dims(cfg)


def test_layout_the_strategy_cannot_run_is_named():
    cfg = _compose("parallel.world_size=4", "parallel.tp_size=2")
    with pytest.raises(ValueError, match=re.escape("parallel.tp_size=2 is not valid for strategy 'ddp_overlap'")):
        build_strategy(cfg)


def test_bad_strategy_option_is_named():
    cfg = _compose("strategy.comm_hook=zip")
    with pytest.raises(ValueError, match=re.escape("comm_hook='zip' is not valid: expected one of")):
        build_strategy(cfg)
