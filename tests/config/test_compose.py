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
from lightning_par.train import validate_run

CONF = Path(__file__).resolve().parents[2] / "conf"
GROUPS = ("parallel", "strategy", "model", "data", "trainer")

register_configs()


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _strategy_for(cfg) -> str | None:
    """A registered strategy that can run the layout of ``cfg`` (the most general first), or None."""
    names = set(strategy_classes())
    tp, pp = cfg.parallel.tp_size > 1, cfg.parallel.pp_size > 1
    wanted = ["parallel_3d"] + (["gpipe"] if pp and not tp else []) + (["tensor_parallel"] if tp and not pp else [])
    if not tp and not pp:
        return cfg.strategy.name
    return next((n for n in wanted if n in names), None)


@pytest.mark.parametrize(("group", "option"), [(g, o) for g in GROUPS for o in _options(g)])
def test_every_option_composes_and_builds(group, option):
    cfg = _compose(f"{group}={option}")
    dims = build_parallel_dims(cfg)
    assert dims.world_size == cfg.parallel.world_size
    if group == "parallel":
        name = _strategy_for(cfg)
        if name is None:
            pytest.skip(f"no registered strategy runs {option}")
        cfg = _compose(f"{group}={option}", f"strategy={name}")
    if group in ("parallel", "strategy"):
        build_strategy(cfg)  # option and layout validation, no processes


@pytest.mark.parametrize("recipe", _options("recipe"))
def test_every_recipe_composes_and_validates(recipe):
    """Strategy options and the model (built on the meta device) against the layout, as the launcher checks them."""
    cfg = _compose(f"+recipe={recipe}")
    validate_run(cfg)
    assert build_parallel_dims(cfg).world_size == cfg.parallel.world_size


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
    cfg = _compose("strategy.reducer.comm_hook=zip")
    with pytest.raises(ValueError, match=re.escape("comm_hook='zip' is not valid: expected one of")):
        build_strategy(cfg)
