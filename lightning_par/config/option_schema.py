"""Hydra schemas generated from the options dataclasses, so that each option's default is written once.

The options dataclasses (:class:`~lightning_par.data_parallel.options.ReducerOptions`,
:class:`~lightning_par.pipeline_parallel.options.PipelineOptions`, ...) are frozen and validate themselves in
``__post_init__``, and some of their fields have types OmegaConf cannot check (a ``torch.dtype``, a
``str | Sequence[int]`` union). :func:`options_schema` builds a plain dataclass with the same field names and defaults:
simple types (``int``, ``float``, ``str``, ``bool`` and their ``Optional``) are kept, any other is typed ``Any`` and
left to the options dataclass to check when the strategy builds it.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Optional

__all__ = ["SIMPLE_TYPES", "options_schema", "schema_type", "signature_defaults"]

#: Field types OmegaConf checks as they are (also inside ``Optional``).
SIMPLE_TYPES: tuple[type, ...] = (int, float, str, bool)


def schema_type(annotation: Any) -> Any:
    """The OmegaConf field type for an options field's type: a simple type or its ``Optional``, else ``Any``."""
    if annotation in SIMPLE_TYPES:
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(annotation)) == 2 and args[0] in SIMPLE_TYPES:
            return Optional[args[0]]  # noqa: UP007 - OmegaConf reads typing.Optional
    return Any


def _default(value: Any) -> dataclasses.Field:
    if isinstance(value, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(value)(value))
    return dataclasses.field(default=value)


def options_schema(
    name: str,
    options: type,
    *,
    doc: str,
    defaults: Mapping[str, Any] | None = None,
    unset: Iterable[str] = (),
    module: str | None = None,
) -> type:
    """A Hydra structured-config dataclass whose fields and defaults are those of the options dataclass ``options``.

    Args:
        name: the class name (also its ``__qualname__``).
        options: the options dataclass the fields, types and defaults come from (fields without a default, such as
            ``ZeroOptions.stage``, are left out).
        doc: the class docstring.
        defaults: the group's fields and defaults when they are not ``options``'s own fields (the ``zero`` group:
            :data:`~lightning_par.data_parallel.options.ZERO_GROUP_DEFAULTS`); a name that is also a field of
            ``options`` takes that field's type, any other is typed ``Any``.
        unset: fields whose schema default is ``None``, typed ``Optional``: only for a field whose options dataclass
            documents ``None`` as "the default" (``ReducerOptions.bucket_cap_mb``, which ``zero3`` needs unset).
        module: the ``__module__`` of the class (the module that exports it).

    Raises:
        ValueError: an ``unset`` name that is not a field of the schema.
    """
    hints = typing.get_type_hints(options)
    if defaults is None:
        defaults = {
            f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            for f in dataclasses.fields(options)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        }
    unset = tuple(unset)
    unknown = sorted(set(unset) - set(defaults))
    if unknown:
        raise ValueError(f"unset={unknown} is not valid for {name}: expected fields among {sorted(defaults)}.")
    spec = []
    for key, value in defaults.items():
        tp = schema_type(hints.get(key, Any))
        if key in unset:
            tp, value = (Optional[tp] if tp is not Any else Any), None  # noqa: UP007
        spec.append((key, tp, _default(value)))
    namespace = {"__doc__": doc, "__module__": module or options.__module__}
    cls = dataclasses.make_dataclass(name, spec, namespace=namespace)
    cls.__qualname__ = name
    return cls


def signature_defaults(function: Callable[..., Any], names: Iterable[str]) -> dict[str, Any]:
    """The defaults of ``names`` in ``function``'s signature (a constructor that is the source of those defaults).

    Raises:
        ValueError: a name that is not a parameter of ``function`` with a default.
    """
    params = inspect.signature(function).parameters
    out: dict[str, Any] = {}
    for key in names:
        if key not in params or params[key].default is inspect.Parameter.empty:
            valid = sorted(k for k, p in params.items() if p.default is not inspect.Parameter.empty)
            raise ValueError(f"{key!r} is not valid for {function.__qualname__}: expected a parameter among {valid}.")
        out[key] = params[key].default
    return out
