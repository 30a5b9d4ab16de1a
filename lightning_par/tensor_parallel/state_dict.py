"""Checkpoint state of vocab-parallel tables without their padding, as views (no gather).

A vocab-parallel embedding or head whose vocabulary ``V`` does not divide by ``tp_size`` is padded to
``P = ceil(V / t) * t`` rows (:mod:`lightning_par.tensor_parallel.vocab`): its DTensor's global shape, ``(P, ...)``,
depends on the tp size, so a sharded checkpoint of it would not load into another tp size or one process. Rank ``r``
holds rows ``[r P / t, (r + 1) P / t)``, which are exactly the rows ``torch.chunk`` gives rank ``r`` of the *unpadded*
``V`` rows, plus padding at the end. So the unpadded tensor is a DTensor of global shape ``(V, ...)`` whose local part
is a view of the first valid rows of the padded local shard: ``torch.distributed.checkpoint`` saves it and loads into it
in place, with no communication.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

from lightning_par.compat import local_tensor
from lightning_par.tensor_parallel.vocab import VOCAB_SIZE_ATTR

__all__ = ["padded_parameters", "unpad_vocab_state"]


def padded_parameters(module: nn.Module) -> dict[str, int]:
    """Parameter name (relative to ``module``) -> real vocabulary size, for the parameters a vocab-parallel style
    padded (their dim 0 is longer than the vocabulary)."""
    out = {}
    for name, sub in module.named_modules():
        vocab = getattr(sub, VOCAB_SIZE_ATTR, None)
        if vocab is None:
            continue
        for pname, p in sub.named_parameters(recurse=False):
            if p.shape[0] != vocab:
                out[f"{name}.{pname}" if name else pname] = vocab
    return out


def _unpadded(t: Any, vocab: int, name: str) -> Any:
    if not isinstance(t, Tensor) or t.dim() == 0 or t.shape[0] == vocab:
        return t
    if not isinstance(t, DTensor) or t.device_mesh.ndim != 1 or tuple(t.placements) != (Shard(0),):
        raise ValueError(
            f"{name} has vocab_size={vocab} padded to {t.shape[0]} rows and is sharded beyond the tp axis (ZeRO or "
            f"FSDP on the dp axis): a checkpoint of it would not load into another layout. Use a vocabulary divisible "
            f"by every tp size involved (e.g. 256), or dp_mode='ddp'."
        )
    local = local_tensor(t)
    rows = local.shape[0]
    valid = max(0, min(rows, vocab - t.device_mesh.get_local_rank() * rows))
    shape = torch.Size((vocab, *t.shape[1:]))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local[:valid], t.device_mesh, (Shard(0),), run_check=False, shape=shape, stride=stride)


def unpad_vocab_state(module: nn.Module, model_state: dict[str, Any], optimizer_states: list[dict[str, Any]]) -> None:
    """Replace, in place, every vocab-padded entry of a model state (``{name: tensor}``) and of optimizer states
    (``get_optimizer_state_dict`` format, keyed by parameter name) by a view of its unpadded rows.

    Args:
        module: the module the names are relative to (the LightningModule).
        model_state: e.g. an engine's ``model_state_dict()``.
        optimizer_states: e.g. an engine's ``optimizer_state_dict(optimizer)`` for each optimizer.

    Raises:
        ValueError: a padded tensor that is also sharded over dp (see :func:`_unpadded`).
    """
    padding = padded_parameters(module)
    for name, vocab in padding.items():
        if name in model_state:
            model_state[name] = _unpadded(model_state[name], vocab, name)
        for state in optimizer_states:
            per_param = state.get("state", {}).get(name)
            if per_param is not None:
                for key, value in per_param.items():
                    per_param[key] = _unpadded(value, vocab, f"{name} (optimizer state {key!r})")
