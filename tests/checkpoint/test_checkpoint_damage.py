"""A damaged newest checkpoint is skipped, naming the file and what is wrong, and the resume falls back to the newest
intact one (auto-resume and ``ckpt_path=last``); ``ckpt_path=PATH`` to a damaged one is an error naming the file.
Leftovers of interrupted saves are removed; a checkpoint of another model names the first mismatched tensor.

Two real checkpoints are written once (one process: DCP saves without a process group) and damaged in copies."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_par.checkpoint import RECORD_FILENAME, load_model_weights, save_sharded, verify_checkpoint
from lightning_par.checkpoint.atomic import remove_leftovers, staging_dir
from lightning_par.checkpoint.verify import FILES_KEY
from lightning_par.fault.resume import latest_checkpoint, resolve_ckpt_path

SHARD = "__0_0.distcp"


def _save(path: Path, module: nn.Module, step: int) -> None:
    state = {"state_dict": module.state_dict(), "global_step": step,
             "optimizer_states": [{"state": {"weight": {"exp_avg": torch.full((2, 3), float(step))}},
                                   "param_groups": [{"lr": 0.1, "params": ["weight"]}]}]}
    save_sharded(path, state, {"strategy": "zero2", "global_step": step}, is_rank0=True, barrier=lambda: None)


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpts")
    torch.manual_seed(0)
    module = nn.Linear(3, 2)
    _save(root / "step-2.ckpt", module, 2)
    with torch.no_grad():
        module.weight.add_(1.0)
    _save(root / "step-4.ckpt", module, 4)
    return root


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))


DAMAGE = {
    "deleted": (lambda p: p.unlink(), "is missing"),
    "truncated": (_truncate, r"has \d+ bytes, the record says \d+"),
    "emptied": (lambda p: p.write_bytes(b""), r"is empty, the record says \d+"),
}
#: (file, damage) -> what the message says, for the 12 variants of the issue and the record and a flipped byte.
VARIANTS = {(f, d): (f, m) for f in (SHARD, ".metadata", "meta.pt") for d, (_, m) in DAMAGE.items()}
VARIANTS.update({
    (".metadata", "deleted"): ("", r"it lacks \['\.metadata'\]"),
    ("meta.pt", "deleted"): ("", r"it lacks \['meta\.pt'\]"),
    (RECORD_FILENAME, "deleted"): ("", r"it lacks \['lightning_par\.json'\]"),
    (RECORD_FILENAME, "truncated"): ("", r"has an unreadable lightning_par\.json"),
    (RECORD_FILENAME, "emptied"): ("", r"has an unreadable lightning_par\.json"),
    (RECORD_FILENAME, "no file list"): (RECORD_FILENAME, r"has an unreadable file list"),
    (SHARD, "one byte flipped"): (SHARD, r"has CRC-32 [0-9a-f]{8}, the record says [0-9a-f]{8}"),
})


def _damage(ckpt: Path, file: str, how: str) -> None:
    target = ckpt / file
    if how == "no file list":
        record = json.loads(target.read_text())
        target.write_text(json.dumps({**record, FILES_KEY: {}}))
    elif how == "one byte flipped":
        _flip(target)
    else:
        DAMAGE[how][0](target)


@pytest.mark.parametrize(("file", "how"), list(VARIANTS), ids=[f"{f}-{d}" for f, d in VARIANTS])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(two_checkpoints, tmp_path, file, how):
    ckpts = tmp_path / "checkpoints"
    shutil.copytree(two_checkpoints, ckpts)
    assert latest_checkpoint(ckpts) == ckpts / "step-4.ckpt"
    _damage(ckpts / "step-4.ckpt", file, how)
    named, what = VARIANTS[(file, how)]
    expected = re.escape(str(ckpts / "step-4.ckpt")) + r".*" + re.escape(named) + r".*" + what

    skipped: list[tuple[Path, str]] = []
    assert latest_checkpoint(ckpts, on_skip=lambda p, why: skipped.append((p, why))) == ckpts / "step-2.ckpt"
    assert len(skipped) == 1 and skipped[0][0] == ckpts / "step-4.ckpt"
    assert re.search(expected, skipped[0][1]), skipped[0][1]
    assert resolve_ckpt_path(None, ckpts) == ckpts / "step-2.ckpt"  # auto-resume
    assert resolve_ckpt_path("last", ckpts) == ckpts / "step-2.ckpt"
    with pytest.raises(ValueError, match=r"ckpt_path='.*step-4\.ckpt' is not valid: .*" + what):
        resolve_ckpt_path(str(ckpts / "step-4.ckpt"), ckpts)
    # The fall-back checkpoint loads: the weights of step 2.
    module = nn.Linear(3, 2)
    assert load_model_weights(ckpts / "step-2.ckpt", module)["global_step"] == 2
    torch.manual_seed(0)
    torch.testing.assert_close(module.weight, nn.Linear(3, 2).weight, rtol=0, atol=0)


def test_every_file_is_recorded_with_its_size_and_checksum(two_checkpoints):
    record = verify_checkpoint(two_checkpoints / "step-4.ckpt")
    files = record[FILES_KEY]
    assert sorted(files) == sorted([SHARD, ".metadata", "meta.pt"])
    for name, entry in files.items():
        assert entry["bytes"] == (two_checkpoints / "step-4.ckpt" / name).stat().st_size > 0
        assert re.fullmatch(r"[0-9a-f]{8}", entry["crc32"])


def test_a_checkpoint_of_another_model_names_the_first_mismatched_tensor(two_checkpoints):
    path = two_checkpoints / "step-2.ckpt"
    with pytest.raises(ValueError) as info:
        load_model_weights(path, nn.Linear(4, 2))
    message = str(info.value)
    assert "parameter or buffer 'weight' has shape (2, 3) in the checkpoint and (2, 4) here" in message, message
    assert "FrameSummary" not in message and "written by strategy=zero2" in message

    class Renamed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(3, 2)

    with pytest.raises(ValueError, match=r"the checkpoint has no parameter or buffer 'proj\.weight' \(this model"):
        load_model_weights(path, Renamed())


def test_leftovers_of_interrupted_saves_are_removed(tmp_path):
    keep = tmp_path / "step-2.ckpt"
    keep.mkdir()
    staging_dir(tmp_path / "step-4.ckpt").mkdir()
    (staging_dir(tmp_path / "step-4.ckpt") / SHARD).write_bytes(b"partial")
    (tmp_path / "step-2.ckpt.tmp-old").mkdir()  # its checkpoint is in place: a leftover
    (tmp_path / "step-6.ckpt.tmp-old").mkdir()  # the only copy of step 6: kept
    removed = remove_leftovers(tmp_path)
    assert sorted(p.name for p in removed) == ["step-2.ckpt.tmp-old", "step-4.ckpt.tmp-staging"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2.ckpt", "step-6.ckpt.tmp-old"]
    assert remove_leftovers(tmp_path / "absent") == []


def test_param_group_hyper_parameters_load_as_the_checkpoint_holds_them(two_checkpoints):
    """As ``Optimizer.load_state_dict``: the saved groups' keys replace the current ones. Lightning's ``lr_find`` adds
    ``initial_lr`` (its scheduler) between its save and its restore; DCP refused that restore under every strategy."""
    from lightning_par.checkpoint.sharded import load_sharded

    module = nn.Linear(3, 2)
    optimizer = {"state": {"weight": {"exp_avg": torch.zeros(2, 3)}},
                 "param_groups": [{"lr": 0.5, "initial_lr": 0.5, "params": ["weight"]}]}  # gained initial_lr; lost none
    states = [optimizer]
    load_sharded(two_checkpoints / "step-4.ckpt", module.state_dict(), states)
    assert states[0]["param_groups"] == [{"lr": 0.1, "params": ["weight"]}]
    assert torch.equal(states[0]["state"]["weight"]["exp_avg"], torch.full((2, 3), 4.0))
    lost = [{"state": {"weight": {"exp_avg": torch.zeros(2, 3)}}, "param_groups": [{"params": ["weight"]}]}]
    load_sharded(two_checkpoints / "step-4.ckpt", module.state_dict(), lost)  # a key the optimizer lost is read back
    assert lost[0]["param_groups"] == [{"params": ["weight"], "lr": 0.1}]
