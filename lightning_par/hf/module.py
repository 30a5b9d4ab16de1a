"""A LightningModule for any Hugging Face causal language model (``transformers``' ``AutoModelForCausalLM``).

The network is ``self.model`` (a ``PreTrainedModel``), so the strategies find it under the default
``module_attr="model"`` and checkpoints hold its parameters under ``model.<HF name>``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F

__all__ = ["HFCausalLM", "recipe_model"]

OPTIMIZERS = ("adamw", "sgd")


def _known_model_type(model_type: object) -> bool:
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:  # pragma: no cover - reported when the model is built
        return True
    return isinstance(model_type, str) and model_type in CONFIG_MAPPING


def recipe_model(
    model_type: str | None = None,
    pretrained: str | None = None,
    config: Mapping[str, Any] | None = None,
    base_config: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> "HFCausalLM":
    """The recipe's ``model=hf`` entry: :class:`HFCausalLM` with ``config`` over ``base_config`` for a ``model_type``
    build (the tiny default of conf/model/hf.yaml), or ``config`` alone over a ``pretrained`` directory's.

    Raises:
        ValueError: as :class:`HFCausalLM` (neither or both of ``model_type`` and ``pretrained``, an unknown
            ``model_type``...), naming the argument.
    """
    merged = dict(config or {}) if pretrained is not None else {**dict(base_config or {}), **dict(config or {})}
    return HFCausalLM(model_type=model_type, config=merged, pretrained=pretrained, **kwargs)


def _check(name: str, value: object, ok: bool, valid: str) -> None:
    if not ok:
        raise ValueError(f"HFCausalLM {name}={value!r} is not valid: expected {valid}.")


class HFCausalLM(L.LightningModule):
    """Next-token language modelling with a Hugging Face causal LM.

    Exactly one of ``model_type`` and ``pretrained`` names the model:

    Args:
        model_type: a ``transformers`` model type (``"llama"``, ``"qwen2"``, ``"qwen3"``, ``"mistral"``,
            ``"qwen3_moe"``...): the model is built with random weights by ``AutoModelForCausalLM.from_config`` from
            ``AutoConfig.for_model(model_type, **config)``.
        config: config fields (``hidden_size``, ``num_hidden_layers``...) overriding the model type's defaults, or
            the pretrained directory's ``config.json``.
        pretrained: a local directory written by ``save_pretrained`` (``config.json`` and safetensors); never
            downloads.
        optimizer: ``"adamw"`` (default) or ``"sgd"`` (with ``momentum``).
        learning_rate: the optimizer's learning rate.
        weight_decay: AdamW's decoupled weight decay (matrices and embeddings only); SGD's L2 term.
        momentum: SGD's momentum.
        adam_eps: AdamW's ``eps``.

    Raises:
        ValueError: neither or both of ``model_type`` and ``pretrained``; an unknown ``model_type``; a
            ``pretrained`` path that is not a directory with a ``config.json``; an unknown optimizer; a non-positive
            learning rate. The message names the argument, the value and what is valid.
        ImportError: ``transformers`` is not installed (``pip install 'lightning-par[hf]'``).
    """

    def __init__(
        self,
        model_type: str | None = None,
        config: Mapping[str, Any] | None = None,
        pretrained: str | None = None,
        optimizer: str = "adamw",
        learning_rate: float = 1e-3,
        weight_decay: float = 0.0,
        momentum: float = 0.9,
        adam_eps: float = 1e-8,
    ) -> None:
        super().__init__()
        _check("model_type", model_type, (model_type is None) != (pretrained is None),
               "exactly one of model_type and pretrained (a local save_pretrained directory)")
        _check("optimizer", optimizer, optimizer in OPTIMIZERS, f"one of {OPTIMIZERS}")
        _check("learning_rate", learning_rate, learning_rate > 0, "a positive float")
        if pretrained is not None:
            import os

            _check("pretrained", pretrained, os.path.isfile(os.path.join(str(pretrained), "config.json")),
                   "a local directory written by save_pretrained (with a config.json)")
        if model_type is not None:
            _check("model_type", model_type, _known_model_type(model_type),
                   "a transformers model type such as 'llama', 'qwen2', 'qwen3', 'mistral', 'qwen3_moe', 'mixtral'")
        config = dict(config or {})
        self.save_hyperparameters(
            {"model_type": model_type, "config": config, "pretrained": pretrained, "optimizer": optimizer,
             "learning_rate": learning_rate, "weight_decay": weight_decay, "momentum": momentum, "adam_eps": adam_eps}
        )
        try:
            from transformers import AutoConfig, AutoModelForCausalLM
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError("lightning_par.hf needs transformers: pip install 'lightning-par[hf]'") from err
        if pretrained is not None:
            hf_config = AutoConfig.from_pretrained(pretrained, local_files_only=True, **config)
        else:
            hf_config = AutoConfig.for_model(model_type, **config)
        # SDPA: the attention the cp axis intercepts; eager would bypass it.
        hf_config._attn_implementation = "sdpa"
        self.model = AutoModelForCausalLM.from_config(hf_config)

    @property
    def block_size(self) -> int:
        """The longest sequence the model takes (``config.max_position_embeddings``), in tokens: what the recipe's data
        uses when ``data.block_size`` is null."""
        return int(self.model.config.max_position_embeddings)

    @property
    def hf_config(self) -> Any:
        """The model's ``transformers.PretrainedConfig``."""
        return self.model.config

    @staticmethod
    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over every token, in nats; ``logits`` ``(batch, seq, vocab)``, ``targets``
        ``(batch, seq)`` int64 (already shifted: the data's ``y`` is ``x`` one token on)."""
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(batch, seq, vocab_size)`` of token ids ``idx`` ``(batch, seq)``."""
        if position_ids is not None and position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0).expand(idx.shape[0], -1)
        return self.model(input_ids=idx, position_ids=position_ids, use_cache=False).logits

    def _loss(self, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y, *positions = batch
        return self.loss_fn(self(x, *positions), y)

    def pipeline_batch(self, batch: tuple[torch.Tensor, ...]) -> tuple[Any, torch.Tensor]:
        """``(inputs, targets)`` for a pipeline schedule: ``x``, or under context parallelism ``(x, position_ids)``
        with the positions ``(batch, seq)`` so that the schedule splits them into micro-batches with ``x``."""
        x, y, *positions = batch
        if not positions:
            return x, y
        return (x, positions[0].expand(x.shape[0], -1).contiguous()), y

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        """Loss of a batch ``(x, y)`` (``(x, y, position_ids)`` under cp); logs ``train_loss``."""
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        """Loss of a batch; logs ``val_loss`` averaged over batches and ranks."""
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW (weight decay on tensors of 2 or more dims) or SGD with momentum."""
        hp = self.hparams
        params = [p for p in self.parameters() if p.requires_grad]
        if hp.optimizer == "sgd":
            return torch.optim.SGD(params, lr=hp.learning_rate, momentum=hp.momentum, weight_decay=hp.weight_decay)
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": hp.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=hp.learning_rate, eps=hp.adam_eps)
