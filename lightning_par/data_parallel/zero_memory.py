"""Per-rank model-state bytes under ZeRO, and the paper's formulas they are compared with.

:func:`lightning_par.memory.model_state_bytes` counts the module's parameters and gradients and the optimizer's
``state``. ZeRO stages 1 and 2 give the optimizer parameters of their own: ``Shard(0)`` chunks (views of the module's
parameters, or fp32 masters under mixed precision) whose gradients are, at stage 2, the only gradients left. Those
are counted by :func:`zero_state_bytes`, which extends ``model_state_bytes`` by

* gradients: also the ``.grad`` of every optimizer parameter;
* optimizer state: also every optimizer parameter whose storage is not a module parameter's (fp32 master copies);

all deduplicated by storage (a chunk that is a view of a module parameter, or a gradient that is a view of a reducer
bucket, is counted once). For a module whose optimizer holds its own parameters (every strategy but ZeRO 1/2) the
two functions agree.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from lightning_par.comm_cost import ring_pass_bytes
from lightning_par.compat import local_tensor
from lightning_par.compat.lightning import plain_optimizer
from lightning_par.memory import model_state_bytes, storage_bytes

__all__ = ["paper_comm_bytes", "paper_state_bytes", "zero_state_bytes"]


def _storage_key(t: Tensor) -> tuple[str, int | None, int]:
    local = local_tensor(t)
    return (local.device.type, local.device.index, local.untyped_storage().data_ptr())


def zero_state_bytes(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> dict[str, int]:
    """``{"param_bytes", "grad_bytes", "optimizer_state_bytes"}`` of this rank, counting optimizer-owned shards.

    Args:
        module: the model (DTensor parameters count their local shard).
        optimizers: its optimizers (``LightningOptimizer`` is unwrapped).

    Returns:
        Bytes of distinct storages, see the module docstring.
    """
    optimizers = [plain_optimizer(o) for o in optimizers]
    counts = model_state_bytes(module, optimizers)
    params = list(module.parameters())
    opt_params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
    module_storages = {_storage_key(p) for p in params}
    masters = [p for p in opt_params if _storage_key(p) not in module_storages]
    state = [t for o in optimizers for per in o.state.values() for t in per.values() if isinstance(t, Tensor)]
    counts["grad_bytes"] = storage_bytes([p.grad for p in params] + [p.grad for p in opt_params])
    counts["optimizer_state_bytes"] = storage_bytes(state + masters)
    return counts


def paper_state_bytes(stage: int, numel: int, dp_size: int) -> float:
    """Bytes per rank of fp32 parameters, gradients and Adam state under ZeRO ``stage`` (Rajbhandari et al., SC'20,
    §5 and Figure 1, with 4-byte parameters and gradients and ``K = 8`` bytes of optimizer state per parameter):
    stage 0 (DDP) ``16 Psi``, 1 ``8 Psi + 8 Psi / N``, 2 ``4 Psi + 12 Psi / N``, 3 ``16 Psi / N``.

    Raises:
        ValueError: ``stage`` not in 0..3.
    """
    n = dp_size
    formulas = {0: 16.0, 1: 8.0 + 8.0 / n, 2: 4.0 + 12.0 / n, 3: 16.0 / n}
    if stage not in formulas:
        raise ValueError(f"stage={stage!r} is not valid: expected 0, 1, 2 or 3.")
    return formulas[stage] * numel


def paper_comm_bytes(stage: int, numel: int, dp_size: int, element_size: int = 4) -> float:
    """Bytes each rank sends per step for ``stage`` per the paper's §7 (bandwidth-optimal ring collectives, in which
    an all-reduce of ``Psi`` sends ``2 Psi (N-1)/N`` and an all-gather or reduce-scatter ``Psi (N-1)/N``):
    stages 0, 1, 2: ``2 Psi (N-1)/N``; stage 3: ``3 Psi (N-1)/N``.

    Raises:
        ValueError: ``stage`` not in 0..3.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r} is not valid: expected 0, 1, 2 or 3.")
    passes = 3.0 if stage == 3 else 2.0  # ring passes over the parameters' bytes
    return ring_pass_bytes(passes * numel * element_size, dp_size)
