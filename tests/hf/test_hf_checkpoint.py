"""Hugging Face checkpoints in one process: ``HFCausalLM(pretrained=DIR)`` loads the safetensors, ``export_hf`` writes a
``from_pretrained`` directory shard by shard (tied and untied heads), ``load_from_checkpoint`` reads checkpoint
directories for any LightningModule, and bad inputs are refused with what to do."""

from __future__ import annotations

import json
import re

import lightning as L
import pytest
import torch
from torch import nn

from lightning_par.checkpoint import ShardedCheckpointLoading, load_from_checkpoint, save_sharded
from lightning_par.hf import HFCausalLM
from lightning_par.hf.export import export_hf

LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=96, max_position_embeddings=64)
X = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))


def save_checkpoint(module: L.LightningModule, path) -> None:
    """What a strategy writes, in one process: the DCP shards of the state dict, ``meta.pt`` and the record."""
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams), "epoch": 0,
                  "pytorch-lightning_version": L.__version__,
                  "global_step": 0}
    if hasattr(module, "on_save_checkpoint"):
        module.on_save_checkpoint(checkpoint)
    save_sharded(path, checkpoint, {"strategy": "test"}, is_rank0=True, barrier=lambda: None)


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=X).logits


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny Llama written by ``save_pretrained`` (tied embeddings)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(3)
    directory = tmp_path_factory.mktemp("llama")
    AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA, tie_word_embeddings=True)).save_pretrained(directory)
    return directory


def test_pretrained_weights_loaded_in_one_process(pretrained):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    module = HFCausalLM(pretrained=str(pretrained))
    reference = AutoModelForCausalLM.from_pretrained(pretrained, local_files_only=True)
    assert module.pretrained_bytes_read > 0
    torch.testing.assert_close(logits(module.model), logits(reference), rtol=0, atol=0)
    assert module.model.lm_head.weight is module.model.model.embed_tokens.weight  # still tied


@pytest.mark.parametrize("tied", [True, False])
def test_export_round_trip(tmp_path, tied):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    module = HFCausalLM(model_type="qwen2", config={**LLAMA, "tie_word_embeddings": tied})
    save_checkpoint(module, tmp_path / "step.ckpt")
    out = export_hf(tmp_path / "step.ckpt", tmp_path / "hf", max_shard_bytes=30_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((out / f).is_file() for f in files) and (out / "config.json").is_file()
    assert ("lm_head.weight" in index["weight_map"]) is not tied
    exported = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert exported.config.model_type == "qwen2" and exported.config.tie_word_embeddings is tied
    torch.testing.assert_close(logits(exported), logits(module.model), rtol=0, atol=1e-6)


def test_export_copies_the_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from tests.data.test_tokenizer import word_level

    torch.manual_seed(0)
    save_checkpoint(HFCausalLM(model_type="llama", config=LLAMA), tmp_path / "step.ckpt")
    tok = word_level(tmp_path / "tok")
    out = export_hf(tmp_path / "step.ckpt", tmp_path / "hf", tokenizer=tok)
    assert AutoTokenizer.from_pretrained(str(out), local_files_only=True).encode("w1 w5", add_special_tokens=False) == [3, 7]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=re.escape(f"tokenizer='{tmp_path / 'empty'}' is not valid: it holds none of")):
        export_hf(tmp_path / "step.ckpt", tmp_path / "hf2", tokenizer=tmp_path / "empty")


def test_export_streams_one_shard_at_a_time(tmp_path, monkeypatch):
    """Each shard's tensors are read from the checkpoint by one ``dcp.load`` of that shard's names only."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    module = HFCausalLM(model_type="llama", config=LLAMA)
    save_checkpoint(module, tmp_path / "step.ckpt")
    loads: list[list[str]] = []
    real_load = dcp.load

    def recording_load(state, **kwargs):
        loads.append(sorted(state["state_dict"]))
        return real_load(state, **kwargs)

    monkeypatch.setattr(dcp, "load", recording_load)
    out = export_hf(tmp_path / "step.ckpt", tmp_path / "hf", max_shard_bytes=30_000)
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert len(loads) == len(shards) > 1
    for names, shard in zip(loads, shards):
        assert names == sorted(f"model.{n}" for n, f in weight_map.items() if f == shard)


def test_bad_pretrained_directories(tmp_path, pretrained):
    with pytest.raises(ValueError, match=re.escape("HFCausalLM pretrained='/no/such/model' is not valid: expected a "
                                                   "local directory written by save_pretrained")):
        HFCausalLM(pretrained="/no/such/model")
    (tmp_path / "config.json").write_text((pretrained / "config.json").read_text())  # a config, no weights
    with pytest.raises(ValueError, match=re.escape(f"model.pretrained='{tmp_path}' is not valid: it has no "
                                                   f"model.safetensors and no model.safetensors.index.json")):
        HFCausalLM(pretrained=str(tmp_path))
    with pytest.raises(ValueError, match=r"does not fit this model: 'model.embed_tokens.weight' has shape \(96, 32\)"):
        HFCausalLM(pretrained=str(pretrained), config={"hidden_size": 64, "intermediate_size": 64})


def test_bad_exports(tmp_path):
    from tests.support.p3d import make_gpt

    save_checkpoint(make_gpt(), tmp_path / "gpt.ckpt")
    with pytest.raises(ValueError, match="it holds no Hugging Face config"):
        export_hf(tmp_path / "gpt.ckpt", tmp_path / "out")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ValueError, match=re.escape(f"output='{tmp_path / 'full'}' is not valid: it exists")):
        export_hf(tmp_path / "gpt.ckpt", tmp_path / "full")
    with pytest.raises(ValueError, match="max_shard_bytes=0 is not valid: expected a positive number of bytes"):
        export_hf(tmp_path / "gpt.ckpt", tmp_path / "out", max_shard_bytes=0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export_hf(tmp_path / "nothing.ckpt", tmp_path / "out")


class UserModule(L.LightningModule):
    """A user's own module: no lightning_par base."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 2))


