"""Stop (or skip) an optimizer step whose loss or gradients are not finite, on every rank at once.

A NaN or an infinity in the loss or in any gradient, on any rank, pipeline stage or shard, is caught after backward
and before the optimizer step, so the weights never become non-finite and no checkpoint is written from them. The
check is one small all-gather of two flags per optimizer step over the whole world: each rank checks the loss it saw
and the *local* part of every gradient the optimizer is about to apply (the local shard of a DTensor: tensor- and
data-parallel shards, FSDP2 / ZeRO shards; one pipeline stage's parameters); a non-finite value anywhere in the model
makes the whole model's gradient norm non-finite, and the all-gather makes every rank take the same decision (a rank
that stepped while another stopped would leave the next collective unmatched). The max-norm of each gradient is
used for the check, so a large but finite gradient never counts as non-finite (a 2-norm can overflow).

``action="stop"`` (the default) raises :class:`NonFiniteError` on every rank, naming the step, the ranks (with their
pipeline stage) and what was non-finite (the loss value, the first parameters with non-finite gradients): Lightning
then ends ``fit`` without another checkpoint (the exception comes before ``on_train_batch_end``, where
``ModelCheckpoint`` saves, and ``ModelCheckpoint(save_on_exception=False)``, its default, saves nothing on an
exception), so the last checkpoint on disk is the last good one. ``action="skip"`` drops the step instead, as
Megatron-LM does for a non-finite gradient norm and torchtitan's ``skip_nan_inf``: every gradient is set to ``None``,
so the optimizer leaves every parameter and its state unchanged (torch optimizers skip parameters without a gradient);
the skip is counted (``nonfinite_skipped`` in the logs and the callback's state, which checkpoints keep) and, after
``max_consecutive_skips`` skips in a row, the run stops as in ``"stop"``. The step still counts in
``trainer.global_step`` and the learning-rate schedule.

With fp16 loss scaling (``precision="16-mixed"``), infinite gradients are expected now and then and the gradient
scaler already skips those steps: only the loss is checked there.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lightning_par.compat import foreach_norm, local_tensor
from lightning_par.compat.lightning import plain_optimizer

__all__ = ["NONFINITE_ACTIONS", "NonFiniteError", "NonFiniteGuard"]

#: What :class:`NonFiniteGuard` does about a non-finite step.
NONFINITE_ACTIONS = ("stop", "skip")
#: Parameters named per rank in the error message.
_NAMES_SHOWN = 3


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient stopped the run; the message names the step, the ranks and the values."""


def _optimizer_params(trainer: L.Trainer, optimizer: Any) -> list[Tensor]:
    inner = plain_optimizer(optimizer)  # LightningOptimizer
    params = [p for group in inner.param_groups for p in group["params"]]
    # The module's own parameters too: a strategy may step copies (ZeRO shards) while the module keeps gradients.
    module = trainer.lightning_module
    seen = {id(p) for p in params}
    params += [p for p in module.parameters() if id(p) not in seen] if module is not None else []
    return params


def _grads_finite(params: Iterable[Tensor]) -> bool:
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    grads = [g for g in grads if g.numel() > 0]
    if not grads:
        return True
    by_device: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for g in grads:
        by_device.setdefault((g.device, g.dtype), []).append(g)
    for same in by_device.values():
        # One max-abs per tensor (no overflow, unlike a 2-norm); NaN propagates through max.
        norms = foreach_norm(same, math.inf)
        if not bool(torch.stack(norms).isfinite().all()):
            return False
    return True


def _nonfinite_names(trainer: L.Trainer, params: list[Tensor]) -> list[str]:
    module = trainer.lightning_module
    names = {id(p): n for n, p in module.named_parameters()} if module is not None else {}
    bad = [names.get(id(p), f"<optimizer parameter {i}>") for i, p in enumerate(params)
           if p.grad is not None and not bool(local_tensor(p.grad).isfinite().all())]
    return bad[:_NAMES_SHOWN] + ([f"... {len(bad) - _NAMES_SHOWN} more"] if len(bad) > _NAMES_SHOWN else [])


def _stage(trainer: L.Trainer) -> int | None:
    dims = getattr(trainer.strategy, "parallel_dims", None)
    if dims is None or getattr(dims, "pp_size", 1) == 1:
        return None
    return dims.coordinates(trainer.global_rank)["pp"]


