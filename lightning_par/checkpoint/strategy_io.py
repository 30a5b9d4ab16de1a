"""A strategy's checkpoint hooks over a :class:`~lightning_par.parallelize.ParallelModel`: sharded
``torch.distributed.checkpoint`` directories, committed atomically, keyed by one-process names so that they load into
any layout, dp mode, strategy and one process.

:class:`ShardedCheckpointIO` is mixed into :class:`~lightning_par.strategies.MeshStrategy`; it reads the strategy's
``parallel`` (the parallel model), ``parallel_dims``, ``options``, ``optimizers``, ``strategy_name``, ``dp_mode``,
``global_rank``, ``broadcast`` and ``barrier``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_par.checkpoint.async_save import PendingSave, start_async_save
from lightning_par.checkpoint.sharded import save_sharded
from lightning_par.compat.lightning import plain_optimizer
from lightning_par.runtime.checkpoint import load_parallel_state, record

__all__ = ["ShardedCheckpointIO", "load_parallel_state"]


class ShardedCheckpointIO:
    """Lightning's checkpoint hooks (``Strategy.save_checkpoint``, ``load_checkpoint``, ...) for a strategy that
    holds a parallel model (see the module docstring); placed before Lightning's strategy class in the bases."""

    parallel: Any
    parallel_dims: Any
    options: Any
    _pending_save: PendingSave | None = None
    _async_next: bool = False
    _deferred_removals: list[Any] | None = None
    _checkpoint_group: Any = None

    def save_next_checkpoint_async(self) -> None:
        """Write the next :meth:`save_checkpoint` in the background (see :mod:`lightning_par.checkpoint.async_save`);
        it becomes a checkpoint only at :meth:`finish_pending_checkpoint`. Every rank calls it."""
        self._async_next = True

    def finish_pending_checkpoint(self, wait: bool = True) -> bool:
        """Commit the checkpoint being written in the background, if any. Collective: every rank calls it at the
        same point (a step boundary).

        Args:
            wait: wait for the background writes; ``False``: commit only if every rank's writes are done (one
                all-reduce of a flag), else return at once.

        Returns:
            Whether nothing is pending any more.

        Raises:
            Exception: what the background save raised (nothing is committed then).
        """
        pending = self._pending_save
        if pending is None:
            return True
        if not wait:
            import torch.distributed as dist

            # on the default group's device (NCCL takes CUDA tensors only); the read below is the one host sync,
            # once per step while a save is pending (docs/host-syncs.md)
            flag = torch.tensor([int(pending.done())], device=self.root_device)  # type: ignore[attr-defined]
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            if not flag.item():
                return False
        self._pending_save = None
        pending.commit()
        removals, self._deferred_removals = self._deferred_removals or [], None
        for filepath in removals:
            super().remove_checkpoint(filepath)  # type: ignore[misc]
        return True

    def remove_checkpoint(self, filepath: Any) -> None:
        """Remove a checkpoint on rank 0 (Lightning's), but only once the checkpoint being written in the background
        is committed: an older one is never removed while the newest is not yet in place."""
        if self._pending_save is not None:
            self._deferred_removals = [*(self._deferred_removals or []), filepath]
            return
        super().remove_checkpoint(filepath)  # type: ignore[misc]

    def _background_group(self) -> Any:
        """The gloo group of background saves (created on first use: collective)."""
        if self._checkpoint_group is None:
            import torch.distributed as dist

            self._checkpoint_group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        return self._checkpoint_group

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Load after :meth:`setup`, into the cut, split and sharded model and optimizers."""
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        """:meth:`load_checkpoint` restores the optimizers itself."""
        return False

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's part of the model, keyed by one-process name (sharded tensors as DTensors of their global
        shape, vocabulary padding cut off); without the frozen base in a LoRA run
        (:mod:`lightning_par.checkpoint.adapter_only`)."""
        if self.parallel is None:
            assert self.lightning_module is not None
            return self.lightning_module.state_dict()
        from lightning_par.checkpoint.adapter_only import drop, frozen_parameter_names

        return drop(self.parallel.model_state_dict(), frozen_parameter_names(self.lightning_module))

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """This rank's part of the optimizer state, keyed by one-process parameter name."""
        assert self.parallel is not None
        return self.parallel.optimizer_state_dict(plain_optimizer(optimizer))

    def checkpoint_record(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """What this strategy writes into a checkpoint's record (``lightning_par.json``:
        :func:`lightning_par.runtime.checkpoint.record`)."""
        return record(self, checkpoint, self.lightning_module)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write a sharded checkpoint directory at ``filepath`` atomically (see :mod:`lightning_par.checkpoint`).
        Every rank calls it. After :meth:`save_next_checkpoint_async`, the shards are written in the background and
        the checkpoint is committed by :meth:`finish_pending_checkpoint`; a save still pending is committed first.

        Raises:
            TypeError: ``storage_options`` is given (there is no ``CheckpointIO``).
        """
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(storage_options=...) is not supported.")
        asynchronous, self._async_next = self._async_next, False
        self.finish_pending_checkpoint(wait=True)  # one background save at a time, committed in order
        path = Path(self.broadcast(str(filepath)))
        record = {**self.checkpoint_record(checkpoint), "saved_in_background": asynchronous}
        rank0 = self.global_rank == 0
        if asynchronous:
            group = self._background_group()
            self._pending_save = start_async_save(
                path, checkpoint, record, is_rank0=rank0, barrier=self.barrier, process_group=group
            )
        else:
            save_sharded(path, checkpoint, record, is_rank0=rank0, barrier=self.barrier)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint of any layout, dp mode or strategy into this rank's part of the model (and the optimizers
        when fitting); return the rest (loops, LR schedulers, ...) for Lightning to restore.

        Raises:
            FileNotFoundError, ValueError: a missing, torn, garbage or incompatible checkpoint (see
                :func:`lightning_par.checkpoint.read_record`), one that would run code if loaded, or one written with
                other hyper-parameters (:func:`lightning_par.checkpoint.compat.check_resume`), with what to do;
                before any tensor is loaded.
        """
        assert self.parallel is not None
        path = Path(self.broadcast(str(checkpoint_path)))
        from lightning_par.checkpoint.adapter_only import frozen_parameter_names

        return load_parallel_state(
            self.parallel, path, [plain_optimizer(o) for o in self.optimizers],
            before_load=lambda m: self._check_resume(path, m), skip=frozen_parameter_names(self.lightning_module),
        )

    def _check_resume(self, path: Path, meta: dict[str, Any]) -> None:
        """Before any tensor is loaded, on every rank alike: refuse a checkpoint of other hyper-parameters (the
        module's, and the data module's when fitting; see :mod:`lightning_par.checkpoint.compat`)."""
        from lightning_par.checkpoint.compat import check_resume

        module = self.lightning_module
        trainer = getattr(module, "_trainer", None)
        fitting = trainer is not None and getattr(trainer.state.fn, "value", None) == "fit"
        datamodule = getattr(trainer, "datamodule", None) if fitting else None
        dims = getattr(self, "parallel_dims", None)
        # the ranks the data is split over decide whether a data module's new batch size keeps the global batch of a
        # mid-epoch position (under fault tolerance: every replica group's dp ranks, FaultToleranceHooks.sampler_kwargs)
        ft = getattr(self, "fault_tolerance", None)
        replicas = None
        if fitting and dims is not None:
            replicas = ft.sampler_kwargs(int(dims.dp_size), 0)["num_replicas"] if ft is not None else int(dims.dp_size)
        check_resume(path, meta, getattr(module, "hparams", None), getattr(datamodule, "hparams", None), replicas)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Nothing to do: :meth:`load_checkpoint` has loaded the model."""

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Nothing to do: :meth:`load_checkpoint` has loaded the optimizers."""

    def full_state_dict(self) -> dict[str, Tensor]:
        """Every parameter of the whole model in full, keyed by one-process name, on every rank (see
        :meth:`lightning_par.parallelize.ParallelModel.full_state_dict`); collective, for tests and small models."""
        assert self.parallel is not None
        return self.parallel.full_state_dict()
