"""The user's model of the Lightning feature matrix: a causal LM as a user writes one, with the hooks a Lightning user
reaches for (evaluation steps, ``self.log`` with and without ``sync_dist``, ``self.all_gather``, a scheduler, manual
optimization, ``torch.compile`` in ``configure_model``), each switched by a hyperparameter so that one class serves
every feature and ``load_from_checkpoint`` can rebuild it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tests.support.user_models import AttentionLM, MoENet


class MatrixLM(AttentionLM):
    """:class:`tests.support.user_models.AttentionLM` (or its mixture-of-experts twin with ``moe=True``) with Lightning's hooks.

    Args:
        optimizer: ``"sgd"`` (momentum 0.9) or ``"adamw"``.
        scheduler: ``None``, ``"step"`` (``StepLR`` stepped every optimizer step) or ``"epoch"`` (every epoch).
        sync_dist: ``sync_dist`` of the ``train_loss`` logged in ``training_step``.
        manual: ``automatic_optimization=False``: ``training_step`` zeroes, calls ``manual_backward`` and steps.
        compile: ``configure_model`` wraps the network in ``torch.compile`` (``backend="eager"``: dynamo's tracing and
            the ``OptimizedModule`` wrapper the strategies meet, without a compiler backend, to keep the test fast).
        moe: the network is :class:`tests.support.user_models.MoENet` (experts for the ep axis).
        fsdp: ``configure_model`` applies FSDP2's ``fully_shard`` to every layer and the network on the
            ``"data_parallel"`` axis of ``self.device_mesh`` (what Lightning's ``ModelParallelStrategy`` asks of a user).
    """

    def __init__(self, optimizer: str = "sgd", scheduler: str | None = None, sync_dist: bool = True,
                 manual: bool = False, compile: bool = False, moe: bool = False, fsdp: bool = False) -> None:
        super().__init__(optimizer)
        self.save_hyperparameters()
        if moe:
            self.model = MoENet()
        self.automatic_optimization = not manual
        self.gathered: list[torch.Tensor] = []  # self.all_gather of each validation batch's loss

    def configure_model(self) -> None:
        if self.hparams.fsdp and not getattr(self, "_sharded", False):
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.layers.values():
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
            self._sharded = True
        if self.hparams.compile and not isinstance(self.model, torch._dynamo.eval_frame.OptimizedModule):
            self.model = torch.compile(self.model, backend="eager")

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y, *positions = batch
        return self.loss_fn(self.model(x, *positions), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, sync_dist=self.hparams.sync_dist, on_step=True, on_epoch=False)
        if self.hparams.manual:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
            sched = self.lr_schedulers()
            if sched is not None:
                sched.step()
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_loss_local", loss)
        self.gathered.append(self.all_gather(loss.detach()).float().cpu())
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("test_loss", loss, sync_dist=True)
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """Per-sample mean token loss, ``(batch,)``."""
        x, y, *positions = batch
        logits = self.model(x, *positions).float()
        return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(1)

    def configure_optimizers(self) -> Any:
        opt = super().configure_optimizers()
        if self.hparams.scheduler is None:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": self.hparams.scheduler}}


def make_matrix_lm(**hparams: Any) -> MatrixLM:
    """Seeded: every rank and the reference build the same initial model."""
    torch.manual_seed(0)
    return MatrixLM(**hparams)