class NonFiniteGuard(L.Callback):
    """Check the loss and the gradients of every optimizer step on every rank; stop or skip a non-finite step.

    Works for any LightningModule under any strategy with automatic optimization (Lightning's, ours, one process);
    the loss is the one each micro-batch's backward starts from (``on_before_backward``), the gradients are checked
    in ``on_before_optimizer_step`` (after backward and the gradient reduction, before clipping and the step).

    Args:
        action: ``"stop"`` (raise :class:`NonFiniteError` on every rank) or ``"skip"`` (drop the step on every rank).
        max_consecutive_skips: with ``"skip"``, stop after this many non-finite steps in a row.
        check_grads: also check gradients (the loss alone is cheaper; gradients catch a NaN that appears in backward).

    Attributes:
        skipped: steps skipped so far (restored from checkpoints).

    Raises:
        ValueError: an unknown ``action`` or ``max_consecutive_skips < 1``.
        NonFiniteError: during ``fit``, see above.
    """

    def __init__(self, action: str = "stop", max_consecutive_skips: int = 10, check_grads: bool = True) -> None:
        if action not in NONFINITE_ACTIONS:
            raise ValueError(f"NonFiniteGuard action={action!r} is not valid: expected one of {list(NONFINITE_ACTIONS)}.")
        if isinstance(max_consecutive_skips, bool) or not isinstance(max_consecutive_skips, int) or max_consecutive_skips < 1:
            raise ValueError(
                f"NonFiniteGuard max_consecutive_skips={max_consecutive_skips!r} is not valid: expected an integer >= 1."
            )
        self.action = action
        self.max_consecutive_skips = max_consecutive_skips
        self.check_grads = check_grads
        self.skipped = 0
        self._consecutive = 0
        self._bad_loss: Tensor | None = None

    # ------------------------------------------------------------------ checks
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Tensor) -> None:
        loss = loss.detach()
        if self._bad_loss is None and not bool(loss.isfinite().all()):
            self._bad_loss = loss.float().reshape(-1)[0].cpu()

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        params = _optimizer_params(trainer, optimizer)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        grads_ok = True if (not self.check_grads or scaler is not None) else _grads_finite(params)
        device = trainer.strategy.root_device
        flags = torch.tensor([float(self._bad_loss is not None), float(not grads_ok)], device=device)
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world > 1:
            gathered = [torch.zeros(2, device=device) for _ in range(world)]
            dist.all_gather(gathered, flags)
            table = torch.stack(gathered).cpu()
        else:
            table = flags.reshape(1, 2)
        bad_loss, self._bad_loss = self._bad_loss, None  # the next accumulation window starts clean
        if not bool(table.any()):
            self._consecutive = 0
            return
        self._consecutive += 1
        message = self._describe(trainer, params, table, bad_loss, grads_ok)
        if self.action == "stop":
            raise NonFiniteError(
                f"{message}. The run stopped before this optimizer step, so no weight and no checkpoint holds a "
                f"non-finite value; resume from the last checkpoint with a lower learning rate, more warm-up or "
                f"clipping, or skip such steps (trainer.on_nonfinite=skip / NonFiniteGuard(action='skip'))."
            )
        self.skipped += 1
        if self._consecutive > self.max_consecutive_skips:
            raise NonFiniteError(
                f"{message}. {self._consecutive} optimizer steps in a row were non-finite "
                f"(max_consecutive_skips={self.max_consecutive_skips}): the run stopped."
            )
        for p in params:
            p.grad = None  # torch optimizers leave a parameter without a gradient (and its state) unchanged
        rank_zero_warn(f"{message}: step skipped on every rank ({self.skipped} skipped so far).")
        pl_module.log("nonfinite_skipped", float(self.skipped), on_step=True, on_epoch=False, rank_zero_only=True)

    def _describe(
        self, trainer: L.Trainer, params: list[Tensor], table: Tensor, loss: Tensor | None, grads_ok: bool
    ) -> str:
        """Every rank's findings, gathered (only on the rare non-finite step: every rank is here)."""
        mine = {
            "rank": trainer.global_rank,
            "stage": _stage(trainer),
            "loss": None if loss is None else float(loss),
            "params": [] if grads_ok else _nonfinite_names(trainer, params),
        }
        if table.shape[0] > 1:
            everyone: list[Any] = [None] * table.shape[0]
            dist.all_gather_object(everyone, mine)
        else:
            everyone = [mine]
        parts = []
        for info in everyone:
            if info["loss"] is None and not info["params"]:
                continue
            where = f"rank {info['rank']}" + (f" (pipeline stage {info['stage']})" if info["stage"] is not None else "")
            what = []
            if info["loss"] is not None:
                what.append(f"loss={info['loss']}")
            if info["params"]:
                what.append("non-finite gradient in " + ", ".join(info["params"]))
            parts.append(f"{where}: " + "; ".join(what))
        kinds = [k for k, col in (("loss", 0), ("gradient", 1)) if bool(table[:, col].any())]
        return f"Non-finite {' and '.join(kinds)} at step {trainer.global_step}: " + " | ".join(parts)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped = int(state_dict.get("skipped", 0))
