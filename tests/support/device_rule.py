"""NCCL's device rule, applied on a CPU: a collective that receives a tensor built on the host fails the test.

NCCL accepts CUDA tensors only (torch 2.13: ``Backend.backend_capability["nccl"] == ["cuda"]``); a CPU tensor in an
``nccl`` collective raises ``RuntimeError: No backend type associated with device type cpu``. gloo accepts any
device, and on a CPU machine the strategy's root device *is* the CPU, so a tensor built with ``torch.tensor(...)``
and no ``device=`` reaches the collective unnoticed. :class:`DeviceRule` tells the two apart by where a tensor came
from, which is what decides its device on a GPU machine:

* a tensor built by a factory (``torch.tensor``, ``torch.zeros``, ``torch.arange``, ... :
  ``torch.utils._device._device_constructors``) with no ``device=`` and no tensor argument is a **host** tensor;
  ``Tensor.cpu()`` gives a host tensor too (when it copies);
* what an operation computes from host tensors only is a host tensor (``torch.empty_like(host)``, ``host * 2``);
  with any other tensor among its inputs it is not (a 0-dim CPU tensor mixed into a CUDA operation gives CUDA);
* ``.to(device)`` / ``.cuda()`` / a factory with ``device=`` give a tensor on the accelerator.

A ``TorchFunctionMode`` marks host tensors (an attribute on the tensor object); a ``TorchDispatchMode`` sees every
collective as the dispatcher sees it (``c10d.allreduce_``, ``c10d.allgather_``, ``c10d.send``, the functional
collectives ``_c10d_functional.*``: also those torch's own code calls, FSDP2's and ``PipelineStage``'s) and raises
:class:`HostTensorInCollective`, the message NCCL would give plus the line of the package that made the call. Object
collectives (``broadcast_object_list``) pass: torch moves their bytes to the group's device itself.

Why this and not a ``meta:fake`` group or a ``cuda:gloo`` backend map: a whole Lightning fit (data, validation,
checkpoint save and resume) does not run on ``meta``, and ``cuda:gloo`` needs a CUDA device; this check runs every
layout's real one-step fits on gloo, for the price of two Python modes. What it cannot see: a host tensor moved with
``.to(the root device)`` is taken as moved (right on a GPU), and ``.cpu()`` of a CPU tensor returns the same tensor,
which stays unmarked. The unit test ``tests/core/test_device_discipline.py`` adds the AST check and NCCL's own rule
on a ``meta:fake`` group.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_par.profiling.host_syncs import SYNC_MESSAGE as _SYNC

__all__ = ["DeviceRule", "HostReads", "HostTensorInCollective", "is_host", "rule_report"]

_MARK = "_lp_built_on_host"
_FACTORIES = _device_constructors()
_MOVES = {torch.Tensor.to, torch.Tensor.cuda}
_COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "_c10d_functional_autograd"}


class HostTensorInCollective(RuntimeError):
    """A collective received a tensor that would live on the host on a GPU machine (NCCL would refuse it)."""


def is_host(t: Any) -> bool:
    """Whether ``t`` is a tensor :class:`DeviceRule` counts as built on the host."""
    return isinstance(t, torch.Tensor) and bool(getattr(t, _MARK, False))


def _mark(t: torch.Tensor, host: bool) -> None:
    try:
        if host:
            setattr(t, _MARK, True)
        elif getattr(t, _MARK, False):
            delattr(t, _MARK)
    except (AttributeError, RuntimeError):  # a tensor subclass without __dict__
        pass


class _Track(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func in _MOVES:
            moved = func is torch.Tensor.cuda or any(
                isinstance(a, (torch.device, str, int)) and not isinstance(a, bool) for a in args[1:]
            ) or "device" in kwargs or any(isinstance(a, torch.Tensor) for a in args[1:])
            if not moved:  # .to(dtype): the device stays
                host = bool(inputs) and is_host(inputs[0])
            else:
                host = False
        elif kwargs.get("device") is not None:
            host = False
        elif func is torch.Tensor.cpu:
            if out is args[0]:
                return out  # a CPU run: the same tensor, left as it was
            host = True
        elif func in _FACTORIES and not inputs:
            host = True
        else:
            host = bool(inputs) and all(is_host(t) for t in inputs)
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            if func not in _MOVES and any(t is i for i in inputs):
                continue  # an in-place operation, or one that returns its input: unchanged
            _mark(t, host)
        return out


def _caller() -> str:
    """The innermost frame of lightning_par's own code (else of torch's, else the test's)."""
    frames = traceback.extract_stack()[:-3]
    for want in ("/lightning_par/", "/torch/", ""):
        for f in reversed(frames):
            if want in f.filename and "device_rule.py" not in f.filename:
                return f"{f.filename.split('/lightning_par/')[-1] if want else f.filename}:{f.lineno} ({f.name})"
    return "?"


