"""A resume never changes the model silently: the checkpoint's hyper-parameters are compared with the new run's before
any process starts (the recipe) or any tensor is loaded (a strategy's load, ``Trainer.fit(ckpt_path=...)``); an
architecture, optimizer or data-stream change is refused naming each field (old -> new), ``trainer.max_steps`` and
the loader's workers are applied, and a new batch size is accepted only from an epoch boundary."""

from __future__ import annotations

import re
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

from lightning_par.checkpoint import load_sharded, save_sharded
from lightning_par.checkpoint.compat import check_resume, resume_changes
from lightning_par.config.build import build_datamodule, build_module
from lightning_par.train import preflight
from tests.fault.test_faults import _cfg


# A Trainer run in this process starts a process group (world 1) that Lightning leaves initialised.
pytestmark = pytest.mark.usefixtures("no_process_group_left_behind")

TINY = ("strategy=zero2", "parallel.world_size=2", "trainer.max_steps=4")


def _position(batches: int) -> dict:
    state = {"batches": batches, "samples": 8 * batches, "batch_size": 8, "replicas": 2, "generator": None,
             "epoch": 0 if batches else None}
    return {"fit_loop": {"state_dict": {"combined_loader": [state]}}}


def _recipe_checkpoint(run_dir: Path, batches: int) -> Path:
    """What the recipe's job writes, in one process: the tiny GPT's weights, its and the data's hyper-parameters and
    the loader's position."""
    cfg = _cfg(*TINY)
    module = build_module(cfg)
    datamodule = build_datamodule(cfg, module)
    path = run_dir / "checkpoints" / "step-2.ckpt"
    checkpoint = {"state_dict": module.state_dict(), "global_step": 2, "epoch": 0, "loops": _position(batches),
                  "hyper_parameters": dict(module.hparams), "datamodule_hyper_parameters": dict(datamodule.hparams)}
    save_sharded(path, checkpoint, {"strategy": "zero2"}, is_rank0=True, barrier=lambda: None)
    return path


@pytest.fixture(scope="module")
def mid_epoch(tmp_path_factory) -> Path:
    return _recipe_checkpoint(tmp_path_factory.mktemp("mid"), batches=2).parents[1]


@pytest.mark.parametrize(("overrides", "message"), [
    (["model.n_head=4"], "model config.n_head: 2 -> 4"),  # same parameter shapes: only this check can tell
    (["model.n_layer=3", "model.dropout=0.1"], "model config.n_layer: 2 -> 3; model config.dropout: 0.0 -> 0.1"),
    (["model.learning_rate=0.01"], "model learning_rate: 0.003 -> 0.01"),
    (["data.batch_size=4"], "data batch_size: 8 -> 4 (the checkpoint is 2 batches into an epoch)"),
    (["seed=5"], "data seed: 1234 -> 5"),
    (["parallel.world_size=4", "trainer.max_steps=4"], "data-parallel replicas (dp_size): 2 -> 4"),
])
def test_a_resume_with_other_settings_is_refused_before_start(mid_epoch, overrides, message):
    cfg = _cfg(*TINY, *overrides)
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        preflight(cfg, mid_epoch)
    assert "cannot be resumed with these settings" in str(info.value)
    assert "step-2.ckpt" in str(info.value)


def test_a_global_order_position_resumes_with_more_replicas_and_the_same_global_batch():
    """A position in the epoch's global order (``consumed``, the re-splitting sampler's) resumes at dp4 with half the
    batch size; another global batch is still refused, naming the product that would be accepted."""
    state = {"batches": 2, "samples": 16, "consumed": 32, "batch_size": 8, "replicas": 2, "epoch": 0}
    meta = {"loops": {"fit_loop": {"state_dict": {"combined_loader": [state]}}},
            "datamodule_hyper_parameters": {"batch_size": 8}}
    refused, applied = resume_changes(meta, None, {"batch_size": 4}, replicas=4)
    assert refused == [] and applied == ["data batch_size: 8 -> 4",
                                         "data-parallel replicas (dp_size): 2 -> 4 (the rest of the epoch re-split "
                                         "over the new replicas)"]
    # without a data module's batch size the loader itself compares the global batch when it loads
    assert resume_changes(meta, None, None, replicas=4) == ([], ["data-parallel replicas (dp_size): 2 -> 4 (the rest "
                                                                 "of the epoch re-split over the new replicas)"])
    refused, _ = resume_changes(meta, None, {"batch_size": 8}, replicas=4)
    assert refused == ["data-parallel replicas (dp_size): 2 -> 4 (the checkpoint is 2 batches into an epoch; it may "
                       "resume with another dp_size if batch_size * dp_size stays 8 * 2 = 16)"]


