"""model/data/logger entries built from their ``_target_``; trainer keys reach ``lightning.Trainer`` or are refused;
num_nodes/devices from the launcher's environment. No processes."""

from __future__ import annotations

import importlib.util
import logging
import re
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from lightning_par.config import loggers as logger_config
from lightning_par.config.build import (
    build_datamodule,
    build_loggers,
    build_module,
    build_trainer_kwargs,
    check_loggers,
    cluster_nodes_and_devices,
)
from lightning_par.config.schema import TRAINER_RECIPE_KEYS, TrainerConfig, register_configs
from lightning_par.models import GPTLightningModule
from lightning_par.train import validate_run
from tests.recipes.user_lm import UserLM

CONF = Path(__file__).resolve().parents[2] / "conf"
USER = ["model=custom", "model._target_=tests.recipes.user_lm.UserLM", "+model.hidden=40"]

register_configs()


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


# ------------------------------------------------------------------------------------------------ model and data
@pytest.mark.parametrize("option", sorted(p.stem for p in (CONF / "model").glob("*.yaml") if p.stem not in ("custom", "hf")))
def test_every_gpt_entry_is_a_target_built_on_the_meta_device(option):
    cfg = _compose(f"model={option}")
    assert cfg.model._target_ == "lightning_par.config.build.gpt_lightning_module"
    with torch.device("meta"):
        module = build_module(cfg)
    assert isinstance(module, GPTLightningModule) and module.config.vocab_size == 256
    assert module.hparams.max_steps == cfg.trainer.max_steps  # interpolated from the trainer group


def test_user_module_by_target_with_added_arguments():
    cfg = _compose(*USER)
    module = build_module(cfg)
    assert isinstance(module, UserLM) and module.hparams.hidden == 40
    dm = build_datamodule(_compose(*USER, "data=synthetic"), module)
    assert dm.block_size == module.block_size == 16  # data.block_size null: taken from the model


def test_custom_model_without_target_is_named():
    with pytest.raises(ValueError, match=re.escape("model._target_ is missing: model=custom needs model._target_=")):
        build_module(_compose("model=custom"))


def test_unknown_argument_of_a_user_target_is_named_with_the_valid_ones():
    cfg = _compose(*USER, "+model.hiden=3")
    with pytest.raises(ValueError, match=r"model\.hiden=3 is not valid: .*valid keys are \['block_size', 'hidden', 'lr'\]"):
        validate_run(cfg)  # before any process starts


def test_typo_in_a_gpt_entry_fails_at_compose_time_and_with_plus_at_build_time():
    with pytest.raises(ConfigCompositionException, match="n_layr"):
        _compose("model.n_layr=2")
    with pytest.raises(ValueError, match=r"model\.n_layr=2 is not valid: .*'n_layer'"):
        build_module(_compose("+model.n_layr=2"))


def test_unimportable_target_is_named():
    with pytest.raises(ValueError, match=re.escape("model._target_='no_such_pkg.Model' cannot be imported")):
        build_module(_compose("model=custom", "model._target_=no_such_pkg.Model"))


def test_custom_data_entry_by_target():
    cfg = _compose("data=custom", "data._target_=lightning_par.data.ByteCorpusDataModule", "+data.synthetic=true",
                   "+data.block_size=8", "+data.batch_size=2")
    dm = build_datamodule(cfg, None)
    assert dm.block_size == 8 and dm.batch_size == 2


def test_data_block_size_needs_a_model_that_declares_one():
    class NoBlock(L.LightningModule):
        pass

    with pytest.raises(ValueError, match=re.escape("data.block_size=None is not valid for NoBlock")):
        build_datamodule(_compose("data=synthetic"), NoBlock())


# ------------------------------------------------------------------------------------------------ trainer
@pytest.mark.parametrize("option", sorted(p.stem for p in (CONF / "trainer").glob("*.yaml")))
def test_every_trainer_key_reaches_the_trainer_or_is_a_recipe_setting(option):
    cfg = _compose(f"trainer={option}")
    kwargs = build_trainer_kwargs(cfg, env={})
    for key in cfg.trainer:
        assert key in kwargs or key in TRAINER_RECIPE_KEYS, key
    assert kwargs["num_nodes"] == 1 and kwargs["devices"] == cfg.parallel.world_size
    L.Trainer(**{**kwargs, "accelerator": "cpu", "devices": 1, "logger": False})  # Lightning accepts every argument


