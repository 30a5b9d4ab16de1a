"""The Lightning hooks of a strategy whose dp axis is a :class:`~lightning_par.data_parallel.GradientReducer`."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from typing import Any

from torch import Tensor

from lightning_par.callbacks.metrics import log_comm_stats
from lightning_par.data_parallel.reducer import GradientReducer

__all__ = ["ReducerHooks"]


class ReducerHooks:
    """Mix-in for a ``MeshStrategy`` with ``self.reducer`` (or ``None`` when dp is 1): skips the all-reduce while
    gradients accumulate, brackets each backward for the overlap measurement, waits for the buckets after backward and
    logs ``comm_exposed_ms`` (the step's wait for the all-reduce after backward) every ``log_every_n_steps``."""

    reducer: GradientReducer | None = None

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning enters this for every micro-batch of an accumulation window but the last: no all-reduce."""
        with self.reducer.no_sync() if self.reducer is not None else nullcontext():
            yield

    def pre_backward(self, closure_loss: Tensor) -> None:
        if self.reducer is not None:
            self.reducer.start_backward()

    def post_backward(self, closure_loss: Tensor) -> None:
        if self.reducer is None:
            return
        log_comm_stats(self.lightning_module, self.reducer.finish())  # type: ignore[attr-defined]

    def reducer_extras(self, prefix: str = "") -> dict[str, Any]:
        """:meth:`GradientReducer.overlap_summary` with each key prefixed (e.g. ``"dp_"``)."""
        if self.reducer is None:
            return {}
        return {prefix + k: v for k, v in self.reducer.overlap_summary().items()}