def test_applied_changes_pass(mid_epoch, tmp_path, caplog):
    plan = preflight(_cfg(*TINY, "trainer.max_steps=10", "data.num_workers=1"), mid_epoch)
    assert plan.ckpt_path is not None and plan.ckpt_path.name == "step-2.ckpt"
    # A new batch size from an epoch boundary is applied: the position is the start of the next pass.
    boundary = _recipe_checkpoint(tmp_path, batches=0).parents[1]
    assert preflight(_cfg(*TINY, "data.batch_size=4"), boundary).ckpt_path is not None


def test_fields_only_one_side_has_are_not_compared():
    meta = {"hyper_parameters": {"config": {"n_head": 2}, "lr": 0.1}, "datamodule_hyper_parameters": {"batch_size": 8}}
    assert resume_changes(meta, {"config": {"n_head": 2, "new_field": 1}}, {"other": 1}) == ([], [])
    assert resume_changes(meta, {"config": {"n_head": 2}, "lr": 0.1, "betas": (0.9, 0.95)}) == ([], [])
    # OmegaConf containers and tuples compare by value
    from omegaconf import OmegaConf

    meta = {"hyper_parameters": {"betas": (0.9, 0.95), "config": {"n_head": 2}}}
    assert resume_changes(meta, OmegaConf.create({"betas": [0.9, 0.95], "config": {"n_head": 2}})) == ([], [])
    with pytest.raises(ValueError, match=re.escape("model betas: [0.9, 0.95] -> [0.9, 0.99]")):
        check_resume("ck", meta, {"betas": [0.9, 0.99]})


class _Heads(L.LightningModule):
    """A user's module whose number of heads does not change any parameter shape."""

    def __init__(self, n_head: int = 2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.proj = nn.Linear(8, 8)


def test_a_strategy_load_refuses_other_hyper_parameters_before_loading(tmp_path):
    """``Trainer.fit(ckpt_path=...)`` goes through the strategy's load: the check runs before any tensor is read."""
    torch.manual_seed(0)
    saved = _Heads(n_head=2)
    save_sharded(tmp_path / "c.ckpt", {"state_dict": saved.state_dict(), "hyper_parameters": dict(saved.hparams)},
                 {"strategy": "zero2"}, is_rank0=True, barrier=lambda: None)
    resumed = _Heads(n_head=4)
    state = resumed.state_dict()
    before = {k: v.clone() for k, v in state.items()}
    module_hparams = resumed.hparams
    with pytest.raises(ValueError, match=re.escape("model n_head: 2 -> 4")):
        load_sharded(tmp_path / "c.ckpt", state, before_load=lambda m: check_resume(tmp_path / "c.ckpt", m,
                                                                                    module_hparams))
    for name, value in state.items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)
    load_sharded(tmp_path / "c.ckpt", state, before_load=lambda m: check_resume("c", m, _Heads(n_head=2).hparams))
    torch.testing.assert_close(state["proj.weight"], saved.proj.weight, rtol=0, atol=0)


class _UserHeads(_Heads):
    def training_step(self, batch, batch_idx):
        return self.proj(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_trainer_fit_with_ckpt_path_refuses_other_hyper_parameters(tmp_path):
    """A user's own module and Trainer (one process, a lightning_par strategy): ``fit(ckpt_path=...)`` with a new
    ``n_head`` is refused by the strategy's load; the same ``n_head`` resumes."""
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_par  # noqa: F401 - registers the strategies

    def trainer(max_steps):
        return L.Trainer(accelerator="cpu", devices=1, strategy="zero2", max_steps=max_steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)

    def data():
        return DataLoader(TensorDataset(torch.randn(16, 8, generator=torch.Generator().manual_seed(0))), batch_size=4)

    first = trainer(2)
    first.fit(_UserHeads(n_head=2), data())
    first.save_checkpoint(tmp_path / "heads.ckpt")
    with pytest.raises(ValueError, match=re.escape("cannot be resumed with these settings: model n_head: 2 -> 4")):
        trainer(4).fit(_UserHeads(n_head=4), data(), ckpt_path=tmp_path / "heads.ckpt")
    again = trainer(4)
    again.fit(_UserHeads(n_head=2), data(), ckpt_path=tmp_path / "heads.ckpt")
    assert again.global_step == 4
