"""Full (gathered, unpadded) state dicts of a tensor-parallel module and its optimizer, and loading them back.

A Lightning checkpoint written by rank 0 must hold whole tensors, not rank 0's shards. These helpers gather every
DTensor (a collective: call them on *all* ranks), strip the vocabulary padding, and so produce exactly the state dict
of the one-process model: a checkpoint is portable across tp sizes (and loads into the unsplit model). Loading pads
again and keeps each rank's shard. For large models prefer ``torch.distributed.checkpoint`` (sharded files), which
understands the DTensor parameters directly (the padded shapes then tie a checkpoint to the padded layout).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_par.tensor_parallel.vocab import VOCAB_SIZE_ATTR, strip_vocab_padding

__all__ = ["full_optimizer_state", "full_state_dict", "load_full_optimizer_state", "load_full_state_dict"]


def _padding(module: nn.Module) -> dict[str, int]:
    """Parameter name -> real vocab size, for the parameters a vocab-parallel style padded."""
    out = {}
    for name, sub in module.named_modules():
        vocab = getattr(sub, VOCAB_SIZE_ATTR, None)
        if vocab is not None:
            for pname, _ in sub.named_parameters(recurse=False):
                out[f"{name}.{pname}" if name else pname] = vocab
    return out


def _gather(value: Any, rows: int | None) -> Any:
    if not isinstance(value, Tensor):
        return value
    full = value.full_tensor() if isinstance(value, DTensor) else value
    full = full.detach().cpu()
    return full[:rows].clone() if rows is not None and full.dim() >= 1 else full.clone()


def _shard_like(full: Tensor, like: Tensor) -> Tensor:
    """``full`` padded to ``like``'s global shape (zeros) and cut to ``like``'s placement on this rank."""
    if full.dim() >= 1 and full.shape[0] < like.shape[0]:
        full = torch.cat([full, full.new_zeros((like.shape[0] - full.shape[0], *full.shape[1:]))])
    full = full.to(device=like.device, dtype=like.dtype)
    if isinstance(like, DTensor):
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    return full


def full_state_dict(module: nn.Module) -> dict[str, Tensor]:
    """``module.state_dict()`` with every DTensor gathered and the vocabulary padding removed (CPU tensors)."""
    return strip_vocab_padding(module, {k: _gather(v, None) for k, v in module.state_dict().items()})


def load_full_state_dict(module: nn.Module, state: Mapping[str, Tensor], strict: bool = True) -> None:
    """Load a full, unpadded state dict into a tensor-parallel ``module`` (each rank keeps its shard).

    Raises:
        RuntimeError: as ``nn.Module.load_state_dict`` for missing or unexpected keys when ``strict``.
    """
    current = module.state_dict()
    local = {k: _shard_like(v, current[k]) if k in current else v for k, v in state.items()}
    module.load_state_dict(local, strict=strict)


def _param_names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    by_id = {id(p): n for n, p in module.named_parameters()}
    return [by_id.get(id(p), "") for group in optimizer.param_groups for p in group["params"]]


def full_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with DTensor states gathered and vocabulary padding removed."""
    sd = optimizer.state_dict()
    names = _param_names(module, optimizer)
    padding = _padding(module)
    state = {
        idx: {k: _gather(v, padding.get(names[idx])) for k, v in per_param.items()}
        for idx, per_param in sd["state"].items()
    }
    return {"state": state, "param_groups": sd["param_groups"]}


def load_full_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Load what :func:`full_optimizer_state` produced: each state tensor is padded and sharded like its parameter."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    local = {}
    for idx, per_param in state["state"].items():
        param = params[int(idx)]
        local[idx] = {
            k: _shard_like(v, param) if isinstance(v, Tensor) and v.dim() >= 1 else v for k, v in per_param.items()
        }
    optimizer.load_state_dict({"state": local, "param_groups": state["param_groups"]})
