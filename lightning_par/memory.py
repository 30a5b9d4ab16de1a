"""Byte counts of model state (parameters, gradients, optimizer state), of live storages, and of the peak of a step.

Parameters may be plain tensors or ``DTensor`` shards, and several tensors may share one storage (views of a flat
buffer, ZeRO shards carved out of one allocation, tied weights). Every count here is of *distinct storages* on this
rank, so a shared allocation is counted once and a ``DTensor`` contributes only its local shard.

Peak memory of a step: on CUDA, ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``. The CPU has
no such counter (process RSS hides tensors: it stays flat at hundreds of MiB for a tiny model), so
:class:`StepMemoryTracker` counts tensor storages itself: the model state alive when it starts, plus every storage an
operator creates while it is active (a ``TorchDispatchMode``), each subtracted again when its storage is freed (a
weak reference on the storage). :class:`LiveStorageBytes` is the accounting both use.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_par.compat import TorchDispatchMode, local_tensor, tree_leaves
from lightning_par.compat.lightning import plain_optimizer

__all__ = [
    "LiveStorageBytes",
    "StepMemoryTracker",
    "model_state_bytes",
    "model_state_tensors",
    "peak_memory_bytes",
    "storage_bytes",
]


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
        for local in _leaf_tensors(tensor):
            if local.device.type == "meta":
                continue
            key = _storage_key(local)
            if key in seen:
                continue
            seen.add(key)
            total += local.untyped_storage().nbytes()
    return total


def _leaf_tensors(tensor: Tensor) -> Iterator[Tensor]:
    """The plain tensors holding ``tensor``'s data on this rank: a ``DTensor``'s local shard; a wrapper tensor
    subclass's inner tensors (its ``__tensor_flatten__``: torchao's ``NF4Tensor`` holds its 4-bit codes and scales
    there, and has no storage of its own to read: ``untyped_storage()`` raises)."""
    local = local_tensor(tensor)
    flatten = getattr(local, "__tensor_flatten__", None)
    if flatten is None:
        yield local
        return
    names, _ = flatten()
    for name in names:
        yield from _leaf_tensors(getattr(local, name))


def _storage_key(tensor: Tensor) -> tuple[str, int | None, int]:
    """Identity of the storage holding ``tensor``'s data on this rank (a ``DTensor``'s local shard's; a wrapper
    subclass's first inner tensor's)."""
    local = next(_leaf_tensors(tensor))
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
        optimizer = plain_optimizer(optimizer)
        for per_param in optimizer.state.values():
            state_tensors.extend(_tensors_in(per_param))
        opt_params.extend(p for group in optimizer.param_groups for p in group["params"])
    # An optimizer may step tensors of its own (ZeRO 1/2 step shards of the parameters): their gradients are
    # gradients, and those whose storage is not a module parameter's (fp32 master copies) are optimizer state.
    module_storages = {_storage_key(p) for p in params if local_tensor(p).device.type != "meta"}
    masters = [
        p for p in opt_params if local_tensor(p).device.type != "meta" and _storage_key(p) not in module_storages
    ]
    return {
        "param_bytes": storage_bytes(params),
        "grad_bytes": storage_bytes([p.grad for p in params] + [p.grad for p in opt_params]),
        "optimizer_state_bytes": storage_bytes(state_tensors + masters),
    }


def param_split_bytes(module: nn.Module) -> dict[str, int]:
    """Bytes this rank holds of the trainable and of the frozen parameters of ``module`` (local shards of DTensors):
    ``{"trainable_param_bytes", "frozen_param_bytes"}`` (their sum is :func:`model_state_bytes`'s ``param_bytes``).
    Under LoRA the frozen base is most of the bytes and the trainable adapters a few percent (docs/lora.md)."""
    params = list(module.parameters())
    return {
        "trainable_param_bytes": storage_bytes([p for p in params if p.requires_grad]),
        "frozen_param_bytes": storage_bytes([p for p in params if not p.requires_grad]),
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


def model_state_tensors(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> list[Tensor]:
    """Every tensor of the model state on this rank: parameters, their gradients, buffers, the optimizers' own
    parameters (ZeRO shards, fp32 masters) and their gradients, and every tensor in the optimizers' ``state``."""
    tensors: list[Tensor] = []
    for p in module.parameters():
        tensors.append(p)
        if p.grad is not None:
            tensors.append(p.grad)
    tensors.extend(module.buffers())
    for optimizer in optimizers:
        optimizer = plain_optimizer(optimizer)
        for group in optimizer.param_groups:
            for p in group["params"]:
                tensors.append(p)
                if p.grad is not None:
                    tensors.append(p.grad)
        for per_param in optimizer.state.values():
            tensors.extend(_tensors_in(per_param))
    return tensors


class LiveStorageBytes:
    """Bytes of the distinct storages registered with :meth:`add` that are still alive, and their peak.

    A storage is counted from its registration until it is freed: a weak reference on the ``UntypedStorage`` (whose
    Python object lives exactly as long as the storage, and is the same object for every tensor viewing it)
    subtracts it when the last tensor using it goes; :meth:`resized` follows a storage resized in place (FSDP2 frees
    and re-allocates its unsharded parameters that way). Views of a registered storage add nothing. ``DTensor``\ s
    count their local shard; meta tensors count nothing.

    Attributes:
        live: bytes registered and not yet freed.
        peak: the largest ``live`` since construction or :meth:`reset_peak`.
    """

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._refs: dict[int, tuple[weakref.ref, int]] = {}

    def add(self, tensor: Tensor) -> None:
        """Count ``tensor``'s storage if it is not counted yet."""
        local = local_tensor(tensor)
        if local.device.type == "meta":
            return
        try:
            storage = local.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without a real storage (functional/fake wrappers)
            return
        key = id(storage)
        known = self._refs.get(key)
        if known is not None and known[0]() is storage:
            return
        nbytes = storage.nbytes()
        self._refs[key] = (weakref.ref(storage, lambda _ref, key=key: self._free(key)), nbytes)
        self._change(nbytes)

    def add_all(self, tensors: Iterable[Tensor | None]) -> None:
        """:meth:`add` every tensor (``None`` entries skipped)."""
        for t in tensors:
            if t is not None:
                self.add(t)

    def resized(self, storage: Any) -> None:
        """Account for ``storage`` (an ``UntypedStorage``) having been resized in place; counts it if it is new."""
        key = id(storage)
        known = self._refs.get(key)
        nbytes = storage.nbytes()
        if known is None or known[0]() is not storage:
            self._refs[key] = (weakref.ref(storage, lambda _ref, key=key: self._free(key)), nbytes)
            self._change(nbytes)
            return
        self._refs[key] = (known[0], nbytes)
        self._change(nbytes - known[1])

    def _change(self, delta: int) -> None:
        self.live += delta
        if self.live > self.peak:
            self.peak = self.live

    def _free(self, key: int) -> None:
        entry = self._refs.pop(key, None)
        if entry is not None:
            self.live -= entry[1]

    def reset_peak(self) -> None:
        """Start a new peak from the bytes alive now."""
        self.peak = self.live


class StepMemoryTracker(TorchDispatchMode):
    """Peak bytes of tensor storage on this rank while the tracker is active (a context manager), on CPU.

    On entry it counts the storages of ``tensors`` (the model state: :func:`model_state_tensors`); while active,
    every storage created by an operator (forward, backward, optimizer, collectives' buffers) is counted until it is
    freed, and storages resized in place are followed. :attr:`peak_bytes` is then the most storage bytes alive at
    once. ``DTensor`` operators are let through to their local operators, which are counted. Not counted: tensors alive before entry that are not in ``tensors``
    (a data batch, a reducer's persistent buffers), and memory outside tensors (the backends' own buffers).

    The mode costs one Python call per operator: measure a few steps, not the whole run.

    Args:
        tensors: tensors alive at entry to count from the start.
    """

    def __init__(self, tensors: Iterable[Tensor | None] = ()) -> None:
        super().__init__()
        self.live = LiveStorageBytes()
        self._initial = [t for t in tensors if t is not None]

    def __enter__(self) -> StepMemoryTracker:
        self.live.add_all(self._initial)
        self._initial = []
        self.start_bytes = self.live.live
        # Storages resized in place (FSDP2 unshards and reshards its parameters so) are not operators: follow them.
        self._resize = torch.UntypedStorage.resize_
        live, resize = self.live, self._resize

        def tracked_resize(storage: Any, size: int) -> Any:
            out = resize(storage, size)
            live.resized(storage)
            return out

        torch.UntypedStorage.resize_ = tracked_resize  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        super().__exit__(*args)

    @property
    def peak_bytes(self) -> int:
        """Most bytes of the counted storages alive at once while active."""
        return self.live.peak

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor run its local operators, which come back here
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                self.live.add(t)
        return out
