"""No loader of the project runs a directory's Python files (issue 50): ``trust_remote_code=False`` is passed to
transformers everywhere a model, config or tokenizer is loaded, so a ``y`` on stdin (transformers' "Do you wish to run
the custom code? [y/N]") imports nothing; ``LIGHTNING_PAR_TRUST_REMOTE_CODE=1`` opts in."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from lightning_par.hf.load import TRUST_REMOTE_CODE_ENV, trust_remote_code

CODE = '''
from pathlib import Path
Path({marker!r}).write_text("ran")
'''


def _custom_config_dir(tmp_path: Path) -> tuple[Path, Path]:
    """A ``save_pretrained``-like directory whose ``config.json`` names a Python file (``auto_map``) that, imported,
    writes a marker file."""
    directory, marker = tmp_path / "custom", tmp_path / "RAN"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({
        "model_type": "lp_custom_model", "auto_map": {"AutoConfig": "custom_code.CustomConfig",
                                                      "AutoModelForCausalLM": "custom_code.CustomModel"}}))
    (directory / "custom_code.py").write_text(CODE.format(marker=str(marker)) + (
        "from transformers import PretrainedConfig\n"
        "class CustomConfig(PretrainedConfig):\n    model_type = 'lp_custom_model'\n"))
    return directory, marker


def _custom_tokenizer_dir(tmp_path: Path) -> tuple[Path, Path]:
    directory, marker = tmp_path / "tok", tmp_path / "RAN_TOK"
    directory.mkdir()
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "CustomTokenizer", "auto_map": {"AutoTokenizer": ["custom_tok.CustomTokenizer", None]}}))
    (directory / "custom_tok.py").write_text(CODE.format(marker=str(marker)))
    return directory, marker


@pytest.fixture
def yes_on_stdin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TRUST_REMOTE_CODE_ENV, raising=False)
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 10))


def test_a_model_directory_s_code_is_not_run(tmp_path: Path, yes_on_stdin: None) -> None:
    from lightning_par.hf import HFCausalLM

    directory, marker = _custom_config_dir(tmp_path)
    with pytest.raises(ValueError, match="trust_remote_code"):
        HFCausalLM(pretrained=str(directory))
    assert not marker.exists()


def test_a_tokenizer_directory_s_code_is_not_run(tmp_path: Path, yes_on_stdin: None) -> None:
    from lightning_par.data.tokenize import load_tokenizer

    directory, marker = _custom_tokenizer_dir(tmp_path)
    with pytest.raises(ValueError, match=r"data.tokenizer=.* is not valid: no tokenizer could be read from it"):
        load_tokenizer(directory)
    assert not marker.exists()


def test_the_opt_in_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TRUST_REMOTE_CODE_ENV, raising=False)
    assert trust_remote_code() is False
    monkeypatch.setenv(TRUST_REMOTE_CODE_ENV, "1")
    assert trust_remote_code() is True
    monkeypatch.setenv(TRUST_REMOTE_CODE_ENV, "yes")
    with pytest.raises(ValueError, match=r"LIGHTNING_PAR_TRUST_REMOTE_CODE='yes' is not valid: expected '1'"):
        trust_remote_code()


def test_the_opt_in_lets_transformers_import_the_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``LIGHTNING_PAR_TRUST_REMOTE_CODE=1`` the directory's file is imported (the refusal above has teeth)."""
    from transformers import AutoConfig

    directory, marker = _custom_config_dir(tmp_path)
    monkeypatch.setenv(TRUST_REMOTE_CODE_ENV, "1")
    AutoConfig.from_pretrained(str(directory), local_files_only=True, trust_remote_code=trust_remote_code())
    assert marker.read_text() == "ran"
