"""Test machinery for float8 training: the GPT under a lightning_par strategy with ``float8`` options, and its
one-process reference in plain torch + torchao (``convert_to_float8_training`` on the same layers)."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_par.models import GPTConfig, GPTLightningModule
from tests.support.helpers import LossRecorder, TokenDataset, quiet_trainer

#: Every linear layer of this GPT has dimensions that are multiples of 16 (float8's constraint).
CONFIG = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=256, dropout=0.0)


class SGDGPT(GPTLightningModule):
    """The GPT trained by SGD with momentum."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def make_gpt(optimizer: str = "adamw") -> GPTLightningModule:
    torch.manual_seed(0)
    cls = SGDGPT if optimizer == "sgd" else GPTLightningModule
    return cls(GPTConfig(**CONFIG), learning_rate=3e-3, adam_eps=1e-6, warmup_steps=0)


class RuleDataset(TokenDataset):
    """``n`` windows of a learnable sequence: each token is ``(5 * previous + 3) % 256`` from a random start, so the
    loss falls fast (a model that learns nothing stays at ln 256 = 5.55, where float8's rounding and a wrong gradient
    both hide)."""

    def __init__(self, n: int = 64, seq: int = 16, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        tokens = torch.empty(n, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, 256, (n,), generator=g)
        for t in range(1, seq + 1):
            tokens[:, t] = (5 * tokens[:, t - 1] + 3) % 256
        self.data = tokens


def dataset(n: int = 64) -> TokenDataset:
    return RuleDataset(n=n, seq=CONFIG["block_size"])


def reference_float8(steps: int, global_batch: int, recipe: str = "tensorwise", precision: str = "32-true",
                     optimizer: str = "adamw", float8: bool = True, device: str = "cpu") -> list[float]:
    """One process, plain torch: the GPT's ``nn.Linear`` layers but the LM head converted by torchao, ``steps`` AdamW
    steps on global batches. Returns the losses."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    module = make_gpt(optimizer).to(device)
    if float8:
        convert_to_float8_training(
            module.model, module_filter_fn=lambda m, fqn: fqn != "lm_head",
            config=Float8LinearConfig.from_recipe_name(recipe),
        )
    opt = module.configure_optimizers()
    opt = opt["optimizer"] if isinstance(opt, dict) else (opt[0] if isinstance(opt, (list, tuple)) else opt)
    loader = iter(DataLoader(dataset(), batch_size=global_batch, shuffle=False, drop_last=True))
    losses = []
    autocast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    for _ in range(steps):
        x, y = (t.to(device) for t in next(loader))
        with autocast:
            loss = module.training_step((x, y), 0)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """One fit of ``case`` (``strategy``: a class name of :mod:`lightning_par.strategies`; ``options``: its keywords; ``steps``, ``micro_batch``)."""
    from lightning_par import strategies

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    strategy = getattr(strategies, case["strategy"])(**case["options"])
    dims = strategy.resolve_parallel_dims(world)
    data = dataset()
    sampler = DistributedSampler(data, num_replicas=dims.dp_size, rank=dims.coordinates(rank)["dp"], shuffle=False)
    loader = DataLoader(data, batch_size=case["micro_batch"], sampler=sampler, drop_last=True)
    recorder = LossRecorder()
    module = make_gpt(case.get("optimizer", "adamw"))
    trainer = quiet_trainer(strategy, world, max_steps=case["steps"], limit_val_batches=0, callbacks=[recorder],
                            precision=case.get("precision", "32-true"))
    trainer.fit(module, loader)
    float8_layers = sorted(
        name for name, m in module.named_modules() if type(m).__name__ == "Float8Linear"
    )
    weight = module.model.get_submodule("blocks.0.mlp.c_fc").weight
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    scales = [
        getattr(getattr(p, "_local_tensor", p), "_precomputed_scale", None)
        for n, p in module.named_parameters() if n.endswith("weight")
    ]
    return {
        "dp_rank": dims.coordinates(rank)["dp"],
        "losses": recorder.losses,
        "summary": strategy.parallel.summary(),
        "float8_layers": float8_layers,
        "weight_kind": type(local).__name__,
        "precomputed_scales": sum(s is not None for s in scales),
    }


def cases_worker(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Body of one rank: every case in order, in one process group."""
    env = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK",
                                      "MASTER_ADDR", "MASTER_PORT") if k in os.environ}
    out = []
    for case in cases:
        os.environ.update(env)  # Lightning's environment teardown removes WORLD_SIZE after each fit
        out.append(run_case(case))
    return out


def global_losses(results: list[dict[str, Any]]) -> list[float]:
    """Per-step loss of the global batch: the mean over the dp replicas' losses."""
    by_dp: dict[int, list[float]] = {}
    for r in results:
        by_dp.setdefault(r["dp_rank"], r["losses"])
    reps = list(by_dp.values())
    return [sum(v[i] for v in reps) / len(reps) for i in range(len(reps[0]))]
