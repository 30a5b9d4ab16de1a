"""``export_hf`` never leaves a half-written copy (issue 50): it writes beside the output and moves the finished
directory into place, so a failure leaves the output as it was and no staging copy; an output that is a symbolic link
(to an empty directory, or dangling), a mount point, a file or a non-empty directory is refused before anything is
written, naming why."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from lightning_par.hf import HFCausalLM
from lightning_par.hf.export import export_hf
from tests.hf.test_hf_checkpoint import LLAMA, save_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("ckpt") / "step.ckpt"
    save_checkpoint(HFCausalLM(model_type="llama", config=LLAMA), path)
    return path


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("kind", ["symlink_to_empty_dir", "dangling_symlink"])
def test_a_symlinked_output_is_refused_before_anything_is_written(tmp_path: Path, checkpoint: Path, kind: str) -> None:
    target = tmp_path / "target"
    if kind == "symlink_to_empty_dir":
        target.mkdir()
    out = tmp_path / "out"
    out.symlink_to(target)
    before = _tree(tmp_path)
    with pytest.raises(ValueError, match=re.escape(f"output='{out}' is not valid: it is a symbolic link (to "
                                                   f"'{target}')")):
        export_hf(checkpoint, out)
    assert _tree(tmp_path) == before  # no staging copy, the target untouched


def test_a_mount_point_is_refused_before_anything_is_written(tmp_path: Path, checkpoint: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "mnt"
    out.mkdir()
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == out or real(p))  # no mount is made by a test
    with pytest.raises(ValueError, match=re.escape(f"output='{out}' is not valid: it is a mount point")):
        export_hf(checkpoint, out)
    assert _tree(tmp_path) == ["mnt"]


def test_a_non_empty_directory_or_a_file_is_refused(tmp_path: Path, checkpoint: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ValueError, match=r"it exists and is not an empty directory \(it holds 1 entries\)"):
        export_hf(checkpoint, tmp_path / "full")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"it exists and is not an empty directory \(a file\)"):
        export_hf(checkpoint, tmp_path / "file")
    assert _tree(tmp_path) == ["file", "full", "full/x"]


@pytest.mark.parametrize("existing", [False, True])
def test_a_failure_leaves_the_output_as_it_was(tmp_path: Path, checkpoint: Path, monkeypatch: pytest.MonkeyPatch,
                                               existing: bool) -> None:
    """The second shard's write fails: no output (or the empty directory still empty), no staging copy."""
    import safetensors.torch

    out = tmp_path / "hf"
    if existing:
        out.mkdir()
    real, calls = safetensors.torch.save_file, []

    def failing(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", failing)
    with pytest.raises(OSError, match="No space left on device"):
        export_hf(checkpoint, out, max_shard_bytes=30_000)
    assert len(calls) == 2 and Path(calls[0]).parent.name.startswith(".hf.exporting-")  # written beside the output
    assert _tree(tmp_path) == (["hf"] if existing else [])
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    assert (export_hf(checkpoint, out, max_shard_bytes=30_000) / "config.json").is_file()  # then it exports
    assert [p for p in _tree(tmp_path) if "exporting" in p] == []
