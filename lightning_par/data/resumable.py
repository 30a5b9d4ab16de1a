"""A DataLoader that resumes mid-epoch: its position goes into Lightning checkpoints and comes back on resume.

Lightning (2.1 and later) saves the ``state_dict()`` of every training DataLoader that has ``state_dict`` and
``load_state_dict`` into the checkpoint (``loops.fit_loop.state_dict.combined_loader``) and, when ``fit`` resumes from
it, calls ``load_state_dict`` before the first batch. A plain ``torch.utils.data.DataLoader`` has neither, so Lightning
restarts the interrupted epoch from its first batch (and warns): the resumed run sees different batches than the
uninterrupted one would. :class:`ResumableDataLoader` keeps

* ``batches``: how many batches the current pass over the data has yielded, which the next pass skips at the sampler
  (indices only: the skipped samples are never loaded);
* ``generator``: the state of the sampler's ``torch.Generator`` (a ``RandomSampler(generator=...)``, i.e.
  ``DataLoader(shuffle=True, generator=...)``) when the pass started, so the resumed pass draws the same order;
* ``epoch``: the ``DistributedSampler`` epoch (Lightning's injected sampler), whose order depends only on its seed and
  epoch (Lightning calls ``set_epoch`` with the restored epoch); the skip applies only to that epoch;
* ``samples``, ``batch_size``, ``replicas``: the same position in samples of this rank, the batch size and the number
  of data-parallel replicas it was counted with. A resume inside an epoch with another batch size or replica count
  would replay or skip samples (Lightning's loops count the epoch in batches), so it is refused, naming both values;
  from an epoch boundary (``batches`` 0) either may change.

Lightning re-creates the loader with a ``DistributedSampler`` under a distributed strategy; the subclass survives
that. A sampler that shuffles from the global RNG (``shuffle=True`` without a ``generator``) cannot be replayed: pass
a generator. torchdata's ``StatefulDataLoader`` does the same job, with more (worker state); this one has no extra
dependency.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

__all__ = ["ResumableDataLoader"]


class _SkipFirst:
    """``inner`` without its first ``n`` items; ``len`` stays the full pass (Lightning counts the skipped batches as
    already fetched)."""

    def __init__(self, inner: Any, n: int) -> None:
        self.inner, self.n = inner, n

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.inner)
        for _ in range(self.n):
            if next(it, None) is None:
                return
        yield from it

    def __len__(self) -> int:
        return len(self.inner)


class ResumableDataLoader(DataLoader):
    """``torch.utils.data.DataLoader`` with ``state_dict`` / ``load_state_dict`` (see the module docstring).

    Same arguments as ``DataLoader``. ``len`` is the full pass, also while resuming.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._yielded = 0
        self._pass_started = False
        self._pass_generator_state: torch.Tensor | None = None
        self._skip = 0
        self._skip_epoch: int | None = None
        self._restore_generator: torch.Tensor | None = None
        self._pending_skip = 0

    def _generator(self) -> torch.Generator | None:
        gen = getattr(self.sampler, "generator", None)
        return gen if isinstance(gen, torch.Generator) else None

    def _epoch(self) -> int | None:
        return self.sampler.epoch if isinstance(self.sampler, DistributedSampler) else None

    @property
    def _index_sampler(self) -> Any:  # type: ignore[override]
        base = super()._index_sampler
        return _SkipFirst(base, self._pending_skip) if self._pending_skip else base

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        # A generator: this body runs at the first next(), after Lightning has called set_epoch.
        gen = self._generator()
        if self._restore_generator is not None and gen is not None:
            gen.set_state(self._restore_generator)
        self._restore_generator = None
        self._pass_generator_state = gen.get_state().clone() if gen is not None else None
        skip = self._skip if self._skip_epoch is None or self._skip_epoch == self._epoch() else 0
        self._skip, self._skip_epoch = 0, None
        self._yielded, self._pass_started = skip, True
        if skip:
            self._iterator = None  # a persistent-worker iterator keeps its old sampler; build a fresh one
        self._pending_skip = skip
        try:
            batches = super().__iter__()
        finally:
            self._pending_skip = 0
        for batch in batches:
            self._yielded += 1
            yield batch

    def _replicas(self) -> int:
        return int(self.sampler.num_replicas) if isinstance(self.sampler, DistributedSampler) else 1

    def state_dict(self) -> dict[str, Any]:
        """``{"batches", "samples", "batch_size", "replicas", "generator", "epoch"}`` of the current pass; a finished
        pass saves the start of the next."""
        gen = self._generator()
        finished = not self._pass_started or self._yielded >= len(self)
        shape = {"batch_size": self.batch_size, "replicas": self._replicas()}
        if finished:
            return {"batches": 0, "samples": 0, **shape, "generator": gen.get_state().clone() if gen is not None else None,
                    "epoch": None}
        samples = self._yielded * self.batch_size if self.batch_size is not None else None
        return {"batches": self._yielded, "samples": samples, **shape, "generator": self._pass_generator_state,
                "epoch": self._epoch()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Make the next pass start where the saved one stopped.

        Raises:
            ValueError: the saved position is inside an epoch and was counted with another batch size or number of
                data-parallel replicas (see the module docstring).
        """
        batches = int(state_dict.get("batches", 0))
        for field, saved, now in (("batch_size", state_dict.get("batch_size"), self.batch_size),
                                  ("data-parallel replicas", state_dict.get("replicas"), self._replicas())):
            if batches and saved is not None and saved != now:
                raise ValueError(
                    f"{field}={now} is not valid for this resume: the checkpoint is {batches} batches into an epoch "
                    f"counted with {field}={saved}, and resuming with another would replay or skip samples. Resume "
                    f"with {field}={saved}, or from a checkpoint at an epoch boundary."
                )
        self._skip = batches
        self._skip_epoch = state_dict.get("epoch")
        self._restore_generator = state_dict.get("generator")
