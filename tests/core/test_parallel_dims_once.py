"""A rank of the recipe builds one :class:`~lightning_par.parallel_dims.ParallelDims` (issue 46): ``train_worker``
on 2 gloo ranks (the tiny GPT, ``trainer=smoke``, ``ddp_overlap``), every construction counted. Measured before the
layout was handed on: 3 per rank (``build_strategy``, ``build_trainer_kwargs``, the strategy's
``setup_environment``). The same sequence without processes is ``tests/config/test_options_source.py`` (CI)."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lightning_par.config.schema import register_configs
from lightning_par.launcher import run_distributed
from tests.config.test_compose import CONF

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _count(cfg_dict: dict, run_dir: str) -> list[str]:
    """Body of one rank: ``train_worker`` with every ``ParallelDims`` construction recorded (the caller's line)."""
    import traceback

    from lightning_par import train
    from lightning_par.parallel_dims import ParallelDims

    built: list[str] = []
    original = ParallelDims.__post_init__

    def counting(self: ParallelDims) -> None:
        built.append(traceback.format_stack(limit=4)[0])
        original(self)

    ParallelDims.__post_init__ = counting  # this rank's process only
    try:
        train.train_worker(cfg_dict, run_dir)
    finally:
        ParallelDims.__post_init__ = original
    return built


def test_a_recipe_rank_builds_one_parallel_dims(tmp_path):
    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=[
            "model=tiny", "data=synthetic", "trainer=smoke", "logger=[csv]", "trainer.checkpoint=false",
            "trainer.enable_progress_bar=false"])
    per_rank = run_distributed(_count, 2, (OmegaConf.to_container(cfg, resolve=True), str(tmp_path)), timeout_s=300)
    assert [len(b) for b in per_rank] == [1, 1], per_rank
