"""A distributed sampler that starts an epoch part-way, splitting the samples left over the replicas there are now.

Why our own: torch's ``DistributedSampler`` (the one Lightning injects) always starts an epoch at its beginning and
fixes each replica's share from ``num_replicas``: skipping a resumed replica's first batches (what
:class:`~lightning_par.data.resumable.ResumableDataLoader` does with it) is exact only with the same number of
replicas. torchdata's ``StatefulDataLoader`` is not a dependency here, and Lightning 2.6 saves only the state of a
loader that has ``state_dict``/``load_state_dict`` (``loops.fit_loop.state_dict.combined_loader``), not a sampler's.

:class:`ResumableDistributedSampler` orders an epoch exactly as ``DistributedSampler`` does (``randperm`` seeded with
``seed + epoch``, or ``0 .. n-1`` without shuffling) and, with ``start = s`` for that epoch, drops the first ``s``
samples of that global order (those the replicas together consumed before the checkpoint) and splits the rest as
``DistributedSampler`` splits a whole epoch: padded by repetition to a multiple of ``num_replicas`` (or cut with
``drop_last``), replica ``r`` taking every ``num_replicas``-th sample from ``r``. With ``start = 0`` it yields what
``DistributedSampler`` yields.

Why the re-split is exact: replica ``r`` of ``R`` taking every ``R``-th sample means its ``k``-th batch of ``b``
samples and the other replicas' ``k``-th batches together are the global order's samples ``[k b R, (k+1) b R)``: the
replicas consume the global order front to back, one global batch at a time. After ``K`` global batches of ``G``
samples, the consumed samples are the first ``K G``; any number of replicas can take the rest, none seen twice or
skipped. With the same global batch ``G`` (e.g. ``dp_size`` 2 -> 4 with half the per-replica batch) every later step
sees the same samples as the uninterrupted run.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DistributedSampler

__all__ = ["ResumableDistributedSampler"]


class ResumableDistributedSampler(DistributedSampler):
    """``torch.utils.data.DistributedSampler`` that can start its epoch ``start_epoch`` at sample ``start`` of the
    global order (see the module docstring).

    Same arguments as ``DistributedSampler``. ``set_start(start, epoch)`` sets the resume point; it applies to the
    pass over that epoch only (a later ``set_epoch`` to another epoch starts at 0).
    """

    start: int = 0
    start_epoch: int | None = None
    #: added to ``epoch`` for the order drawn (see :attr:`data_epoch`)
    epoch_offset: int = 0

    @property
    def data_epoch(self) -> int:
        """The epoch whose order is drawn: ``epoch + epoch_offset``. The offset is -1 after resuming a checkpoint that
        ``Trainer.save_checkpoint`` wrote once ``fit`` stopped at ``max_steps`` inside an epoch: Lightning counts that
        epoch as finished there, so the resumed loop is one epoch ahead of the data (see
        :class:`~lightning_par.data.resumable.ResumableDataLoader`)."""
        return self.epoch + self.epoch_offset

    @classmethod
    def like(cls, sampler: DistributedSampler) -> ResumableDistributedSampler:
        """A resumable sampler with ``sampler``'s dataset, replicas, rank, shuffle, seed, ``drop_last`` and epoch."""
        out = cls(sampler.dataset, num_replicas=sampler.num_replicas, rank=sampler.rank, shuffle=sampler.shuffle,
                  seed=sampler.seed, drop_last=sampler.drop_last)
        out.set_epoch(sampler.epoch)
        return out

    def set_start(self, start: int, epoch: int) -> None:
        """Start the pass over data epoch ``epoch`` (:attr:`data_epoch`) after the first ``start`` samples of its global
        order.

        Raises:
            ValueError: ``start`` is negative or past the dataset's length.
        """
        n = len(self.dataset)  # type: ignore[arg-type]
        if not 0 <= int(start) <= n:
            raise ValueError(f"start={start} is not valid: expected 0 <= start <= {n} (the dataset's length).")
        self.start, self.start_epoch = int(start), int(epoch)

    def _start(self) -> int:
        return self.start if self.start_epoch == self.data_epoch else 0

    def global_order(self) -> list[int]:
        """The order of every sample index in :attr:`data_epoch`, as ``DistributedSampler`` draws it (unpadded)."""
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.data_epoch)
            return torch.randperm(n, generator=g).tolist()
        return list(range(n))

    def _remaining(self) -> list[int]:
        rest = self.global_order()[self._start():]
        replicas = self.num_replicas
        if self.drop_last:
            return rest[: len(rest) // replicas * replicas]
        size = -(-len(rest) // replicas) * replicas
        pad = size - len(rest)
        if pad and rest:
            rest += (rest * (-(-pad // len(rest))))[:pad]
        return rest

    def __iter__(self) -> Iterator[int]:
        return iter(self._remaining()[self.rank:: self.num_replicas])

    def __len__(self) -> int:
        left = len(self.dataset) - self._start()  # type: ignore[arg-type]
        return left // self.num_replicas if self.drop_last else -(-left // self.num_replicas)
