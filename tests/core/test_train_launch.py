"""How the recipe decides between starting a world and training in place (torchrun, SLURM)."""

from __future__ import annotations

import re

import pytest

from lightning_par.train import _external_world_size

_VARS = ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS")


@pytest.fixture
def clean_env(monkeypatch):
    for var in _VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_plain_python_starts_its_own_world(clean_env):
    assert _external_world_size() is None


def test_torchrun_variables_mean_train_in_place(clean_env):
    clean_env.setenv("RANK", "3")
    clean_env.setenv("WORLD_SIZE", "8")
    assert _external_world_size() == 8


def test_slurm_tasks_mean_train_in_place(clean_env):
    clean_env.setenv("SLURM_PROCID", "0")
    clean_env.setenv("SLURM_NTASKS", "8")
    assert _external_world_size() == 8


def test_a_single_slurm_task_still_starts_its_world(clean_env):
    clean_env.setenv("SLURM_PROCID", "0")
    clean_env.setenv("SLURM_NTASKS", "1")
    assert _external_world_size() is None


def test_world_size_mismatch_with_the_launcher_is_named(clean_env, tmp_path):
    from hydra import compose, initialize_config_dir

    from lightning_par.config.schema import register_configs
    from lightning_par.train import launch_job
    from tests.config.test_compose import CONF

    register_configs()
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "4")
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=["model=tiny"])
    with pytest.raises(ValueError, match=re.escape("set parallel.world_size=4")):
        launch_job(cfg, tmp_path)


def _compose_tiny():
    from hydra import compose, initialize_config_dir

    from lightning_par.config.schema import register_configs
    from tests.config.test_compose import CONF

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="config", overrides=["model=tiny"])


def test_stale_rank_variables_outside_a_launcher_are_named(clean_env, tmp_path):
    """Issue 50: ``RANK=0 WORLD_SIZE=2`` left in a shell (no ``MASTER_ADDR``/``MASTER_PORT``: no launcher) is named as
    such before anything starts, not as "the run directory is in use by another job" naming the job itself."""
    from lightning_par.train import launch_job

    for var in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        clean_env.delenv(var, raising=False)
    clean_env.setenv("RANK", "0")
    clean_env.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=re.escape("RANK=0 and WORLD_SIZE=2 are set but MASTER_ADDR and MASTER_PORT "
                                                   "are not, so no launcher (torchrun, srun) started this process: "
                                                   "they are stale")):
        launch_job(_compose_tiny(), tmp_path / "run")
    assert not (tmp_path / "run").exists()
    # with a rendezvous address, the same variables are a launcher's: not stale
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", "1")
    from lightning_par.train import _stale_launcher_variables

    assert _stale_launcher_variables() is None