class UserModuleWithMixin(ShardedCheckpointLoading, UserModule):
    pass


def test_load_from_checkpoint_directory_for_any_module(tmp_path):
    torch.manual_seed(0)
    trained = UserModule(width=6)
    save_checkpoint(trained, tmp_path / "u.ckpt")
    for loaded in (UserModule.load_from_checkpoint(tmp_path / "u.ckpt"),  # Lightning's own call (issue 32)
                   load_from_checkpoint(UserModule, tmp_path / "u.ckpt"),
                   UserModuleWithMixin.load_from_checkpoint(str(tmp_path / "u.ckpt"))):
        assert loaded.hparams.width == 6
        for (name, a), b in zip(loaded.state_dict().items(), trained.state_dict().values()):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    (tmp_path / "torn.ckpt").mkdir()
    with pytest.raises(ValueError, match="is incomplete or not a lightning_par checkpoint"):
        UserModuleWithMixin.load_from_checkpoint(tmp_path / "torn.ckpt")


def test_under_a_launcher_the_weights_load_when_the_trainer_starts(pretrained, monkeypatch):
    """``WORLD_SIZE`` > 1: nothing is read when the module is built (each rank reads its blocks once the strategy has
    split the model); ``Trainer.validate`` then evaluates the pretrained weights."""
    from transformers import AutoModelForCausalLM

    from tests.support.helpers import quiet_trainer

    monkeypatch.setenv("WORLD_SIZE", "2")
    torch.manual_seed(0)
    module = HFCausalLM(pretrained=str(pretrained))
    monkeypatch.delenv("WORLD_SIZE")
    reference = AutoModelForCausalLM.from_pretrained(pretrained, local_files_only=True)
    assert not torch.equal(module.model.model.embed_tokens.weight, reference.model.embed_tokens.weight)
    y = torch.roll(X, -1, dims=1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=2)
    metrics = quiet_trainer("auto", 1).validate(module, loader, verbose=False)
    expected = float(HFCausalLM.loss_fn(logits(reference), y))
    assert metrics[0]["val_loss"] == pytest.approx(expected, rel=1e-6)
    assert module.pretrained_bytes_read > 0


@pytest.mark.parametrize(("pretrained_dir", "message"), [
    ("/no/such/model", "HFCausalLM pretrained='/no/such/model' is not valid: expected a local directory"),
    ("{config_only}", "model.pretrained='{config_only}' is not valid: it has no model.safetensors"),
], ids=["missing", "config-only"])
def test_bad_pretrained_refused_before_any_process_starts(tmp_path, pretrained, monkeypatch, pretrained_dir, message):
    """Through the recipe: the launching process builds the module on the meta device, which checks the files'
    names and shapes (headers only) without reading weights."""
    from hydra import compose, initialize_config_dir

    import lightning_par.train as train
    from lightning_par.config.schema import register_configs
    from tests.config.test_compose import CONF

    def refuse(*args, **kwargs):
        raise AssertionError("a process was about to start")

    register_configs()
    monkeypatch.setattr(train, "run_distributed", refuse)
    monkeypatch.setattr(train, "train_worker", refuse)
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "config.json").write_text((pretrained / "config.json").read_text())
    directory = pretrained_dir.format(config_only=config_only)
    overrides = ["model=custom", "model._target_=lightning_par.hf.HFCausalLM", f"+model.pretrained={directory}",
                 "data=synthetic", "data.block_size=16", "trainer=smoke"]
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose("config", overrides=overrides)
    with pytest.raises(ValueError, match=re.escape(message.format(config_only=config_only))):
        train.launch_job(cfg, tmp_path / "run")


def test_load_from_checkpoint_reads_no_pretrained_weights(pretrained, tmp_path, monkeypatch):
    """A checkpoint of a module built from ``pretrained=DIR``: the checkpoint's weights are loaded, the pretrained
    safetensors are not read."""
    import lightning_par.hf.module as hf_module

    torch.manual_seed(0)
    module = HFCausalLM(pretrained=str(pretrained))
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.5)  # "trained"
    save_checkpoint(module, tmp_path / "ft.ckpt")
    monkeypatch.setattr(hf_module, "load_hf_weights", lambda *a, **k: pytest.fail("pretrained weights were read"))
    loaded = HFCausalLM.load_from_checkpoint(tmp_path / "ft.ckpt")
    assert loaded.hparams.pretrained == str(pretrained)
    torch.testing.assert_close(logits(loaded.model), logits(module.model), rtol=0, atol=0)


def test_a_module_without_the_mixin_loads_the_directory_with_lightnings_own_call(tmp_path):
    """Lightning 2.6 opens load_from_checkpoint's argument as one file (no hook for a directory); importing
    lightning_par wraps that one function, so a user's module without the mixin loads a checkpoint directory with
    Lightning's own call, and a single-file checkpoint still goes to Lightning unchanged."""
    import lightning_par  # noqa: F401  (installs the directory loading)

    torch.manual_seed(0)
    trained = UserModule(width=5)
    path = tmp_path / "u.ckpt"
    save_checkpoint(trained, path)
    loaded = UserModule.load_from_checkpoint(path)
    assert loaded.hparams.width == 5
    for (name, p), q in zip(trained.named_parameters(), loaded.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)
    single = tmp_path / "single.ckpt"
    torch.save({"state_dict": trained.state_dict(), "hyper_parameters": {"width": 5},
                "pytorch-lightning_version": "2.6.0"}, single)
    assert UserModule.load_from_checkpoint(single).hparams.width == 5
