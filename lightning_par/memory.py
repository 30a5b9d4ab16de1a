"""Byte counts of model state (parameters, gradients, optimizer state) and of a device's peak memory.

Parameters may be plain tensors or ``DTensor`` shards, and several tensors may share one storage (views of a flat
buffer, ZeRO shards carved out of one allocation, tied weights). Every count here is of *distinct storages* on this
rank, so a shared allocation is counted once and a ``DTensor`` contributes only its local shard.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["model_state_bytes", "peak_memory_bytes", "storage_bytes"]


def _local(tensor: Tensor) -> Tensor:
    """The tensor whose storage holds ``tensor``'s data on this rank (a ``DTensor``'s local shard, else itself)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed support
        return tensor
    if isinstance(tensor, DTensor):
        local = getattr(tensor, "_local_tensor", None)
        return local if local is not None else tensor.to_local()
    return tensor


def storage_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` on this rank.

    Each tensor is resolved to the storage that holds its data (a ``DTensor`` to its local shard) and storages are
    deduplicated by ``(device, untyped_storage().data_ptr())``. Consequences:

    * a view counts its *whole* storage, once: a slice of a 1 GiB flat buffer counts 1 GiB, and the buffer plus all
      its views count 1 GiB in total;
    * two tensors with separate storages count twice, even if their values are equal;
    * meta tensors count 0 bytes: they allocate no memory;
    * ``None`` entries are skipped, so ``(p.grad for p in params)`` can be passed as is.

    Args:
        tensors: tensors or ``DTensor``\\ s (``None`` entries allowed).

    Returns:
        Total bytes of the distinct storages.

    Raises:
        TypeError: an entry is neither a tensor nor ``None``.
    """
    seen: set[tuple[str, int | None, int]] = set()
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        if not isinstance(tensor, Tensor):
            raise TypeError(f"storage_bytes expects tensors, got {type(tensor).__name__}.")
        local = _local(tensor)
        if local.device.type == "meta":
            continue
        key = _storage_key(local)
        if key in seen:
            continue
        seen.add(key)
        total += local.untyped_storage().nbytes()
    return total


def _storage_key(tensor: Tensor) -> tuple[str, int | None, int]:
    """Identity of the storage holding ``tensor``'s data on this rank (a ``DTensor``'s local shard's)."""
    local = _local(tensor)
    return (local.device.type, local.device.index, local.untyped_storage().data_ptr())


def _tensors_in(value: Any) -> Iterator[Tensor]:
    """Every tensor inside ``value``, looking through dicts, lists and tuples."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)


def model_state_bytes(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> dict[str, int]:
    """Bytes this rank holds for the parameters, gradients and optimizer state of ``module``.

    Args:
        module: the model; all of ``module.parameters()`` are counted (local shards for ``DTensor`` parameters).
        optimizers: optimizers whose ``state`` to count. A Lightning ``LightningOptimizer`` is unwrapped via its
            ``_optimizer`` attribute.

    Returns:
        ``{"param_bytes", "grad_bytes", "optimizer_state_bytes"}``, each the bytes of distinct storages (see
        :func:`storage_bytes`). ``grad_bytes`` counts the gradients of the module's parameters and of the
        optimizers' own parameters (ZeRO stage 2 keeps only the gradient shards of the optimizer's parameter shards).
        ``optimizer_state_bytes`` counts every tensor in every ``optimizer.state[p]``, including scalar ones such as
        Adam's per-parameter ``step`` counter (a 4-byte float32 tensor in ``torch.optim.Adam``), and the optimizers'
        parameters whose storage is not a module parameter's (fp32 master shards under mixed precision). It is 0
        before the first ``optimizer.step()``, when the state is still empty.
    """
    params = list(module.parameters())
    state_tensors: list[Tensor] = []
    opt_params: list[Tensor] = []
    for optimizer in optimizers:
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        for per_param in optimizer.state.values():
            state_tensors.extend(_tensors_in(per_param))
        opt_params.extend(p for group in optimizer.param_groups for p in group["params"])
    # An optimizer may step tensors of its own (ZeRO 1/2 step shards of the parameters): their gradients are
    # gradients, and those whose storage is not a module parameter's (fp32 master copies) are optimizer state.
    module_storages = {_storage_key(p) for p in params if _local(p).device.type != "meta"}
    masters = [p for p in opt_params if _local(p).device.type != "meta" and _storage_key(p) not in module_storages]
    return {
        "param_bytes": storage_bytes(params),
        "grad_bytes": storage_bytes([p.grad for p in params] + [p.grad for p in opt_params]),
        "optimizer_state_bytes": storage_bytes(state_tensors + masters),
    }


def peak_memory_bytes(device: torch.device | str | int) -> int:
    """Peak memory of this process on ``device``, in bytes.

    * CUDA: ``torch.cuda.max_memory_allocated(device)``, the peak bytes held by tensors through PyTorch's caching
      allocator since the start or the last ``torch.cuda.reset_peak_memory_stats``.
    * CPU: the process's peak resident set size (``resource.getrusage(RUSAGE_SELF).ru_maxrss``; KiB on Linux, bytes
      on macOS). This is *whole-process* RSS (the Python interpreter, libraries, data loader buffers, ...), not tensor
      bytes, and it is never reset.

    Args:
        device: a ``torch.device``, a string such as ``"cuda:0"``, or a CUDA device index.

    Returns:
        Peak bytes.

    Raises:
        ValueError: a device type other than CUDA or CPU.
        RuntimeError: CPU on a platform without the ``resource`` module (Windows).
    """
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    if device.type == "cpu":
        try:
            import resource
        except ImportError as err:
            raise RuntimeError("peak_memory_bytes on CPU needs the `resource` module (POSIX only).") from err
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)
    raise ValueError(f"peak_memory_bytes supports CUDA and CPU devices, got device={str(device)!r}.")
