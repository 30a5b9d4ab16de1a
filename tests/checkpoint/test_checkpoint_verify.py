"""The one checkpoint format refuses what it cannot load, before loading and with what to do: a missing checkpoint
(and the staging directory an interrupted save left), a single file, a torn or partial directory, a damaged record,
a newer format, and a checkpoint of another model. One process: DCP saves and loads without a process group."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from lightning_par.checkpoint import (
    FORMAT_VERSION,
    RECORD_FILENAME,
    is_sharded_checkpoint,
    load_model_weights,
    read_record,
    save_sharded,
)
from lightning_par.checkpoint import sharded
from lightning_par.checkpoint.atomic import staging_dir
from lightning_par.fault.resume import resolve_ckpt_path


def _save(path, module: nn.Module, step: int = 3) -> None:
    checkpoint = {"state_dict": module.state_dict(), "optimizer_states": [], "global_step": step}
    save_sharded(path, checkpoint, {"strategy": "zero2", "layout": {"dp_size": 2}, "global_step": step},
                 is_rank0=True, barrier=lambda: None)


def test_a_complete_checkpoint_records_what_wrote_it(tmp_path):
    path = tmp_path / "ok.ckpt"
    torch.manual_seed(0)
    module = nn.Linear(3, 2)
    _save(path, module)
    assert is_sharded_checkpoint(path)
    record = read_record(path)
    assert record["format_version"] == FORMAT_VERSION and record["strategy"] == "zero2" and record["global_step"] == 3
    fresh = nn.Linear(3, 2)
    load_model_weights(path, fresh)
    torch.testing.assert_close(fresh.weight, module.weight, rtol=0, atol=0)
    assert resolve_ckpt_path(str(path), tmp_path) == path.resolve()


def test_an_interrupted_save_is_named_and_the_previous_checkpoint_stays(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    module = nn.Linear(3, 2)
    _save(path, module, step=1)

    def crash(*args, **kwargs):
        original(*args, **kwargs)
        raise RuntimeError("killed mid-save")

    original = sharded._write
    monkeypatch.setattr(sharded, "_write", crash)
    with pytest.raises(RuntimeError, match="killed mid-save"):
        _save(path, module, step=2)
    assert read_record(path)["global_step"] == 1  # the previous checkpoint is whole and in place
    assert not staging_dir(path).exists()  # a failed save (a full disk) removes what it wrote
    fresh_path = tmp_path / "never.ckpt"
    with pytest.raises(RuntimeError):
        _save(fresh_path, module)
    assert not staging_dir(fresh_path).exists()
    staging_dir(fresh_path).mkdir()  # what a save killed by SIGKILL leaves
    with pytest.raises(FileNotFoundError, match=r"does not exist\. .*never\.ckpt\.tmp-staging.* was interrupted"):
        read_record(fresh_path)


@pytest.mark.parametrize(
    "damage,match",
    [
        ("file", r"is a file, not a lightning_par checkpoint"),
        ("no_metadata", r"is incomplete or not a lightning_par checkpoint: it lacks \['\.metadata'\]"),
        ("no_record", r"lacks \['lightning_par\.json'\]"),
        ("garbage_record", r"has an unreadable lightning_par\.json"),
        ("newer", rf"format_version={FORMAT_VERSION + 1}, newer than this lightning_par's {FORMAT_VERSION}"),
    ],
)
def test_damaged_checkpoints_are_refused_with_what_to_do(tmp_path, damage, match):
    path = tmp_path / "c.ckpt"
    if damage == "file":
        torch.save({"state_dict": {}}, path)
    else:
        _save(path, nn.Linear(3, 2))
        if damage == "no_metadata":
            (path / ".metadata").unlink()
        elif damage == "no_record":
            (path / RECORD_FILENAME).unlink()
        elif damage == "garbage_record":
            (path / RECORD_FILENAME).write_text("\\x00 not json")
        elif damage == "newer":
            record = json.loads((path / RECORD_FILENAME).read_text())
            (path / RECORD_FILENAME).write_text(json.dumps({**record, "format_version": FORMAT_VERSION + 1}))
    with pytest.raises(ValueError, match=match):
        read_record(path)
    with pytest.raises(ValueError, match=r"ckpt_path='.*c\.ckpt' is not valid: .*" + match.split(r"\[")[0][:20]):
        resolve_ckpt_path(str(path), tmp_path)  # the recipe refuses it before any process starts
    if damage != "file":
        assert not is_sharded_checkpoint(path) or damage in ("garbage_record", "newer")


def test_a_checkpoint_of_another_model_names_what_wrote_it(tmp_path):
    path = tmp_path / "c.ckpt"
    _save(path, nn.Linear(3, 2))
    with pytest.raises(ValueError, match=r"does not fit this model or optimizer: .*written by strategy=zero2"):
        load_model_weights(path, nn.Linear(4, 2))
