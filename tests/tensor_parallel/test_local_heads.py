"""Tensor parallelism of attention, as docs/your-model.md ("Tensor parallelism of attention") teaches it: the page's own
``Attention`` (reshape with ``-1``) trains under tp2 and matches one process, and the reshape most models write first
(the model's whole head count) fails at the first forward with torch's shape error lengthened by where and why: "each
rank holds heads/tp heads; reshape with -1 or the local count" — the same exception, raised last."""

from __future__ import annotations

import os
import re
import traceback
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_par import TensorParallelStrategy
from lightning_par.launcher import run_distributed
from lightning_par.tensor_parallel.local_heads import explain_shape_error, local_heads_hint
from tests.support.helpers import TIMEOUT_S, quiet_trainer

pytestmark = pytest.mark.distributed

PAGE = Path(__file__).resolve().parents[2] / "docs" / "your-model.md"
WIDTH, HEADS, SEQ, BATCH, VOCAB = 64, 4, 16, 4, 32


def _guide() -> dict[str, Any]:
    """The page's attention example, executed (its ``Attention`` class and ``plan``)."""
    text = PAGE.read_text()
    section = text[text.index("## Tensor parallelism of attention"):]
    code = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    namespace: dict[str, Any] = {"nn": nn, "F": F}
    exec(compile(code, "docs attention guide", "exec"), namespace)  # noqa: S102 - the page's own code
    return namespace


class WholeHeadCount(nn.Module):
    """The first reshape people write: ``view(b, t, HEADS, head_dim)`` with the model's head count."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.q, self.k, self.v, self.out = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.heads, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, attention: type) -> None:
        super().__init__()
        self.attn = attention(WIDTH, HEADS)
        self.mlp = nn.Module()
        self.mlp.fc1, self.mlp.fc2 = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp.fc2(F.gelu(self.mlp.fc1(x)))


class Network(nn.Module):
    def __init__(self, attention: type) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, VOCAB)
        self.blocks = nn.ModuleList([Block(attention) for _ in range(2)])

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class LM(L.LightningModule):
    def __init__(self, attention: type, plan: dict[str, str]) -> None:
        super().__init__()
        self.model, self._plan = Network(attention), plan

    def tp_plan(self):
        return self._plan

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (8 * BATCH, SEQ), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.roll(-1, 1)), batch_size=BATCH)


def _fit(attention: type, plan: dict[str, str], world: int) -> list[float]:
    torch.manual_seed(0)
    module, losses = LM(attention, plan), []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    strategy = TensorParallelStrategy(tp_size=world) if world > 1 else "auto"
    quiet_trainer(strategy, world, max_steps=3, callbacks=[Record()]).fit(module, _data())
    return losses


def _worker() -> dict[str, Any]:
    guide = _guide()
    world = int(os.environ["WORLD_SIZE"])
    out: dict[str, Any] = {"losses": _fit(guide["Attention"], guide["plan"], world)}
    try:
        _fit(WholeHeadCount, guide["plan"], world)
    except BaseException as err:  # noqa: BLE001 - what the user's script would see
        out |= {"type": type(err).__name__, "printed": "".join(traceback.format_exception(err))}
    return out


@pytest.mark.distributed
def test_the_guides_attention_trains_and_the_whole_head_count_is_explained():
    guide = _guide()
    reference = _fit(guide["Attention"], guide["plan"], 1)  # one process
    for rank in run_distributed(_worker, 2, timeout_s=TIMEOUT_S):
        assert rank["losses"] == pytest.approx(reference, rel=1e-5)
        printed = rank.get("printed", "")
        assert rank.get("type") == "RuntimeError", printed
        last = printed.strip().splitlines()[-1]
        assert "During handling of the above exception" not in printed, printed
        assert "is invalid for input of size" in printed and last.endswith("'Tensor parallelism of attention'."), last
        assert ("blocks.0.attn (WholeHeadCount) is split by the tensor-parallel plan (tp_size=2): on this rank "
                "q: 32 of 64 output features; k: 32 of 64 output features; v: 32 of 64 output features. Under "
                "tensor parallelism each rank holds heads/tp heads; reshape with -1 or the local count") in printed


def test_a_shape_error_outside_the_split_modules_passes_untouched():
    class Reshape(nn.Module):
        def forward(self, x):
            return x.view(3, -1, 5)

    split, other = WholeHeadCount(WIDTH, HEADS), Reshape()
    with pytest.raises(RuntimeError) as info, local_heads_hint({id(split): "attn"}, 2):
        other(torch.zeros(4, 4))
    assert "heads/tp" not in str(info.value)
    split.q, split.k, split.v = (nn.Linear(WIDTH, WIDTH // 2) for _ in range(3))  # one tp rank's share, as plain
    with pytest.raises(RuntimeError, match=r"attn \(WholeHeadCount\) is split .* each rank holds heads/tp heads"):
        with local_heads_hint({id(split): "attn"}, 2):
            split(torch.zeros(2, 3, WIDTH))
    err = ValueError("shape '[1]' is invalid for input of size 2")
    assert not explain_shape_error(err, {}, 2)  # not a RuntimeError: left alone
