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

from lightning_par.checkpoint.sharded import load_sharded, save_sharded

__all__ = ["ShardedCheckpointIO"]


class ShardedCheckpointIO:
    """Lightning's checkpoint hooks (``Strategy.save_checkpoint``, ``load_checkpoint``, ...) for a strategy that
    holds a parallel model (see the module docstring); placed before Lightning's strategy class in the bases."""

    parallel: Any
    parallel_dims: Any
    options: Any

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
        shape, vocabulary padding cut off)."""
        if self.parallel is None:
            assert self.lightning_module is not None
            return self.lightning_module.state_dict()
        return self.parallel.model_state_dict()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """This rank's part of the optimizer state, keyed by one-process parameter name."""
        assert self.parallel is not None
        return self.parallel.optimizer_state_dict(getattr(optimizer, "_optimizer", optimizer))

    def checkpoint_record(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """What this strategy writes into a checkpoint's record (``lightning_par.json``)."""
        dims = self.parallel_dims
        layout = {} if dims is None else {"tp_size": dims.tp_size, "pp_size": dims.pp_size, **dims.sizes()}
        return {
            "strategy": self.strategy_name,
            "layout": layout,
            "dp_mode": self.dp_mode,
            "global_step": checkpoint.get("global_step"),
            "epoch": checkpoint.get("epoch"),
            "pp_schedule": self.options.pipeline.schedule if dims is not None and dims.pp_enabled else None,
            "sequence_parallel": self.options.tensor_parallel.sequence_parallel,
            "torch": torch.__version__,
        }

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write a sharded checkpoint directory at ``filepath`` atomically (see :mod:`lightning_par.checkpoint`).
        Every rank calls it.

        Raises:
            TypeError: ``storage_options`` is given (there is no ``CheckpointIO``).
        """
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(storage_options=...) is not supported.")
        path = Path(self.broadcast(str(filepath)))
        record = self.checkpoint_record(checkpoint)
        save_sharded(path, checkpoint, record, is_rank0=self.global_rank == 0, barrier=self.barrier)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a checkpoint of any layout, dp mode or strategy into this rank's part of the model (and the optimizers
        when fitting); return the rest (loops, LR schedulers, ...) for Lightning to restore.

        Raises:
            FileNotFoundError, ValueError: a missing, torn, garbage or incompatible checkpoint (see
                :func:`lightning_par.checkpoint.read_record`), with what to do.
        """
        assert self.parallel is not None
        path = Path(self.broadcast(str(checkpoint_path)))
        engine = self.parallel.engine
        model_state = engine.model_state_dict()
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        optimizer_states = [engine.optimizer_state_dict(o) for o in optimizers]
        self.parallel.to_one_process(model_state, optimizer_states)
        # DCP keeps one copy of a non-tensor entry such as ``param_groups`` (the coordinator's): under pipelining its
        # parameter names are those of one stage. Keep the saved hyper-parameters and this rank's own names.
        own_names = [[list(g["params"]) for g in state["param_groups"]] for state in optimizer_states]
        meta = load_sharded(path, model_state, optimizer_states)
        for state, names in zip(optimizer_states, own_names):
            if len(state["param_groups"]) != len(names):
                raise ValueError(
                    f"checkpoint {str(path)!r} has an optimizer with {len(state['param_groups'])} param groups, this "
                    f"one has {len(names)}: configure_optimizers must build the same groups."
                )
            state["param_groups"] = [{**g, "params": n} for g, n in zip(state["param_groups"], names)]
        engine.load_model_state_dict(model_state)
        for optimizer, state in zip(optimizers, optimizer_states):
            engine.load_optimizer_state_dict(optimizer, state)
        return meta

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Nothing to do: :meth:`load_checkpoint` has loaded the model."""

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Nothing to do: :meth:`load_checkpoint` has loaded the optimizers."""

    def full_state_dict(self) -> dict[str, Tensor]:
        """Every parameter of the whole model in full, keyed by one-process name, on every rank (see
        :meth:`lightning_par.parallelize.ParallelModel.full_state_dict`); collective, for tests and small models."""
        assert self.parallel is not None
        return self.parallel.full_state_dict()
