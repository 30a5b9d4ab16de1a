"""Undo what :func:`~lightning_par.parallelize.parallelize` did to a module, so that a second, new Trainer (or any
later :func:`~lightning_par.parallelize.parallelize`) starts from the plain module with the trained values.

``parallelize()`` changes the user's module in place: the pipeline cut puts a holder of this rank's stages where the
network was, the tensor-parallel styles and FSDP2 replace parameters by DTensors, register module hooks, swap classes
(``FSDP<Class>``, activation checkpointing's ``Checkpointed<Class>``) and set attributes, the dp engines hook the
parameters. Lightning's own strategies leave a module that a new Trainer can take again; so must these.

:class:`ModuleSnapshot` records, before any step, the plain structure of every module of the tree (its class, its
attributes, its hook tables, its children and buffers, and of each parameter only its name, shape, dtype, device and
``requires_grad``, never the tensor: holding the original parameters would keep a whole replica alive next to the
shards), and right after the steps what they changed (:meth:`ModuleSnapshot.seal`). :meth:`ModuleSnapshot.restore`
then reverts exactly those changes, leaving alone what others changed after ``parallelize()`` (the user's own
attributes and hooks), and puts fresh plain parameters holding the given full values in place (tied parameters stay
tied). Parameters of modules the pipeline cut left off this rank are released at :meth:`~ModuleSnapshot.seal` (they
are restored from the other stages' values).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_par.compat import (
    PARAMETER_TABLE,
    buffer_table,
    forget_composable_state,
    has_composable_state,
    parameter_table,
)

__all__ = ["ModuleSnapshot", "ParamRecord"]

_MISSING = object()


@dataclass(frozen=True)
class ParamRecord:
    """A parameter of the plain module, without its values.

    Attributes:
        name: its name relative to the snapshot's root (the first name of a tied parameter).
        shape: its full shape.
        dtype: its dtype.
        device: its device.
        requires_grad: whether it is trained.
        kind: its class (``nn.Parameter`` or a subclass with the same constructor).
    """

    name: str
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    kind: type


def _entries(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[Any, Any]]]:
    """A module's ``__dict__`` entries (parameters left out), and a copy of the contents of each dict-valued one
    (hook tables, children, buffers), since torch changes those in place."""
    refs = {k: v for k, v in state.items() if k != PARAMETER_TABLE}  # handled apart from the generic rule
    return refs, {k: copy.copy(v) for k, v in refs.items() if isinstance(v, dict)}


class _ModuleRecord:
    def __init__(self, module: nn.Module, params: dict[str, ParamRecord | None], buffers: dict[str, str]) -> None:
        self.module = module
        self.cls = type(module)
        self.entries, self.tables = _entries(module.__dict__)
        self.params = params  # local name -> record (None: a None entry)
        self.buffers = buffers  # local name -> name relative to the root
        self.sealed_cls: type | None = None
        self.sealed_entries: dict[str, Any] = {}
        self.sealed_tables: dict[str, dict[Any, Any]] = {}
        self.sealed_params: set[str] = set()
        self.had_state = has_composable_state(module)
        self.sealed_state = False


class ModuleSnapshot:
    """The plain structure of a module tree (see the module docstring).

    Args:
        root: the module about to be parallelised in place.
    """

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        first_name: dict[int, str] = {}
        #: the first parameter that already is a DTensor (parallelised by other code: it cannot be put back in full).
        self.foreign: str | None = None
        for name, p in root.named_parameters(remove_duplicate=False):
            first_name.setdefault(id(p), name)
            if self.foreign is None and _is_dtensor(p):
                self.foreign = name
        self.records: list[_ModuleRecord] = []
        for prefix, module in root.named_modules(remove_duplicate=True):
            params = {
                n: None if p is None else ParamRecord(
                    first_name[id(p)], p.shape, p.dtype, p.device, p.requires_grad, type(p)
                )
                for n, p in parameter_table(module).items()
            }
            buffers = {n: f"{prefix}.{n}" if prefix else n for n, b in buffer_table(module).items() if b is not None}
            self.records.append(_ModuleRecord(module, params, buffers))
        self._sealed = False

    @property
    def param_names(self) -> list[str]:
        """The names (relative to the root) of the plain module's parameters, tied ones once."""
        seen: dict[str, None] = {}
        for r in self.records:
            for rec in r.params.values():
                if rec is not None:
                    seen.setdefault(rec.name)
        return list(seen)

    def seal(self, live: Iterable[nn.Module] = ()) -> None:
        """Record what ``parallelize()`` changed (call right after it). Parameters of the plain tree that no module of
        the parallel tree (``root``) nor of ``live`` (the pipeline's stage modules) holds any more (other stages')
        are dropped from the modules the cut left off, so that this rank does not keep them alive."""
        for r in self.records:
            r.sealed_cls = type(r.module)
            r.sealed_entries, r.sealed_tables = _entries(r.module.__dict__)
            r.sealed_params = set(parameter_table(r.module))
            r.sealed_state = has_composable_state(r.module)
        held = {id(p) for m in (self.root, *live) for p in m.parameters()}
        attached = {id(m) for m in (self.root, *live) for m in m.modules()}
        for r in self.records:
            if id(r.module) in attached:
                continue
            table = parameter_table(r.module)
            for name, p in list(table.items()):
                if p is not None and id(p) not in held:
                    table[name] = None
        self._sealed = True

    @torch.no_grad()
    def restore(self, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor]) -> nn.Module:
        """Put the plain tree back with the given values.

        Args:
            params: the full value of every parameter of the plain module by its name relative to the root (as
                :attr:`param_names`; a tied parameter under any of its names).
            buffers: full values of buffers by name relative to the root; a buffer not given keeps its value.

        Returns:
            The root.

        Raises:
            RuntimeError: before :meth:`seal`.
            KeyError: a parameter missing from ``params``.
            ValueError: a value whose shape is not the plain parameter's; a tree whose parameters already were
                DTensors when recorded (parallelised by other code, e.g. the user's ``configure_model``): its plain
                form is unknown.
        """
        if not self._sealed:
            raise RuntimeError("ModuleSnapshot.restore() needs seal() right after the module was parallelised.")
        if self.foreign is not None:
            raise ValueError(
                f"{type(self.root).__name__} cannot be put back to its plain form: its parameter {self.foreign!r} "
                f"already was a DTensor before lightning_par parallelised it (parallelised by other code, e.g. "
                f"configure_model). Build a new module for the next Trainer, and load the trained weights from the "
                f"checkpoint (lightning_par.checkpoint.load_from_checkpoint)."
            )
        fresh: dict[str, nn.Parameter] = {}
        for r in self.records:
            module = r.module
            if type(module) is r.sealed_cls and r.sealed_cls is not r.cls:
                module.__class__ = r.cls
            if r.sealed_state and not r.had_state:
                forget_composable_state(module)
            state = module.__dict__
            for key in set(r.entries) | set(r.sealed_entries):
                before, sealed = r.entries.get(key, _MISSING), r.sealed_entries.get(key, _MISSING)
                now = state.get(key, _MISSING)
                if now is not sealed:
                    continue  # set by someone else since parallelize(): theirs
                if before is _MISSING:
                    del state[key]
                elif before is not sealed:
                    state[key] = before
                elif key in r.tables:  # the same table, changed in place
                    _merge_table(now, r.tables[key], r.sealed_tables[key], hooks="hook" in key)
            table = parameter_table(module)
            extra = {n: p for n, p in table.items() if n not in r.params and n not in r.sealed_params}
            table.clear()
            for name, rec in r.params.items():
                table[name] = None if rec is None else _fresh(rec, params, fresh)
            table.update(extra)
            for name, full in r.buffers.items():
                value = buffers.get(full)
                current = buffer_table(module).get(name)
                if value is None or current is None:
                    continue
                if _is_dtensor(current) or current.shape != value.shape or current.dtype != value.dtype:
                    plain = value.detach().to(device=_plain_device(current), dtype=current.dtype)
                    buffer_table(module)[name] = plain.clone()
                else:
                    current.copy_(value.detach())
        self._sealed = False
        return self.root


