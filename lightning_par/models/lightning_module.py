"""The Lightning wrapper every recipe trains: a :class:`GPT`, its loss, AdamW (or Muon + AdamW) and a warmup + cosine
schedule.

The loss and the steps are :class:`~lightning_par.models.next_token.NextTokenSteps`' (shared with the Hugging Face
wrapper); the loss lives there, not in the model.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

import lightning as L
import torch

from lightning_par.checkpoint.loading import ShardedCheckpointLoading
from lightning_par.models.gpt import GPT, GPTConfig
from lightning_par.models.next_token import NextTokenSteps
from lightning_par.optim.registry import optimizer_keywords

__all__ = ["GPTLightningModule", "lr_lambda"]


def lr_lambda(step: int, warmup_steps: int, max_steps: int | None, min_lr_ratio: float) -> float:
    """Learning-rate multiplier at optimizer step ``step`` (0-based).

    Linear warmup ``(step + 1) / warmup_steps`` for the first ``warmup_steps`` steps, then a cosine from 1 down to
    ``min_lr_ratio`` at ``max_steps`` and flat after it; flat at 1 after warmup when ``max_steps`` is None.
    Source: nanoGPT's ``get_lr`` (cosine decay, Loshchilov & Hutter 2017, without restarts).
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if max_steps is None:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _check(name: str, value: object, ok: bool, valid: str) -> None:
    if not ok:
        raise ValueError(f"GPTLightningModule {name}={value!r} is not valid: expected {valid}.")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class GPTLightningModule(NextTokenSteps, ShardedCheckpointLoading, L.LightningModule):
    """Next-token language modelling with a :class:`GPT`.

    Args:
        config: model shape, a :class:`GPTConfig` or its ``dict`` (as stored in checkpoints); ``GPTConfig()`` if None.
        learning_rate: peak AdamW learning rate.
        weight_decay: decoupled weight decay, applied to parameters with 2 or more dimensions only.
        betas: AdamW ``(beta1, beta2)``.
        warmup_steps: optimizer steps of linear warmup.
        min_lr_ratio: final learning rate as a fraction of ``learning_rate``, in ``[0, 1]``.
        max_steps: optimizer step where the cosine reaches ``min_lr_ratio``; None keeps the rate constant after warmup.
        adam_eps: AdamW's ``eps`` (added to ``sqrt(v)``). Parity tests use 1e-6: at 1e-8 an entry whose gradient
            cancels to fp32 rounding noise gets an update whose size depends on the summation order.
        optimizer: ``"adamw"`` (every parameter), or an entry of :mod:`lightning_par.optim.registry` by name or
            import path: ``"muon"`` is :class:`~lightning_par.optim.MuonAdamW`, Muon on the hidden matrices
            (attention and MLP projections, experts), AdamW with ``learning_rate``, ``betas``, ``adam_eps`` and
            ``weight_decay`` on the embeddings, head, norms, biases and routers (docs/muon.md).
        **optimizer_options: the registered optimizers' own keywords, ``<name>_<field>`` (``muon_lr``,
            ``muon_weight_decay``, ``muon_momentum``, ``muon_adjust_lr_fn``, ``muon_ns_precision``:
            :class:`~lightning_par.optim.muon.MuonOptions`); scheduled like ``learning_rate``.

    Raises:
        ValueError: an invalid value; the message names the argument, the value and what is valid.
    """

    def __init__(
        self,
        config: GPTConfig | dict[str, Any] | None = None,
        learning_rate: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        min_lr_ratio: float = 0.1,
        max_steps: int | None = None,
        adam_eps: float = 1e-8,
        optimizer: str = "adamw",
        **optimizer_options: Any,
    ) -> None:
        super().__init__()
        if config is None:
            config = GPTConfig()
        elif isinstance(config, dict):
            config = GPTConfig(**config)
        elif not isinstance(config, GPTConfig):
            # OmegaConf DictConfig and other mappings.
            config = GPTConfig(**dict(config))
        _check("learning_rate", learning_rate, learning_rate > 0, "a positive float")
        _check("weight_decay", weight_decay, weight_decay >= 0, "a float >= 0")
        betas = tuple(float(b) for b in betas)  # type: ignore[assignment]
        _check("betas", betas, len(betas) == 2 and all(0 <= b < 1 for b in betas), "two floats in [0, 1)")
        _check("warmup_steps", warmup_steps, _is_int(warmup_steps) and warmup_steps >= 0, "an integer >= 0")
        _check("adam_eps", adam_eps, isinstance(adam_eps, (int, float)) and adam_eps > 0, "a positive float")
        optimizer_options = optimizer_keywords("GPTLightningModule", optimizer, optimizer_options)
        _check("min_lr_ratio", min_lr_ratio, 0 <= min_lr_ratio <= 1, "a float in [0, 1]")
        _check(
            "max_steps",
            max_steps,
            max_steps is None or (_is_int(max_steps) and max_steps >= max(1, warmup_steps)),
            f"None or an integer >= max(1, warmup_steps={warmup_steps})",
        )
        self.save_hyperparameters(
            {
                "config": asdict(config),
                "learning_rate": learning_rate,
                "weight_decay": weight_decay,
                "betas": betas,
                "warmup_steps": warmup_steps,
                "min_lr_ratio": min_lr_ratio,
                "max_steps": max_steps,
                "adam_eps": adam_eps,
                "optimizer": optimizer,
                **optimizer_options,
            }
        )
        self.config: GPTConfig = config
        self.model = GPT(config)

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(batch, seq, vocab_size)`` of token ids ``idx`` ``(batch, seq)`` at ``position_ids`` (default
        ``0 .. seq-1``)."""
        return self.model(idx, position_ids=position_ids)

    def configure_optimizers(self) -> dict[str, Any]:
        """AdamW with weight decay on matrices and embeddings only (or the registered optimizer ``optimizer`` names,
        e.g. :class:`~lightning_par.optim.MuonAdamW`), and a per-step :func:`lr_lambda` schedule."""
        hp = self.hparams
        if hp.get("optimizer", "adamw") != "adamw":
            from lightning_par.optim.registry import BaseHParams, optimizer_entry

            base = BaseHParams(hp.learning_rate, hp.weight_decay, tuple(hp.betas), hp.get("adam_eps", 1e-8))
            return self._with_schedule(optimizer_entry(hp.optimizer).create(self, hp, base))
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": hp.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"]], lr=hp.learning_rate, betas=tuple(hp.betas), eps=hp.get("adam_eps", 1e-8)
        )
        return self._with_schedule(optimizer)

    def _with_schedule(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer`` with the per-step :func:`lr_lambda` schedule (every param group scaled alike)."""
        hp = self.hparams
        warmup, max_steps, floor = hp.warmup_steps, hp.max_steps, hp.min_lr_ratio
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_lambda(step, warmup, max_steps, floor)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
