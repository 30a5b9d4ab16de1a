"""The training and evaluation steps every next-token language model of ours shares (the reference GPT's wrapper and
:class:`lightning_par.hf.HFCausalLM`): the loss of a batch ``(x, y)`` or, under context parallelism,
``(x, y, position_ids)``, or of a packed block (a mapping ``{"input_ids", "labels", "position_ids", "document_ids"}``,
:mod:`lightning_par.data.packing`: attention masked per document, :mod:`lightning_par.data.doc_mask`), and the batch as
a pipeline schedule takes it.

The loss is a static method so that strategies which own the forward pass (a pipeline schedule calling it on the last
stage, a vocab-parallel loss) can call it on their own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["NextTokenSteps"]


class NextTokenSteps:
    """Mixin for a LightningModule whose ``forward(idx, position_ids=None)`` returns logits ``(batch, seq, vocab)``."""

    @staticmethod
    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over every token, in nats.

        Args:
            logits: ``(batch, seq, vocab_size)``.
            targets: token ids ``(batch, seq)`` int64 (already shifted: the data's ``y`` is ``x`` one token on).

        Returns:
            Scalar loss (computed in float32).
        """
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    def _document_context(self) -> Any:
        """The context the network's attention needs to reach ``scaled_dot_product_attention`` unmasked (a Hugging
        Face model's), from the model contract; ``None`` for networks that call it directly."""
        from lightning_par.context_parallel.contract import context_parallel_attention

        network = getattr(self, "model", None)
        return context_parallel_attention(network) if isinstance(network, torch.nn.Module) else None

    def _loss(self, batch: Any) -> torch.Tensor:
        """Loss of a batch ``(x, y)`` or, under context parallelism, ``(x, y, position_ids)``; or of a packed block
        ``{"input_ids", "labels", "position_ids", "document_ids"}`` (each ``(batch, seq)``), its attention masked per
        document."""
        if isinstance(batch, Mapping):
            from lightning_par.data.doc_mask import document_attention

            documents = batch.get("document_ids")
            with document_attention(documents, self._document_context() if documents is not None else None):
                logits = self(batch["input_ids"], position_ids=batch.get("position_ids"))  # type: ignore[operator]
            return self.loss_fn(logits, batch["labels"])
        x, y, *positions = batch
        return self.loss_fn(self(x, *positions), y)  # type: ignore[operator]

    def pipeline_batch(self, batch: Any) -> tuple[Any, torch.Tensor]:
        """``(inputs, targets)`` for a pipeline schedule: ``x``, or under context parallelism ``(x, position_ids)``
        with the positions ``(batch, seq)`` so that the schedule splits them into micro-batches with ``x``; a packed
        block gives ``(input_ids, position_ids)`` and ``labels`` (its ``document_ids`` reach every stage through the
        pipeline engine, per micro-batch)."""
        if isinstance(batch, Mapping):
            x, positions = batch["input_ids"], batch.get("position_ids")
            if positions is None:
                return x, batch["labels"]
            return (x, positions.expand(x.shape[0], -1).contiguous()), batch["labels"]
        x, y, *positions = batch
        if not positions:
            return x, y
        return (x, positions[0].expand(x.shape[0], -1).contiguous()), y

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        """Loss of a batch ``(x, y)``, each ``(batch, seq)``; logs ``train_loss``."""
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)  # type: ignore[attr-defined]
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        """Loss of a batch ``(x, y)``; logs ``val_loss`` averaged over batches and ranks."""
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)  # type: ignore[attr-defined]
        return loss
