"""Fault tolerance as a component of a Lightning strategy: the few hooks through which
:class:`~lightning_par.strategies.base.MeshStrategy` drives the replica groups (:mod:`lightning_par.fault_tolerance`).

The strategy holds one :class:`FaultToleranceHooks` and calls it from its own hooks, one call each; with
``fault_tolerance.enabled=False`` every call does nothing (or hands its input back), so the strategy has no
fault-tolerance code of its own. (torchtitan keeps its trainer free of fault tolerance the same way: its
``FaultTolerantTrainer`` lives in a folder of its own.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_par.callbacks.metrics import log_host_number
from lightning_par.compat.lightning import before_batch_transfer, data_fetcher, plain_optimizer
from lightning_par.fault_tolerance.data import check_train_data, mark_last_batch, move_train_data, moves_by_state
from lightning_par.fault_tolerance.options import FaultToleranceOptions, check_fault_tolerance, check_lighthouse

__all__ = ["FaultToleranceHooks"]


class FaultToleranceHooks:
    """What the fault-tolerant replicate axis adds to a Lightning strategy's run.

    Per run: :meth:`setup_environment` (the lighthouse reachable, before any process group), :meth:`setup` (this
    rank's :class:`~lightning_par.fault_tolerance.replicas.FaultTolerantReplicas`, once the optimizers exist),
    :meth:`on_train_start` (a training loop a rejoining group can be moved in), :meth:`teardown`. Per step:
    :meth:`batch_to_device` (the quorum; a joining group's loader moved to the live group's place and the batch
    replaced), :meth:`training_step` (the live group's batch index; the figures logged), :meth:`optimizer_step` (the
    mean over the live groups and the commit vote; DiLoCo: its sync inside the step).

    Args:
        options: the strategy's :class:`~lightning_par.parallelize.ParallelOptions`.
        sizes: the strategy's size fields and values.

    Raises:
        ValueError: what the replica groups do not compose with
            (:func:`~lightning_par.fault_tolerance.options.check_fault_tolerance`).
    """

    def __init__(self, options: Any, sizes: dict[str, Any]) -> None:
        check_fault_tolerance(options, sizes)
        self.options: FaultToleranceOptions = options.fault_tolerance
        self.replicas: Any = None  # this rank's FaultTolerantReplicas (enabled), from setup()
        self._batch_idx: int | None = None  # the live group's batch index, for the step a group rejoins in
        self._loop_counts_last = False  # a loader was moved by its state: is_last_batch from the loop's count

    # ------------------------------------------------------------------ per run
    def sampler_kwargs(self, dp_size: int, dp_rank: int) -> dict[str, int]:
        """``DistributedSampler``'s ``num_replicas`` and ``rank``: over this group's dp ranks, and with fault tolerance
        over every replica group's dp ranks in group order (a group that is down leaves its share out)."""
        ft = self.options
        if not ft.enabled:
            return {"num_replicas": dp_size, "rank": dp_rank}
        return {"num_replicas": dp_size * ft.num_replica_groups, "rank": ft.replica_group_id * dp_size + dp_rank}

    def setup_environment(self) -> None:
        """Before any process group: an unreachable lighthouse is named within ``connect_timeout_s``, and a bind
        address the job cannot use is refused."""
        ft = self.options
        if ft.enabled:
            ft.bind_host(ft.lighthouse_address())
            check_lighthouse(ft.lighthouse_address(), ft.connect_timeout_s)

    def setup(self, module: Any, optimizers: Callable[[], list[Any]], rank: int, world_size: int) -> None:
        """When fitting, once the optimizers exist: this rank's torchft manager (and DiLoCo's outer step).

        Raises:
            ValueError: ``diloco_sync_every`` with other than one optimizer.
        """
        if not self.options.enabled or self.replicas is not None:
            return
        from lightning_par.fault_tolerance.replicas import FaultTolerantReplicas

        self.replicas = FaultTolerantReplicas(
            self.options, module, lambda: [plain_optimizer(o) for o in optimizers()], rank, world_size
        )
        if self.options.diloco_sync_every:
            inner = optimizers()
            if len(inner) != 1:
                raise ValueError(
                    f"fault_tolerance.diloco_sync_every needs exactly one optimizer (the inner one); "
                    f"configure_optimizers returned {len(inner)}."
                )
            self.replicas.enter_diloco(plain_optimizer(inner[0]))

    def on_train_start(self, trainer: Any) -> None:
        """Refuse a training loop whose data a rejoining group could not be moved in
        (:func:`~lightning_par.fault_tolerance.data.check_train_data`)."""
        if self.replicas is not None:
            check_train_data(trainer)

    def teardown(self) -> None:
        """Shut this rank's torchft manager down (and leave DiLoCo)."""
        if self.replicas is not None:
            self.replicas.shutdown()

    def summary(self) -> dict[str, Any]:
        """Figures for ``summary.json`` (``{}`` without fault tolerance)."""
        return self.replicas.summary() if self.replicas is not None else {}

    # ------------------------------------------------------------------ per step
    def batch_to_device(self, module: Any, batch: Any, dataloader_idx: int) -> Any:
        """A training window's first batch takes the quorum of the live replica groups first
        (:meth:`~lightning_par.fault_tolerance.replicas.FaultTolerantReplicas.begin_step`): the strategy calls this
        right after Lightning fetched the batch and before any hook or ``training_step`` sees it. A group that joins
        there receives the live group's state and its place in the data; where its own loader was elsewhere (a
        restarted process starts at epoch 0, batch 0), the loader is moved there
        (:func:`~lightning_par.fault_tolerance.data.move_train_data`) and the batch of the live group's place is
        returned instead of the one fetched (converted as Lightning converts a fetched batch), so hooks and
        ``training_step`` see the batch the group would have read had it never failed."""
        ft = self.replicas
        trainer = getattr(module, "_trainer", None) if module is not None else None
        if ft is None or trainer is None or not trainer.training:
            return batch
        if self._loop_counts_last:
            mark_last_batch(trainer)
        if ft.diloco is not None or ft.in_step:
            return batch
        ft.begin_step()
        position = ft.take_data_position()
        if position is None:
            return batch
        epoch, ready = position
        batch = move_train_data(trainer, epoch, ready, take=True)
        ft.data_moves += 1
        # Lightning's epoch loop set these from the batch it fetched (the wrong place), before calling here
        self._loop_counts_last = moves_by_state(trainer.train_dataloader)
        if self._loop_counts_last:
            mark_last_batch(trainer)
        else:
            trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = data_fetcher(trainer).done
        self._batch_idx = ready
        # what Lightning's epoch loop does to a fetched batch before batch_to_device (2.6.6, advance())
        batch = trainer.precision_plugin.convert_input(batch)
        return before_batch_transfer(trainer.lightning_module, batch, dataloader_idx)

    def training_step(self, module: Any, batch_idx: Any, rest: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        """``(batch_idx, rest, kwargs)`` of a Lightning ``training_step`` call: in the step a group rejoined in, the
        live group's batch index within the epoch; the step's figures logged (``parallel/ft_*``).

        Raises:
            RuntimeError: a group rejoined at a batch that did not pass through the strategy's ``batch_to_device``.
        """
        ft = self.replicas
        if ft is None or ft.diloco is not None:
            return batch_idx, rest, kwargs
        if not ft.in_step:  # the quorum is taken in batch_to_device; a loop that skipped it takes it here
            ft.begin_step()
            if ft.take_data_position() is not None:
                raise RuntimeError(
                    "This replica group rejoined at a training_step whose batch did not pass through "
                    "MeshStrategy.batch_to_device, so it cannot be moved to the live group's place in the data: "
                    "call super().batch_to_device in an override of it."
                )
        for name, value in ft.figures().items():
            log_host_number(module, f"parallel/{name}", value, on_step=True, on_epoch=False)
        if self._batch_idx is not None:  # the step it rejoined in: the live group's index in the epoch
            batch_idx, self._batch_idx = self._batch_idx, None
            if rest:
                rest = (batch_idx, *rest[1:])
            elif "batch_idx" in kwargs:
                kwargs = {**kwargs, "batch_idx": batch_idx}
        return batch_idx, rest, kwargs

    def optimizer_step(self, module: Any, optimizer: Any, closure: Callable[[], Any],
                       step: Callable[[Callable[[], Any]], Any]) -> Any:
        """The optimizer step: ``step(closure)`` (the host's step, which calls ``closure``: the forward, backward and
        the dp reduction inside the group), with fault tolerance: this rank's gradients (its shard under ZeRO)
        averaged over the live groups after ``closure``, then the commit vote; a step some live group could not
        finish is skipped by every group (no update, no state). Under DiLoCo its hooks on the optimizer sync every
        ``H`` steps inside ``step``; a group that joined at that sync has its loader moved for the next fetch."""
        ft = self.replicas
        if ft is None or ft.diloco is not None:
            out = step(closure)
            position = ft.take_data_position() if ft is not None else None
            if position is not None:  # joined at this sync (inside the step): the next fetch reads the live group's
                move_train_data(module.trainer, *position, take=False)
                ft.data_moves += 1
                self._loop_counts_last = moves_by_state(module.trainer.train_dataloader)
            return out
        out = closure()
        ft.average_gradients([p for g in optimizer.param_groups for p in g["params"]])
        if not ft.commit():
            optimizer.zero_grad(set_to_none=True)
            return out
        return step(lambda: out)
