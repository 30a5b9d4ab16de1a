"""Per-step values that code deep inside a model reads without being handed them: a step variable.

A training step hands a few values to code it does not call directly: the context-parallel sequence shard and the
packed block's document ids (read by a mixture-of-experts router and by attention), the auxiliary-loss factor (read
where a MoE layer attaches its losses). A :class:`StepVar` holds such a value for the duration of a ``with`` block
(:meth:`StepVar.scoped`), and gives it back on exit, exactly as :class:`contextvars.ContextVar` does with its tokens:
no value outlives the step that set it, and nested scopes restore the outer value.

Why not :class:`contextvars.ContextVar` itself: those values are read inside blocks that ``torch.compile`` traces
(``strategy.compile``), and dynamo cannot trace ``ContextVar.get`` (measured, torch 2.13: "Unsupported method call",
a graph break in every compiled block that reads one and an error under ``fullgraph=True``), while it traces an
attribute read of a :class:`threading.local` and guards on its value. A step variable is therefore per thread, as a
context variable is per thread outside asyncio; a thread that autograd runs backward on sees the default value, so a
recomputation in backward sets the values it needs itself (the ``recompute_context`` functions of
:mod:`lightning_par.context_parallel.attention` and :mod:`lightning_par.data.doc_mask`).
"""

from __future__ import annotations

import threading

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

__all__ = ["StepVar", "StepToken"]

T = TypeVar("T")


class StepToken:
    """What :meth:`StepVar.set` returns: the value to restore with :meth:`StepVar.reset`."""

    __slots__ = ("var", "old", "used")

    def __init__(self, var: StepVar[Any], old: Any) -> None:
        self.var, self.old, self.used = var, old, False


class StepVar(Generic[T]):
    """A value scoped to the ``with`` block that sets it, per thread (see the module docstring).

    Args:
        name: what the value is (for messages and ``repr``).
        default: the value outside every scope (immutable: a tuple, a number, ``None``).
    """

    __slots__ = ("name", "default", "_local")

    def __init__(self, name: str, default: T) -> None:
        self.name, self.default, self._local = name, default, threading.local()

    def __repr__(self) -> str:
        return f"StepVar({self.name!r}, value={self.get()!r})"

    def get(self) -> T:
        """The value of the innermost scope of this thread, or ``default`` outside every scope."""
        return getattr(self._local, "value", self.default)

    def set(self, value: T) -> StepToken:
        """Set the value until :meth:`reset` with the returned token (prefer :meth:`scoped`)."""
        token = StepToken(self, self.get())
        self._local.value = value
        return token

    def reset(self, token: StepToken) -> None:
        """Restore the value :meth:`set` replaced when it returned ``token``.

        Raises:
            ValueError: ``token`` came from another variable, or was used already.
        """
        if token.var is not self or token.used:
            raise ValueError(f"the token of {token.var.name!r} is not valid for {self.name!r} or was used already")
        token.used = True
        self._local.value = token.old

    @contextmanager
    def scoped(self, value: T) -> Generator[T, None, None]:
        """Hold ``value`` for the enclosed block, restoring the previous value on exit (also on an error)."""
        token = self.set(value)
        try:
            yield value
        finally:
            self.reset(token)