class _Check(TorchDispatchMode):
    def __init__(self, rule: DeviceRule) -> None:
        super().__init__()
        self.rule = rule

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace in _COLLECTIVE_NAMESPACES:
            self.rule.collectives += 1
            if self.rule.watch:
                self.rule._count_watched()
            bad = [t for t in tree_leaves((args, kwargs)) if is_host(t)]
            if bad:
                where = _caller()
                self.rule.violations.append(f"{func} at {where}")
                raise HostTensorInCollective(
                    f"No backend type associated with device type cpu (NCCL's device rule, checked on the CPU by "
                    f"tests/support/device_rule.py): {func} received a tensor built on the host "
                    f"(shape {tuple(bad[0].shape)}, {bad[0].dtype}: a factory without device=, or computed from "
                    f"such tensors only), called from {where}. Build it on the group's device "
                    f"(the strategy's root device, or the device of the tensors it comes from)."
                )
        return func(*args, **kwargs)


class DeviceRule:
    """``with DeviceRule() as rule: ...``: every collective inside raises :class:`HostTensorInCollective` on a
    tensor built on the host (see the module docstring). ``rule.collectives`` counts the collectives checked,
    ``rule.violations`` names the ones refused.

    Args:
        watch: package names (``"torchft"``): ``rule.watched[name]`` counts the collectives checked that a frame of
            that package's files issued (a wrapper library's own collectives, e.g. torchft's ``Manager.allreduce``
            through its ``ProcessGroupGloo``, which reaches the dispatcher as ``c10d.allreduce_``).
    """

    def __init__(self, watch: tuple[str, ...] = ()) -> None:
        self.collectives = 0
        self.violations: list[str] = []
        self.watch = tuple(watch)
        self.watched: dict[str, int] = dict.fromkeys(self.watch, 0)
        self._modes: list[Any] = []

    def _count_watched(self) -> None:
        frame = sys._getframe(2)
        seen: set[str] = set()
        while frame is not None:
            path = frame.f_code.co_filename
            for name in self.watch:
                if name not in seen and f"/{name}/" in path:
                    seen.add(name)
                    self.watched[name] += 1
            frame = frame.f_back

    def __enter__(self) -> DeviceRule:
        self._modes = [_Track(), _Check(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []


@contextlib.contextmanager
def rule_report(step: dict[str, Any], report: dict[str, Any]) -> Iterator[None]:
    """The ``wrap`` of :func:`tests.support.p3d.plan_worker`: the step runs under a :class:`DeviceRule` watching
    ``step.get("watch", ())``; its exception is caught and written into ``report`` (``"error"``, a string, else
    ``None``), with ``"collectives"``, ``"watched"`` and ``"violations"``, so that one refused case does not stop the
    plan (every rank refuses the same collective, so none waits on the others)."""
    rule = DeviceRule(watch=tuple(step.get("watch", ())))
    report["error"] = None
    try:
        with rule:
            yield
    except Exception as err:  # noqa: BLE001 - reported by the case's test
        report["error"] = f"{type(err).__name__}: {err}"[:2000]
    finally:
        report.update(collectives=rule.collectives, watched=dict(rule.watched), violations=list(rule.violations))


_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__bool__,
          torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.cpu}
_UPLOADS = {torch.tensor, torch.as_tensor}


class HostReads(_Track):
    """A CPU stand-in for CUDA's sync debug mode: while active, every read to the host of a tensor that would live on
    the GPU (not :func:`is_host`: ``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``, ``.cpu()``, ...) and every
    upload of Python data to a device (``torch.tensor(data, device=...)``) warns with
    :data:`lightning_par.profiling.host_syncs.SYNC_MESSAGE`, as torch does on CUDA under
    ``set_sync_debug_mode("warn")``; the recording and counting of the GPU test then apply unchanged on gloo.

    It sees what goes through torch's Python API: a synchronisation inside a C++ kernel (``torch.bincount`` or a
    boolean mask on CUDA, a blocking copy made by ``.to(device)`` of a host tensor) shows on a GPU only, and a read of
    a tensor that is on the CPU on a GPU machine too but was not built by a factory here (a loaded batch before it is
    moved) counts where it would not."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _READS and args and isinstance(args[0], torch.Tensor) and not is_host(args[0]):
            warnings.warn(f"{_SYNC} (CPU stand-in: {func.__name__} of a tensor on the device)", stacklevel=2)
        elif func in _UPLOADS and _on_device(kwargs.get("device")) and not any(
                isinstance(t, torch.Tensor) for t in tree_leaves(args)):
            warnings.warn(f"{_SYNC} (CPU stand-in: {func.__name__} of host data to a device)", stacklevel=2)
        out = super().__torch_function__(func, types, args, kwargs)
        if isinstance(kwargs.get("device"), str) and not _on_device(kwargs["device"]):
            for t in tree_leaves(out):  # device="cpu" given: on the host on a GPU machine too (an optimizer's step)
                if isinstance(t, torch.Tensor):
                    _mark(t, True)
        return out


def _on_device(device: Any) -> bool:
    """Whether a ``device=`` argument names the accelerator on a GPU machine: given, and not ``"cpu"`` by name (on
    this CPU machine the strategy's root device is the CPU too, passed as ``torch.device("cpu")`` or ``"cpu"``; only
    a literal ``"cpu"`` string in the code is taken as the host, as it stays the host on a GPU machine)."""
    return device is not None and not (isinstance(device, str) and device == "cpu")
