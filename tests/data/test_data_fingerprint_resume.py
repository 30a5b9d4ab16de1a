"""A resume on other data, through the recipe (issue 50): ``data=jsonl data.tokenizer=tokA``, 2 steps with a
checkpoint; ``tokA/tokenizer.json`` edited in place (two ids swapped): ``ckpt_path=last`` is refused before any process
starts, naming the tokenizer (old -> new); the same files at another path pass the checks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from lightning_par.config.schema import register_configs
from lightning_par.train import launch_job, preflight
from tests.support.recipe_run import ROOT
from tests.data.test_data_fingerprint import WORDS, _swap_two_ids
from tests.data.test_tokenizer import word_level

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
register_configs()


def _cfg(tmp_path: Path, tokenizer: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name="config", overrides=[
            "model=tiny", "data=jsonl", f"data.path={tmp_path / 'train.jsonl'}", f"data.tokenizer={tokenizer}",
            "data.batch_size=2", f"data.cache_dir={tmp_path / 'cache'}", "trainer=smoke", "parallel=dp1",
            "trainer.checkpoint=true", "trainer.checkpoint_every_n_steps=2", "trainer.max_steps=2",
            "trainer.val_check_interval=1000", "trainer.job_timeout_s=240", *overrides])


def test_a_resume_with_an_edited_tokenizer_is_refused_before_start(tmp_path: Path) -> None:
    (tmp_path / "train.jsonl").write_text("".join(
        json.dumps({"text": " ".join(WORDS[(i * 3 + j) % 8] for j in range(4 + i % 9))}) + "\n" for i in range(200)))
    tok = word_level(tmp_path / "tokA", WORDS)
    run_dir = tmp_path / "run"
    first = launch_job(_cfg(tmp_path, tok), run_dir)
    assert first is not None and first["steps"] == 2
    copy = Path(shutil.copytree(tok, tmp_path / "elsewhere" / "tokB"))
    plan = preflight(_cfg(tmp_path, copy, "trainer.max_steps=4", "ckpt_path=last"), run_dir)  # same files: accepted
    assert plan.ckpt_path is not None and plan.ckpt_path.parent == run_dir / "checkpoints", plan
    _swap_two_ids(tok)
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    with pytest.raises(ValueError, match=r"cannot be resumed with these settings: data tokenizer files' contents "
                                         r"\(data.tokenizer\): 'sha256:[0-9a-f]{16}' -> 'sha256:[0-9a-f]{16}'; data "
                                         r"token cache key: 'docs-"):
        launch_job(_cfg(tmp_path, tok, "trainer.max_steps=4", "ckpt_path=last"), run_dir)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before  # nothing trained
