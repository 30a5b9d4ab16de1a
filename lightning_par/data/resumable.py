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
  of data-parallel replicas it was counted with;
* ``consumed``, ``seed``, ``shuffle``: with a ``DistributedSampler`` (Lightning's injected one, which this loader turns
  into a :class:`~lightning_par.data.sampler.ResumableDistributedSampler` with the same order), the samples of the
  epoch's global order the replicas consumed together (``batches * batch_size * replicas``) and what draws that
  order. The resumed pass starts the global order there and splits the rest over the replicas there are now, so a
  resume inside an epoch may change the number of dp replicas as long as the global batch ``batch_size * replicas``
  is the same (Lightning's loops count the epoch in batches: another global batch would make the restored count
  wrong, so it is refused, naming the values). Without a ``DistributedSampler`` the batch size and replicas must be
  the saved ones; from an epoch boundary (``batches`` 0) anything may change;
* ``dataset``: the dataset's own ``state_dict()`` when it has one (a streaming or packing dataset's buffer and
  position), given back to its ``load_state_dict`` on resume.

Lightning re-creates the loader with a ``DistributedSampler`` under a distributed strategy; the subclass survives
that. A sampler that shuffles from the global RNG (``shuffle=True`` without a ``generator``) cannot be replayed: pass
a generator. torchdata's ``StatefulDataLoader`` does the same job, with more (worker state); this one has no extra
dependency. Unlike it, a ``load_state_dict`` made while a pass runs moves that pass (at its next batch; ``state_at``
gives the state of a place, ``next_batch`` takes the batch there): how a fault-tolerant replica group that rejoins
reads on at the live group's place without touching Lightning's loop (:mod:`lightning_par.fault_tolerance.data`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_par.data.sampler import ResumableDistributedSampler

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


class _Offset:
    """A resumed pass whose sampler already starts part-way: ``inner`` as it is, ``len`` counting the ``n`` batches
    consumed before the checkpoint too (Lightning counts them as already fetched)."""

    def __init__(self, inner: Any, n: int) -> None:
        self.inner, self.n = inner, n

    def __iter__(self) -> Iterator[Any]:
        return iter(self.inner)

    def __len__(self) -> int:
        return self.n + len(self.inner)


class ResumableDataLoader(DataLoader):
    """``torch.utils.data.DataLoader`` with ``state_dict`` / ``load_state_dict`` (see the module docstring).

    Same arguments as ``DataLoader``; a ``sampler=DistributedSampler(...)`` (Lightning passes its injected one so)
    becomes a :class:`~lightning_par.data.sampler.ResumableDistributedSampler` with the same order. ``len`` is the
    full pass, also while resuming.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        sampler = kwargs.get("sampler")
        if type(sampler) is DistributedSampler:  # noqa: E721 - a subclass may order its own way: keep it
            kwargs["sampler"] = ResumableDistributedSampler.like(sampler)
        super().__init__(*args, **kwargs)
        self._yielded = 0
        self._pass_started = False
        self._pass_generator_state: torch.Tensor | None = None
        self._skip = 0
        self._skip_epoch: int | None = None
        self._restore_generator: torch.Tensor | None = None
        self._pending_skip = 0
        self._restore_start: tuple[int, int | None] | None = None  # (consumed samples, epoch) for the sampler
        self._offset = 0  # batches consumed before this pass's sampler start (a re-split resume)
        self._pass_start = 0
        self._pass_skip = 0
        self._live: weakref.ref[Iterator[Any]] | None = None  # the pass in progress (next_batch)
        self._pass_token: object | None = None  # the pass that started last
        self._moved: object | None = None  # that pass, when a load_state_dict came while it ran

    def _resplits(self) -> bool:
        return isinstance(self.sampler, ResumableDistributedSampler)

    def _generator(self) -> torch.Generator | None:
        gen = getattr(self.sampler, "generator", None)
        return gen if isinstance(gen, torch.Generator) else None

    def _epoch(self) -> int | None:
        if isinstance(self.sampler, ResumableDistributedSampler):
            return self.sampler.data_epoch
        return self.sampler.epoch if isinstance(self.sampler, DistributedSampler) else None

    @property
    def _index_sampler(self) -> Any:  # type: ignore[override]
        base = super()._index_sampler
        if self._offset:
            return _Offset(base, self._offset)
        return _SkipFirst(base, self._pending_skip) if self._pending_skip else base

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        """A pass over the data. A :meth:`load_state_dict` made while the pass runs moves it: its next batch is the
        one at the loaded place (a new inner iterator, so nothing read ahead from the old place is returned)."""
        live = self._pass()
        self._live = weakref.ref(live)
        return live

    def _pass(self) -> Iterator[Any]:
        # A generator: this body runs at the first next(), after Lightning has called set_epoch.
        token = self._pass_token = object()
        batches = self._start_pass(moved=False)
        while True:
            if self._moved is token:  # load_state_dict during this pass: go on from the loaded place
                self._moved = None
                batches = self._start_pass(moved=True)
            try:
                batch = next(batches)
            except StopIteration:
                return
            self._yielded += 1
            yield batch

    def _start_pass(self, moved: bool) -> Iterator[Any]:
        """The inner iterator of a pass that starts (or, ``moved``, goes on) at the place the state says."""
        gen = self._generator()
        if self._restore_generator is not None and gen is not None:
            gen.set_state(self._restore_generator)
        elif moved and self._pass_generator_state is not None and gen is not None:
            gen.set_state(self._pass_generator_state)  # the same pass's order, from another place in it
        self._restore_generator = None
        self._pass_generator_state = gen.get_state().clone() if gen is not None else None
        restore, self._restore_start = self._restore_start, None
        if restore is not None and self._skip and self._skip_epoch is not None and self._resplits():
            # Resumed inside the pass over epoch e: continue that pass whatever epoch Lightning resumes at. After
            # ``fit`` stops at ``max_steps`` mid-epoch Lightning counts the epoch as finished and resumes at e + 1
            # with the batches already done counted in it: the rest of e's order then fills that count exactly, and
            # the later epochs keep the offset, so the run sees what the uninterrupted one would.
            self.sampler.epoch_offset = int(self._skip_epoch) - self.sampler.epoch
        skip = self._skip if self._skip_epoch is None or self._skip_epoch == self._epoch() else 0
        self._skip, self._skip_epoch = 0, None
        self._yielded, self._pass_started = skip, True
        if skip or moved:
            self._iterator = None  # a persistent-worker iterator keeps its old sampler; build a fresh one
        if skip and restore is not None and self._resplits():
            # the sampler starts the global order after the consumed samples, split over the replicas there are now
            self.sampler.set_start(restore[0], self.sampler.data_epoch)
            self._offset = skip
        else:
            self._offset = 0
            if self._resplits():
                self.sampler.set_start(0, self.sampler.data_epoch)
            self._pending_skip = skip
        try:
            batches = super().__iter__()
        finally:
            self._pending_skip = 0
        self._pass_start = restore[0] if self._offset else 0
        self._pass_skip = skip if self._offset else 0
        return iter(batches)

    def _check_resplit(self, state: dict[str, Any], batches: int) -> None:
        """Refuse a mid-epoch resume whose global order or global batch differs from the checkpoint's."""
        sampler = self.sampler
        saved_global = (state.get("batch_size") or 0) * (state.get("replicas") or 1)
        now_global = (self.batch_size or 0) * self._replicas()
        checks = [
            ("global batch (batch_size * data-parallel replicas)", saved_global, now_global,
             f"{state.get('batch_size')} * {state.get('replicas')}", f"{self.batch_size} * {self._replicas()}"),
            ("sampler seed", state.get("seed"), int(sampler.seed), None, None),
            ("sampler shuffle", state.get("shuffle"), bool(sampler.shuffle), None, None),
        ]
        for field, saved, now, saved_text, now_text in checks:
            if saved is not None and saved != now:
                raise ValueError(
                    f"{field}={now_text or repr(now)} is not valid for this resume: the checkpoint is {batches} "
                    f"batches into an epoch with {field}={saved_text or repr(saved)}; Lightning counts the epoch in "
                    f"batches of the global order, so another would replay or skip samples. Resume with the same "
                    f"{field} (the "
                    f"number of replicas may change if the global batch stays: e.g. dp_size 2 -> 4 with half the "
                    f"batch_size), or from a checkpoint at an epoch boundary."
                )

    def _replicas(self) -> int:
        return int(self.sampler.num_replicas) if isinstance(self.sampler, DistributedSampler) else 1

    def state_at(self, batches: int) -> dict[str, Any]:
        """The state :meth:`load_state_dict` takes to move this loader ``batches`` batches into the pass over the
        epoch its sampler is set to (indices only: the samples passed over are never loaded), counting them as
        yielded: how a fault-tolerant replica group that rejoins reads on at the live group's place
        (:func:`lightning_par.fault_tolerance.data.move_train_data`, after ``set_epoch``). A pass in progress moves at
        its next batch; a checkpoint saved later in that pass holds the position counted from the epoch's start."""
        shape = {"batch_size": self.batch_size, "replicas": self._replicas()}
        if self._resplits():
            shape["epoch_offset"] = int(self.sampler.epoch_offset)
        return {"batches": int(batches), "consumed": None, "generator": None, "epoch": None, **shape}

    def next_batch(self) -> Any:
        """The next batch of the pass in progress (the one the loop iterating it reads next, which then reads the one
        after), counted as yielded.

        Raises:
            RuntimeError: no pass is in progress (``iter`` not called), or it is over.
        """
        live = self._live() if self._live is not None else None
        if live is None:
            raise RuntimeError("ResumableDataLoader.next_batch() needs a pass in progress: iterate the loader first.")
        try:
            return next(live)
        except StopIteration:
            raise RuntimeError("ResumableDataLoader.next_batch(): the pass in progress is over.") from None

    def state_dict(self) -> dict[str, Any]:
        """``{"batches", "samples", "consumed", "batch_size", "replicas", "generator", "epoch"}`` of the current pass,
        with ``"seed"``, ``"shuffle"``, ``"epoch_offset"`` under a ``DistributedSampler`` and ``"dataset"`` when the
        dataset has a ``state_dict`` (see the module docstring); a finished pass saves the start of the next."""
        gen = self._generator()
        finished = not self._pass_started or self._yielded >= len(self)
        shape = {"batch_size": self.batch_size, "replicas": self._replicas()}
        if self._resplits():
            shape.update(seed=int(self.sampler.seed), shuffle=bool(self.sampler.shuffle),
                         epoch_offset=int(self.sampler.epoch_offset))
        dataset_state = self.dataset.state_dict() if callable(getattr(self.dataset, "state_dict", None)) else None
        if dataset_state is not None:
            shape["dataset"] = dataset_state
        if finished:
            return {"batches": 0, "samples": 0, "consumed": 0, **shape,
                    "generator": gen.get_state().clone() if gen is not None else None, "epoch": None}
        samples = self._yielded * self.batch_size if self.batch_size is not None else None
        consumed = None
        if self._resplits() and self.batch_size is not None:
            # the samples of the global order consumed by every replica together: those before this pass's start,
            # then one global batch per batch of this pass
            consumed = self._pass_start + (self._yielded - self._pass_skip) * self.batch_size * self._replicas()
        return {"batches": self._yielded, "samples": samples, "consumed": consumed, **shape,
                "generator": self._pass_generator_state, "epoch": self._epoch()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Make the next pass start where the saved one stopped; during a pass, that pass goes on from there at its
        next batch (how :meth:`state_at` moves it).

        Raises:
            ValueError: the saved position is inside an epoch and was counted with another global batch, sampler seed
                or shuffle (a ``DistributedSampler``), or another batch size or number of data-parallel replicas
                (any other sampler); see the module docstring.
        """
        batches = int(state_dict.get("batches", 0))
        consumed = state_dict.get("consumed")
        if batches and consumed is not None and self._resplits():
            self._check_resplit(state_dict, batches)
            self._restore_start = (int(consumed), state_dict.get("epoch"))
        else:
            self._restore_start = None
            for field, saved, now in (("batch_size", state_dict.get("batch_size"), self.batch_size),
                                      ("data-parallel replicas", state_dict.get("replicas"), self._replicas())):
                if batches and saved is not None and saved != now:
                    raise ValueError(
                        f"{field}={now} is not valid for this resume: the checkpoint is {batches} batches into an "
                        f"epoch counted with {field}={saved}, and resuming with another would replay or skip samples. "
                        f"Resume with {field}={saved}, or from a checkpoint at an epoch boundary."
                    )
        if self._resplits():
            self.sampler.epoch_offset = int(state_dict.get("epoch_offset") or 0)
        if state_dict.get("dataset") is not None and callable(getattr(self.dataset, "load_state_dict", None)):
            self.dataset.load_state_dict(state_dict["dataset"])
        self._skip = batches
        self._skip_epoch = state_dict.get("epoch")
        self._restore_generator = state_dict.get("generator")
        self._moved = self._pass_token  # a pass in progress goes on from here at its next batch
