"""The Hydra plugins compose: ``hydra/launcher=lightning_par`` (nprocs per job), the submitit launchers with the
recipe, and the search path that finds conf/ from any directory. No processes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.plugins import Plugins
from hydra.plugins.launcher import Launcher
from hydra.plugins.search_path_plugin import SearchPathPlugin
from omegaconf import OmegaConf

from hydra_plugins.lightning_par_hydra.launcher import LightningParLauncher, TaskRef, _check_nprocs
from hydra_plugins.lightning_par_hydra.searchpath import conf_search_path
from lightning_par.config.build import build_trainer_kwargs
from lightning_par.config.schema import register_configs

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"

register_configs()


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="config", overrides=list(overrides), return_hydra_config=True)


def test_hydra_discovers_both_plugins():
    names = {cls.__name__ for cls in Plugins.instance().discover(Launcher)}
    assert "LightningParLauncher" in names
    assert "LightningParSearchPathPlugin" in {cls.__name__ for cls in Plugins.instance().discover(SearchPathPlugin)}


@pytest.mark.parametrize(("parallel", "world"), [("dp1", 1), ("dp4", 4), ("tp2_pp2_dp2", 8)])
def test_launcher_nprocs_is_each_jobs_world_size(parallel, world):
    cfg = _compose("hydra/launcher=lightning_par", f"parallel={parallel}")
    assert cfg.hydra.launcher.nprocs == world
    assert cfg.hydra.launcher.timeout_s == cfg.trainer.job_timeout_s


def test_launcher_options_are_checked():
    with pytest.raises(ValueError, match=r"hydra.launcher.nprocs=0 is not valid: expected an integer >= 1"):
        _check_nprocs(0)
    with pytest.raises(ValueError, match=r"hydra.launcher.start_method='thread' is not valid"):
        LightningParLauncher(start_method="thread")


def test_task_ref_finds_the_undecorated_task_function():
    """Under spawn the task goes by name; the module attribute is @hydra.main's wrapper, unwrapped again."""
    ref = TaskRef.of(_undecorated)
    assert ref.resolve() is _undecorated
    assert TaskRef("tests.config.test_hydra_plugins", "decorated").resolve() is _undecorated


def _undecorated(cfg):
    return cfg


def _decorate(fn):
    import functools

    @functools.wraps(fn)
    def wrapper(*args):
        return fn(*args)

    return wrapper


decorated = _decorate(_undecorated)


def test_conf_is_found_from_the_checkout():
    assert conf_search_path() == f"file://{CONF}"


def test_search_path_is_appended_only_for_lightning_pars_entry_point(monkeypatch):
    """Appended to any app, our groups would turn the app's own ``strategy``/``model`` keys into group selections."""
    import types

    from hydra._internal.config_search_path_impl import ConfigSearchPathImpl

    from hydra_plugins.lightning_par_hydra.searchpath import LightningParSearchPathPlugin

    def providers(main_name):
        monkeypatch.setitem(sys.modules, "__main__", types.SimpleNamespace(__spec__=types.SimpleNamespace(name=main_name)))
        path = ConfigSearchPathImpl()
        LightningParSearchPathPlugin().manipulate_search_path(path)
        return [(e.provider, e.path) for e in path.get_path()]

    assert providers("lightning_par.train") == [("lightning_par", f"file://{CONF}")]
    assert providers("my_app") == []


def test_submitit_slurm_launcher_composes_with_a_multi_node_recipe():
    """The cluster path: one SLURM job per sweep point, each task a rank; num_nodes from SLURM's environment."""
    if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
        pytest.skip("hydra-submitit-launcher is not installed (pip install 'lightning-par[submitit]')")
    cfg = _compose("hydra/launcher=submitit_slurm", "hydra.launcher.nodes=2", "hydra.launcher.tasks_per_node=8",
                   "hydra.launcher.gpus_per_node=8", "+recipe=gpt2_3d", "parallel.world_size=16",
                   "parallel.dp_size=4")
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher")
    assert cfg.hydra.launcher.nodes * cfg.hydra.launcher.tasks_per_node == cfg.parallel.world_size
    task = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "16", "SLURM_NNODES": "2"}
    kwargs = build_trainer_kwargs(task, env=env)
    assert (kwargs["num_nodes"], kwargs["devices"]) == (2, 8)
