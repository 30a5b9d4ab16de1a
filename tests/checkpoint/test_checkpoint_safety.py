"""A checkpoint is data, never code: a crafted ``meta.pt``, DCP ``.metadata`` or shard entry (its commit record
rewritten to match, as an attacker with write access would) is refused naming the file and the global, and the code
it carries never runs (a marker file is never written), on every path that reads a checkpoint: the recipe's resume
(explicit path and auto-resume), a strategy's load (``Trainer.fit(ckpt_path=...)``), ``load_from_checkpoint``,
``consolidate`` and ``hf export``. Commit-record names are confined to the checkpoint directory. One process."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

from lightning_par.checkpoint import (
    RECORD_FILENAME,
    consolidate_checkpoint,
    load_from_checkpoint,
    load_model_weights,
    load_sharded,
    save_sharded,
    verify_checkpoint,
)
from lightning_par.checkpoint.consolidate import main as consolidate_main
from lightning_par.checkpoint.safe import UnsafeCheckpointError
from lightning_par.checkpoint.verify import FILES_KEY, file_manifest
from lightning_par.fault.resume import latest_checkpoint, resolve_ckpt_path
from lightning_par.hf.export import export_hf


# A Trainer run in this process starts a process group (world 1) that Lightning leaves initialised.
pytestmark = pytest.mark.usefixtures("no_process_group_left_behind")


class _RunsCode:
    """Unpickling it runs ``os.system`` (what the red team used): it writes ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


