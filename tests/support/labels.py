"""Helpers of tests/data/test_label_masks.py: chat-style records with answer-only labels, and the per-rank
worker that fits a model on them under a lightning_par strategy.

Each record is ``prompt + answer + padding`` in a window of ``seq + 1`` tokens: the targets of the prompt (but its
last token, which predicts the answer's first) and of the padding are ``-100``, so only the answer counts in the
loss. Prompt and answer lengths differ from record to record, so every dp replica, micro-batch and cp piece holds
another number of counted tokens: a mean of per-part means is not the batch's token mean.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from tests.support.helpers import quiet_trainer

PAD = 0


class ChatRecords(Dataset):
    """``n`` records ``(x, y)`` of ``seq`` tokens each: prompt, answer, padding (see the module docstring).

    Record ``i`` has a prompt of ``2 + (5 i mod 9)`` tokens and an answer of ``1 + (3 i mod (seq - prompt))``
    tokens; :meth:`counted` is the number of answer tokens (targets that are not ``-100``).
    """

    def __init__(self, n: int = 32, seq: int = 16, vocab: int = 256, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(1, vocab, (n, seq + 1), generator=g)
        self.prompt = [2 + (5 * i) % 9 for i in range(n)]
        self.answer = [1 + (3 * i) % (seq - p) for i, p in enumerate(self.prompt)]
        self.seq = seq

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.tokens[i].clone()
        end = self.prompt[i] + self.answer[i]  # tokens [0, end) are the record; the rest is padding
        tokens[end:] = PAD
        x, y = tokens[:-1], tokens[1:].clone()
        y[: self.prompt[i] - 1] = -100  # targets inside the prompt
        y[end - 1:] = -100  # targets inside the padding
        return x, y

    def counted(self, i: int) -> int:
        return self.answer[i]


def make_model(name: str) -> L.LightningModule:
    """``"gpt"`` (AdamW), ``"gpt-sgd"`` (SGD with momentum), or a user's causal LM ``"lm-sgd"`` / ``"lm-adamw"``;
    ``"lm-sgd-unweighed"`` sets ``token_mean_loss = False`` (the dp replicas then weigh alike); ``"moegpt"``,
    ``"moelm-sgd"`` (experts); ``"hf-llama-sgd"`` (a Hugging Face Llama)."""
    torch.manual_seed(0)
    if name.startswith(("moegpt", "moelm")):  # mixture-of-experts models, for ep (tests.support.p3d.make_model)
        from tests.support.p3d import make_model as make_3d_model

        return make_3d_model({"model": name})
    if name.startswith("hf-"):  # a Hugging Face causal LM (tests.hf.test_hf_pipeline_distributed.make_hf)
        from tests.hf.test_hf_pipeline_distributed import make_hf

        return make_hf(name[3:])
    if name.startswith("lm-"):
        from tests.support.user_models import AttentionLM

        module = AttentionLM(name.split("-")[1])
        if name.endswith("-unweighed"):
            module.token_mean_loss = False
        return module
    from tests.support.p3d import make_gpt

    module = make_gpt()
    if name == "gpt-sgd":
        def sgd() -> torch.optim.Optimizer:
            return torch.optim.SGD(module.parameters(), lr=0.3, momentum=0.9)

        module.configure_optimizers = sgd  # type: ignore[method-assign]
    return module


def make_reference_model(name: str) -> L.LightningModule:
    """As :func:`make_model`, for the one-process reference (``tests.support.helpers.reference_fit`` seeds then builds)."""
    return make_model(name)


class StepLosses(L.Callback):
    """The loss each training step returned and the counted tokens of this rank's batch."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.counted: list[int] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach()))
        self.counted.append(int((batch[1] != -100).sum()))


class FinalParams(L.Callback):
    def __init__(self) -> None:
        self.params: dict[str, torch.Tensor] = {}

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.params = trainer.strategy.parallel.full_state_dict()


def _strategy(name: str, options: dict[str, Any]) -> Any:
    from lightning.pytorch.strategies import StrategyRegistry

    entry = StrategyRegistry[name]
    return entry["strategy"](**{**entry["init_params"], "timeout_s": 90, **options})


def fit_cases(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case ``{"name", "strategy", "options", "model", "n", "batch", "steps"}`` on this rank: fit on
    :class:`ChatRecords` sharded over dp without shuffling; returns per step the returned loss and counted tokens,
    and the final whole-model parameters."""
    env = dict(os.environ)
    rank = int(os.environ["RANK"])
    results = []
    for case in cases:
        os.environ.update(env)  # Lightning's teardown deletes WORLD_SIZE after each run
        strategy = _strategy(case["strategy"], case["options"])
        dims = strategy.resolve_parallel_dims(int(os.environ["WORLD_SIZE"]))
        dp_rank = dims.coordinates(rank)["dp"]
        data = ChatRecords(n=case["n"])
        sampler = DistributedSampler(data, num_replicas=dims.dp_size, rank=dp_rank, shuffle=False)
        loader = DataLoader(data, batch_size=case["batch"], sampler=sampler, drop_last=True)
        losses, final = StepLosses(), FinalParams()
        trainer = quiet_trainer(strategy, dims.world_size, max_steps=case["steps"], limit_val_batches=0,
                                callbacks=[losses, final])
        trainer.fit(make_model(case["model"]), loader)
        results.append({"rank": rank, "dp_rank": dp_rank, "losses": losses.losses, "counted": losses.counted,
                        "params": final.params})
    return results


def run_fit_cases(world: int, cases: list[dict[str, Any]], timeout_s: float = 600) -> dict[str, list[dict[str, Any]]]:
    """``{case name: [result of each rank]}``."""
    from lightning_par.launcher import run_distributed

    per_rank = run_distributed(fit_cases, world, (cases,), timeout_s=timeout_s)
    return {case["name"]: [per_rank[r][i] for r in range(world)] for i, case in enumerate(cases)}


def token_mean_losses(results: list[dict[str, Any]]) -> list[float]:
    """Per step, the global batch's token-mean loss from the dp replicas' own means and counted tokens."""
    by_dp: dict[int, dict[str, Any]] = {}
    for r in results:
        by_dp.setdefault(r["dp_rank"], r)
    steps = len(next(iter(by_dp.values()))["losses"])
    out = []
    for k in range(steps):
        total = sum(r["counted"][k] for r in by_dp.values())
        out.append(sum(r["losses"][k] * r["counted"][k] for r in by_dp.values()) / total)
    return out