def test_schema_fields_are_all_trainer_arguments_or_recipe_settings():
    import dataclasses
    import inspect

    valid = set(inspect.signature(L.Trainer.__init__).parameters)
    for f in dataclasses.fields(TrainerConfig):
        assert f.name in valid or f.name in TRAINER_RECIPE_KEYS, f.name


def test_added_trainer_argument_reaches_the_trainer():
    kwargs = build_trainer_kwargs(_compose("+trainer.limit_val_batches=2", "+trainer.detect_anomaly=true"), env={})
    assert kwargs["limit_val_batches"] == 2 and kwargs["detect_anomaly"] is True


def test_unknown_trainer_key_fails_before_start_naming_it_and_the_valid_keys():
    cfg = _compose("+trainer.foo=1")
    with pytest.raises(ValueError, match=r"trainer\.foo=1 is not valid: .*Valid keys: \[.*'limit_val_batches'.*\]"):
        validate_run(cfg)


def test_trainer_key_the_recipe_sets_elsewhere_is_refused():
    with pytest.raises(ValueError, match=re.escape("trainer.strategy is not valid: the recipe sets it from the strategy group")):
        build_trainer_kwargs(_compose("+trainer.strategy=ddp"), env={})


SLURM_2x8 = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "8"}
TORCHRUN_2x4 = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "1"}


def test_nodes_and_devices_from_slurm_and_torchrun():
    assert cluster_nodes_and_devices(SLURM_2x8) == (2, 8)
    assert cluster_nodes_and_devices(TORCHRUN_2x4) == (2, 4)
    assert cluster_nodes_and_devices({}) is None
    kwargs = build_trainer_kwargs(_compose("parallel=dp8", "parallel.world_size=16", "parallel.dp_size=16"), env=SLURM_2x8)
    assert (kwargs["num_nodes"], kwargs["devices"]) == (2, 8)  # multi-node SLURM is not refused
    kwargs = build_trainer_kwargs(_compose("parallel=dp8", "trainer.num_nodes=2"), env=TORCHRUN_2x4)
    assert (kwargs["num_nodes"], kwargs["devices"]) == (2, 4)


def test_nodes_that_contradict_the_launcher_or_need_one_are_named():
    with pytest.raises(ValueError, match=re.escape("trainer.num_nodes=4 is not valid: the world of parallel.world_size=8")):
        build_trainer_kwargs(_compose("parallel=dp8", "trainer.num_nodes=4"), env=TORCHRUN_2x4)
    with pytest.raises(ValueError, match=re.escape("trainer.num_nodes=2 is not valid here: several machines need")):
        build_trainer_kwargs(_compose("trainer.num_nodes=2"), env={})
    with pytest.raises(ValueError, match=re.escape("parallel.world_size=2 does not match the 2 x 4 processes")):
        build_trainer_kwargs(_compose(), env=TORCHRUN_2x4)


# ------------------------------------------------------------------------------------------------ loggers
def test_default_loggers_write_into_the_run_directory(tmp_path):
    loggers = build_loggers(_compose(), tmp_path)
    names = [type(lg).__name__ for lg in loggers]
    assert names[0] == "CSVLogger" and loggers[0].log_dir.startswith(str(tmp_path))
    has_tb = any(importlib.util.find_spec(m) for m in ("tensorboard", "tensorboardX"))
    assert ("TensorBoardLogger" in names) == bool(has_tb)


def test_no_logger():
    assert build_loggers(_compose("logger=[]"), "/unused") is False


def test_typo_in_a_logger_entry_fails_at_compose_time():
    with pytest.raises(ConfigCompositionException, match="nme"):
        _compose("logger=csv", "logger.csv.nme=x")


@pytest.mark.parametrize("name", ["wandb", "mlflow"])
def test_missing_optional_logger_fails_with_an_install_hint(name):
    if importlib.util.find_spec(name) is not None:
        pytest.skip(f"{name} is installed")
    with pytest.raises(ModuleNotFoundError, match=re.escape(f"pip install 'lightning-par[{name}]'")):
        validate_run(_compose(f"logger=[csv,{name}]"))


def test_missing_tensorboard_is_skipped_with_a_warning(monkeypatch, caplog):
    real = importlib.util.find_spec
    monkeypatch.setattr(logger_config.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("tensorboard", "tensorboardX") else real(name, *a))
    monkeypatch.setattr(logger_config, "_WARNED", set())
    with caplog.at_level(logging.WARNING):
        assert check_loggers(_compose()) == ["csv"]
    assert "logger.tensorboard skipped" in caplog.text
    with pytest.raises(ModuleNotFoundError, match="tensorboard"):
        check_loggers(_compose("logger=tensorboard", "logger.tensorboard.required=true"))
