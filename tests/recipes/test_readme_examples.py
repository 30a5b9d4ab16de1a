"""The examples of docs/your-model.md ("Four examples") and the README's quick start, run as a user runs them (a
script; Lightning's own launcher starts the other processes, each a fresh interpreter), and the errors the page's table
quotes, raised before any process starts. The script's first process is a child forked from an interpreter with the
imports done (tests/support/forked_run.py)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from lightning_par.parallel_dims import ParallelDims
from tests.support.forked_run import run_forked

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGE = ROOT / "docs" / "your-model.md"


def _section(path: Path, heading: str) -> str:
    """The text under ``heading`` (a ``## `` line) up to the next ``## `` heading."""
    text = path.read_text()
    section = text[text.index(f"\n{heading}\n") + 1 :]
    end = section.find("\n## ", 5)
    return section if end < 0 else section[:end]


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", _section(PAGE, "## Four examples"), re.S)


MODEL, *USES = _blocks()


def _namespace() -> dict:
    namespace: dict = {"__name__": "readme_model"}
    exec(compile(MODEL, "docs model", "exec"), namespace)  # noqa: S102 - the page's own code
    return namespace


def _untrained_val_loss() -> float:
    ns = _namespace()
    torch.manual_seed(0)
    module = ns["Regressor"]()
    x, y = ns["data"](64).dataset.tensors
    with torch.no_grad():
        return float(module.loss_fn(module.model(x), y))


def test_the_page_has_the_four_examples():
    assert len(USES) == 4
    assert ['"zero3"', '"tensor_parallel"', "PipelineStrategy", "Parallel3DStrategy"] == [
        next(k for k in ('"zero3"', '"tensor_parallel"', "PipelineStrategy", "Parallel3DStrategy") if k in use)
        for use in USES
    ]


@pytest.mark.e2e
@pytest.mark.parametrize("index", range(4), ids=["zero3", "tensor_parallel", "1f1b", "parallel_3d"])
def test_page_example_trains(index, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(MODEL + "\n\n" + USES[index])
    proc = run_forked([sys.executable, str(script)], tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    val_loss = float(next(ln for ln in proc.stdout.splitlines() if ln.startswith("val_loss")).split()[1])
    assert val_loss < 0.5 * _untrained_val_loss()


def _message(strategy, module, dims: ParallelDims) -> str:
    strategy.connect(module)
    with pytest.raises(ValueError) as info:
        strategy.validate_model(dims)
    return str(info.value)


def test_the_errors_the_page_quotes():
    from torch import nn

    from lightning_par import DDPOverlapStrategy, PipelineStrategy, TensorParallelStrategy

    ns = _namespace()
    no_plan = type("Regressor", (ns["Regressor"],), {"tp_plan": None})()
    no_loss = type("Regressor", (ns["Regressor"],), {"loss_fn": None})()
    tp = _message(TensorParallelStrategy(tp_size=2), no_plan, ParallelDims(tp_size=2, world_size=2))
    pp = _message(PipelineStrategy(pp_size=2), no_loss, ParallelDims(pp_size=2, world_size=2))
    unnamed = ns["Regressor"]()
    unnamed.model = nn.Linear(8, 1)  # no blocks to checkpoint
    full = _message(DDPOverlapStrategy(activation_checkpointing="full"), unnamed, ParallelDims(world_size=2))
    selective = _message(DDPOverlapStrategy(activation_checkpointing="selective"), ns["Regressor"](),
                         ParallelDims(world_size=2))
    cp = _message(DDPOverlapStrategy(cp_size=2), ns["Regressor"](), ParallelDims(cp_size=2, world_size=2))
    from lightning_par.models import GPTConfig, GPTLightningModule

    dense = GPTLightningModule(GPTConfig.from_preset("tiny"))
    no_experts = _message(DDPOverlapStrategy(ep_size=2), dense, ParallelDims(ep_size=2, world_size=2))
    six = GPTLightningModule(GPTConfig.from_preset("moe_tiny", num_experts=6))
    uneven = _message(DDPOverlapStrategy(ep_size=4), six, ParallelDims(ep_size=4, world_size=4))
    section = _section(PAGE, "## What your module provides")
    quoted = re.findall(r"`ValueError: ([^`]*?)\.\.\.`", section)
    assert len(quoted) == 7
    for message, quote in zip((cp, no_experts, uneven, tp, pp, full, selective), quoted):
        assert message.startswith(quote), (quote, message)
    assert "training_step does not compute the loss" in pp


@pytest.mark.e2e
def test_readme_quick_start_trains(tmp_path):
    """The README's "Quick start: your Trainer" script, as a user runs it: zero3 on 2 processes, loss going down."""
    section = _section(README, "## Quick start: your Trainer")
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    assert 'strategy="zero3"' in code and "devices=2" in code
    code = code.replace("    trainer.fit(Regressor(), data)\n", "    module = Regressor()\n    trainer.fit(module, data)\n"
                        "    if trainer.global_rank == 0:\n"
                        "        print('train_loss', float(trainer.callback_metrics['train_loss']))\n")
    script = tmp_path / "quickstart.py"
    script.write_text(code)
    proc = run_forked([sys.executable, str(script)], tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    loss = float(next(ln for ln in proc.stdout.splitlines() if ln.startswith("train_loss")).split()[1])
    x = torch.randn(512, 8, generator=torch.Generator().manual_seed(0))
    assert loss < 0.1 * float(x.sum(1).pow(2).mean())  # the untrained scale of the targets: sum of 8 unit normals