class Tiny(L.LightningModule):
    def __init__(self, width: int = 3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(width, 2)


def _save(path: Path, extra_param_group: dict | None = None) -> None:
    torch.manual_seed(0)
    module = Tiny()
    state = {"state_dict": module.state_dict(), "global_step": 2, "epoch": 0, "hyper_parameters": {"width": 3},
             "pytorch-lightning_version": L.__version__,
             "optimizer_states": [{"state": {"layer.weight": {"exp_avg": torch.ones(2, 3)}},
                                   "param_groups": [{"lr": 0.1, "params": ["layer.weight"], **(extra_param_group or {})}]}]}
    save_sharded(path, state, {"strategy": "zero2", "global_step": 2}, is_rank0=True, barrier=lambda: None)


def _rerecord(ckpt: Path) -> None:
    """Rewrite the commit record's sizes and checksums to match the files (what a tamperer does)."""
    record = json.loads((ckpt / RECORD_FILENAME).read_text())
    record[FILES_KEY] = file_manifest(ckpt, exclude=(RECORD_FILENAME,))
    (ckpt / RECORD_FILENAME).write_text(json.dumps(record))


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("clean")
    _save(root / "step-2.ckpt")
    return root / "step-2.ckpt"


def _crafted(tmp_path: Path, clean: Path, file: str, marker: Path) -> Path:
    """A copy of ``clean`` as ``checkpoints/step-4.ckpt`` whose ``file`` carries code, the record matching."""
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir(parents=True)
    shutil.copytree(clean, ckpts / "step-2.ckpt")
    ckpt = ckpts / "step-4.ckpt"
    if file == "shard entry":
        _save(ckpt, {"evil": _RunsCode(marker)})  # DCP writes the param group's value as a torch.save'd entry
    else:
        shutil.copytree(clean, ckpt)
        if file == "meta.pt":
            meta = torch.load(ckpt / "meta.pt", weights_only=True)
            torch.save({**meta, "callbacks": {"x": _RunsCode(marker)}}, ckpt / "meta.pt")
        else:
            metadata = pickle.loads((ckpt / ".metadata").read_bytes())
            metadata.storage_meta = _RunsCode(marker)
            (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    _rerecord(ckpt)
    verify_checkpoint(ckpt, checksums=False)  # the record matches: only the reader can tell
    return ckpt


CRAFTED = {"meta.pt": r"meta\.pt asks for the global posix\.system",
           ".metadata": r"\.metadata asks for the global posix\.system",
           "shard entry": r"__0_0\.distcp \(entry 'optimizer_0\.param_groups\.0\.evil'\) asks for the global "
                          r"posix\.system"}


def test_the_crafted_files_do_run_code_when_unpickled_unrestricted(tmp_path, clean):
    """The control: each payload is real (plain pickle / weights_only=False runs it), so the refusals below count."""
    for file in CRAFTED:
        marker = tmp_path / f"marker-{file.strip('.').replace(' ', '-')}"
        ckpt = _crafted(tmp_path / file.strip(".").replace(" ", "-"), clean, file, marker)
        if file == "meta.pt":
            torch.load(ckpt / "meta.pt", weights_only=False)
        elif file == ".metadata":
            pickle.loads((ckpt / ".metadata").read_bytes())
        else:
            import torch.distributed.checkpoint as dcp

            request = {"state_dict": Tiny().state_dict(), "optimizer_0": {
                "state": {"layer.weight": {"exp_avg": torch.zeros(2, 3)}},
                "param_groups": [{"lr": 0.0, "params": ["layer.weight"], "evil": None}]}}
            dcp.load(request, checkpoint_id=ckpt, no_dist=True)
        assert marker.exists(), file


@pytest.mark.parametrize("file", list(CRAFTED))
def test_a_crafted_checkpoint_is_refused_without_running_code(tmp_path, clean, file):
    marker = tmp_path / "marker"
    ckpt = _crafted(tmp_path, clean, file, marker)
    ckpts, message = ckpt.parent, CRAFTED[file]
    # The recipe's resume, before any process starts: a path, 'last' and auto-resume (never skipped for step-2).
    with pytest.raises(ValueError, match=rf"ckpt_path='.*step-4\.ckpt' is not valid: .*refused: its {message}"):
        resolve_ckpt_path(str(ckpt), ckpts)
    for ckpt_path in (None, "last"):
        with pytest.raises(UnsafeCheckpointError, match=message):
            resolve_ckpt_path(ckpt_path, ckpts)
    with pytest.raises(UnsafeCheckpointError, match=message):
        latest_checkpoint(ckpts)
    # A strategy's load (Trainer.fit(ckpt_path=...)): refused before any tensor is read.
    weights = Tiny().state_dict()
    before = {k: v.clone() for k, v in weights.items()}
    optimizer = [{"state": {"layer.weight": {"exp_avg": torch.zeros(2, 3)}},
                  "param_groups": [{"lr": 0.0, "params": ["layer.weight"], "evil": None}]}]
    with pytest.raises(UnsafeCheckpointError, match=message):
        load_sharded(ckpt, weights, optimizer)
    for name, value in weights.items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)  # nothing was loaded
    # One-process readers: load_from_checkpoint, load_model_weights, consolidate (function and command), hf export.
    with pytest.raises(UnsafeCheckpointError, match=message):
        load_from_checkpoint(Tiny, ckpt)
    with pytest.raises(UnsafeCheckpointError, match=message):
        load_model_weights(ckpt, Tiny())
    with pytest.raises(UnsafeCheckpointError, match=message):
        consolidate_checkpoint(ckpt, tmp_path / "out.ckpt")
    with pytest.raises(UnsafeCheckpointError, match=message):
        consolidate_main([str(ckpt), str(tmp_path / "out2.ckpt")])
    with pytest.raises(UnsafeCheckpointError, match=message):
        export_hf(ckpt, tmp_path / "hf")
    assert not marker.exists()
    assert not (tmp_path / "out.ckpt").exists() and not (tmp_path / "hf").exists()


def test_a_clean_checkpoint_still_loads_everywhere(tmp_path, clean):
    """The allow-lists let through what lightning_par writes (the fixture and the GPT/HF tests' checkpoints)."""
    meta = load_model_weights(clean, module := Tiny())
    assert meta["global_step"] == 2 and meta["hyper_parameters"] == {"width": 3}
    torch.manual_seed(0)
    torch.testing.assert_close(module.layer.weight, Tiny().layer.weight, rtol=0, atol=0)
    optimizer = [{"state": {"layer.weight": {"exp_avg": torch.zeros(2, 3)}},
                  "param_groups": [{"lr": 0.0, "params": ["layer.weight"]}]}]
    load_sharded(clean, Tiny().state_dict(), optimizer)
    assert optimizer[0]["param_groups"][0]["lr"] == 0.1
    torch.testing.assert_close(optimizer[0]["state"]["layer.weight"]["exp_avg"], torch.ones(2, 3))
    assert load_from_checkpoint(Tiny, clean).hparams.width == 3
    out = consolidate_checkpoint(clean, tmp_path / "one.ckpt")
    assert Tiny.load_from_checkpoint(out).hparams.width == 3  # Lightning's own reader (weights_only by default)


@pytest.mark.parametrize("name", ["../../etc/shadow", "/etc/shadow", "..", "sub/meta.pt", "link"])
def test_record_names_are_confined_to_the_checkpoint(tmp_path, clean, name):
    ckpt = tmp_path / "step-2.ckpt"
    shutil.copytree(clean, ckpt)
    outside = tmp_path / "secret"
    outside.write_text("x" * 37)
    (ckpt / "link").symlink_to(outside)
    record = json.loads((ckpt / RECORD_FILENAME).read_text())
    record[FILES_KEY][name] = {"bytes": 1, "crc32": "00000000"}
    (ckpt / RECORD_FILENAME).write_text(json.dumps(record))
    with pytest.raises(UnsafeCheckpointError, match=r"lightning_par\.json names the file " + re.escape(repr(name))) as info:
        verify_checkpoint(ckpt)
    # nothing about the outside file is told (its size; the path of pytest's temporary folder may hold any digits)
    assert "37" not in str(info.value).replace(str(tmp_path), "<tmp>")


def test_a_shard_named_outside_the_checkpoint_is_refused(tmp_path, clean):
    ckpt = tmp_path / "step-2.ckpt"
    shutil.copytree(clean, ckpt)
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../../etc/passwd"
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    _rerecord(ckpt)
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata names the file '\.\./\.\./etc/passwd'"):
        verify_checkpoint(ckpt)


def test_last_ckpt_links_only_a_committed_background_save(tmp_path):
    """``last.ckpt`` moves to a background save only when it commits: a failed (or killed) one leaves it on the
    newest committed checkpoint, never dangling."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from lightning_par.checkpoint.async_save import PendingSave
    from lightning_par.checkpoint.atomic import staging_dir
    from lightning_par.checkpoint.sharded import _write
    from lightning_par.fault.step_checkpoint import StepCheckpoint

    callback = StepCheckpoint(tmp_path, every_n_steps=2, async_save=True)
    _save(tmp_path / "step-2.ckpt")
    link = tmp_path / "last.ckpt"
    os.symlink("step-2.ckpt", link)

    def pending_save(step: int, error: BaseException | None) -> PendingSave:
        future: Future = Future()
        future.set_exception(error) if error else future.set_result(None)
        _write(staging_dir(tmp_path / f"step-{step}.ckpt"), {"state_dict": Tiny().state_dict(), "global_step": step},
               {"global_step": step}, is_rank0=True)
        return PendingSave(tmp_path / f"step-{step}.ckpt", future, {"global_step": step}, True, lambda: None)

    for step, error in ((4, OSError(28, "No space left on device")), (6, None)):
        pending = pending_save(step, error)
        trainer = SimpleNamespace(strategy=SimpleNamespace(_pending_save=pending, barrier=lambda: None),
                                  is_global_zero=True)
        callback._link_checkpoint(trainer, str(tmp_path / f"step-{step}.ckpt"), str(link))  # what Lightning calls
        assert os.readlink(link) == "step-2.ckpt"  # not yet: the save is pending
        if error is None:
            pending.commit()
            assert os.readlink(link) == "step-6.ckpt" and verify_checkpoint(link)["global_step"] == 6
        else:
            with pytest.raises(OSError, match="No space left"):
                pending.commit()
            assert os.readlink(link) == "step-2.ckpt" and not (tmp_path / "step-4.ckpt").exists()
    # A synchronous save links at once, as Lightning does.
    trainer = SimpleNamespace(strategy=SimpleNamespace(_pending_save=None, barrier=lambda: None), is_global_zero=True)
    callback._link_checkpoint(trainer, str(tmp_path / "step-2.ckpt"), str(link))
    assert os.readlink(link) == "step-2.ckpt"


def test_a_checkpoint_file_that_cannot_be_written_whole_is_named(tmp_path):
    """Under a file-size limit torch.save says only ``unexpected pos 704 vs 598``; the error names the file, and a
    save that fails so keeps nothing (the previous checkpoint stays)."""
    import resource

    from lightning_par.checkpoint.atomic import staging_dir

    _save(tmp_path / "step-2.ckpt")
    largest_shard = max(p.stat().st_size for p in (tmp_path / "step-2.ckpt").iterdir() if p.name != "meta.pt")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    big = {"state_dict": Tiny().state_dict(), "global_step": 4, "notes": "x" * (largest_shard + 4096)}
    for limit, file, says in ((largest_shard + 100, r"step-2\.ckpt\.tmp-staging/meta\.pt' failed", "unexpected pos"),
                              (64, r"the shards of '.*step-2\.ckpt\.tmp-staging' failed", "File too large")):
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))  # Python ignores SIGXFSZ: writes fail with EFBIG
        try:
            with pytest.raises(OSError, match=file) as info:
                save_sharded(tmp_path / "step-2.ckpt", dict(big), {}, is_rank0=True, barrier=lambda: None)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        assert says in str(info.value), str(info.value)
    assert verify_checkpoint(tmp_path / "step-2.ckpt")["global_step"] == 2
    assert not staging_dir(tmp_path / "step-2.ckpt").exists()


def test_hf_hyper_parameters_cannot_ask_for_remote_code(tmp_path):
    """``load_from_checkpoint`` and ``hf export`` build the model from the checkpoint's hyper-parameters: a crafted
    ``config.trust_remote_code`` would import Python files of a config.json's ``auto_map``; it is refused."""
    from lightning_par.hf import HFCausalLM
    from lightning_par.hf.export import hf_config_of

    with pytest.raises(ValueError, match=r"HFCausalLM config=.*trust_remote_code.* is not valid: expected config fields "
                                         r"only, without the loader options"):
        HFCausalLM(model_type="llama", config={"trust_remote_code": True, "hidden_size": 32})
    meta = {"hyper_parameters": {"pretrained": str(tmp_path), "config": {"trust_remote_code": True}}}
    with pytest.raises(ValueError, match=r"pass \['trust_remote_code'\] to transformers"):
        hf_config_of(meta)