#: Where the engines' own hooks come from: a hook table entry added after ``parallelize()`` by a function of these
#: packages is an engine's (FSDP2 registers its state-dict hooks lazily, at the first forward) and goes with them.
_ENGINE_PACKAGES = ("torch.distributed", "lightning_par")


def _engine_hook(value: Any) -> bool:
    fn = getattr(value, "hook", value)  # torch's _WrappedHook keeps the hook in .hook
    fn = getattr(fn, "func", fn)  # functools.partial
    where = getattr(fn, "__module__", None) or type(fn).__module__
    return isinstance(where, str) and where.startswith(_ENGINE_PACKAGES)


def _merge_table(now: dict[Any, Any], before: dict[Any, Any], sealed: dict[Any, Any], hooks: bool = False) -> None:
    """Revert, in place (hook handles keep a reference to the table), the entries of one table (hooks, children,
    buffers) that changed between ``before`` and ``sealed`` and were not changed again since: the order is
    ``before``'s, entries added by others after ``sealed`` come last (for a hook table, unless an engine's: see
    :data:`_ENGINE_PACKAGES`)."""
    out: dict[Any, Any] = {}
    for key, value in before.items():
        current = now.get(key, _MISSING)
        if current is sealed.get(key, _MISSING):
            out[key] = value  # untouched since parallelize(): the plain entry
        elif current is not _MISSING:
            out[key] = current  # changed by someone else since
    for key, value in now.items():
        if key not in out and value is not sealed.get(key, _MISSING) and not (hooks and _engine_hook(value)):
            out[key] = value  # added after parallelize() by someone else
    now.clear()
    now.update(out)


def _fresh(rec: ParamRecord, values: Mapping[str, Tensor], made: dict[str, nn.Parameter]) -> nn.Parameter:
    """One plain parameter per plain parameter (tied names share it), holding its full value."""
    p = made.get(rec.name)
    if p is not None:
        return p
    if rec.name not in values:
        raise KeyError(f"no value for parameter {rec.name!r} of the plain module")
    value = values[rec.name].detach()
    if _is_dtensor(value):
        value = value.full_tensor()
    if value.shape != rec.shape:
        raise ValueError(f"parameter {rec.name!r}: the value has shape {tuple(value.shape)}, the plain module "
                         f"{tuple(rec.shape)}")
    data = value.to(device=rec.device, dtype=rec.dtype, copy=True)
    try:
        p = rec.kind(data, requires_grad=rec.requires_grad)
    except TypeError:
        p = nn.Parameter(data, requires_grad=rec.requires_grad)
    made[rec.name] = p
    return p


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _plain_device(t: Tensor) -> torch.device:
    return t.to_local().device if _is_dtensor(t) else t.device
