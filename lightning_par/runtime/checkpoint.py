"""The model's and optimizers' state for sharded checkpoints, for any host.

A checkpoint is a ``torch.distributed.checkpoint`` directory committed atomically (:mod:`lightning_par.checkpoint`):
the model's and optimizers' shards keyed by one-process names (loadable into another layout, dp mode, strategy, and
into one process), everything else in ``meta.pt``, and a record (``lightning_par.json``, :func:`record`). The Trainer
adapter (:class:`lightning_par.checkpoint.strategy_io.ShardedCheckpointIO`) and the Fabric adapter both load through
:func:`load_parallel_state` and write :func:`record`; a loop that hands a dict of named objects (Fabric's ``state``:
one module, its optimizers, anything else) saves and loads through :func:`save_state` and :func:`load_state`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

__all__ = ["STATE_KEYS", "load_parallel_state", "load_state", "record", "save_state"]

#: Entry of a ``state`` checkpoint's ``meta.pt``: which keys of the saved ``state`` held the module and the optimizers.
STATE_KEYS = "fabric_keys"


def load_parallel_state(
    parallel: Any, path: Path, optimizers: list[Any], before_load: Any = None, skip: set[str] | None = None
) -> dict[str, Any]:
    """Load a sharded checkpoint of any layout, dp mode or strategy into this rank's part of ``parallel`` (a
    :class:`~lightning_par.parallelize.ParallelModel`) and of ``optimizers`` (plain torch optimizers over its
    parameters, in the saved order). Collective. The Trainer strategies and the Fabric strategies load through it.
    ``skip``: model entries neither read nor set (an adapter-only checkpoint's frozen base:
    :mod:`lightning_par.checkpoint.adapter_only`).

    Returns:
        The metadata (``meta.pt``): everything else the checkpoint holds.

    Raises:
        FileNotFoundError, ValueError: see :func:`lightning_par.checkpoint.load_sharded`; an optimizer with another
            number of param groups than the saved one.
    """
    from lightning_par.checkpoint.sharded import load_sharded

    engine = parallel.engine
    model_state = engine.model_state_dict()
    optimizer_states = [engine.optimizer_state_dict(o) for o in optimizers]
    parallel.to_one_process(model_state, optimizer_states)
    for name in skip or ():
        model_state.pop(name, None)
    # DCP keeps one copy of a non-tensor entry such as ``param_groups`` (the coordinator's): under pipelining its
    # parameter names are those of one stage. Keep the saved hyper-parameters and this rank's own names.
    own_names = [[list(g["params"]) for g in state["param_groups"]] for state in optimizer_states]
    meta = load_sharded(path, model_state, optimizer_states, before_load=before_load)
    for state, names in zip(optimizer_states, own_names):
        if len(state["param_groups"]) != len(names):
            raise ValueError(
                f"checkpoint {str(path)!r} has an optimizer with {len(state['param_groups'])} param groups, this "
                f"one has {len(names)}: build the optimizer with the same groups."
            )
        state["param_groups"] = [{**g, "params": n} for g, n in zip(state["param_groups"], names)]
    engine.load_model_state_dict(model_state)
    for optimizer, state in zip(optimizers, optimizer_states):
        engine.load_optimizer_state_dict(optimizer, state)
    return meta


def record(core: Any, checkpoint: dict[str, Any], module: Any = None) -> dict[str, Any]:
    """What a strategy writes into a checkpoint's record (``lightning_par.json``): its name, layout and options
    (``core``: a :class:`~lightning_par.runtime.core.StrategyCore`), the step and epoch of ``checkpoint``, and whether
    ``module`` saves its adapters only."""
    from lightning_par.checkpoint.adapter_only import adapter_only

    dims = core.parallel_dims
    layout = {} if dims is None else {"tp_size": dims.tp_size, "pp_size": dims.pp_size, **dims.sizes()}
    return {
        "strategy": core.strategy_name,
        "layout": layout,
        "dp_mode": core.dp_mode,
        "global_step": checkpoint.get("global_step"),
        "epoch": checkpoint.get("epoch"),
        "pp_schedule": core.options.pipeline.schedule if dims is not None and dims.pp_enabled else None,
        "sequence_parallel": core.options.tensor_parallel.sequence_parallel,
        "torch": torch.__version__,
        "adapter_only": adapter_only(module),
    }


def split_state(parallel: Any, state: dict[str, Any]) -> tuple[str, list[str], list[str]]:
    """``(the module's key, the optimizers' keys, the other keys)`` of ``state``.

    Raises:
        ValueError: ``state`` does not hold exactly one module, the one ``parallel`` runs.
    """
    modules = [k for k, v in state.items() if isinstance(v, nn.Module)]
    if len(modules) != 1 or parallel is None or state[modules[0]] is not parallel.module:
        raise ValueError(
            f"state={sorted(state)} is not valid here: expected exactly one model, the one given to fabric.setup "
            f"(found {len(modules)} nn.Module entries: {modules})."
        )
    optimizers = [k for k, v in state.items() if isinstance(v, Optimizer)]
    others = [k for k in state if k not in modules and k not in optimizers]
    return modules[0], optimizers, others


def save_state(parallel: Any, path: Path, state: dict[str, Any], record: dict[str, Any], *, is_rank0: bool,
               barrier: Callable[[], None]) -> None:
    """Write ``state`` (one module, its optimizers, other entries: their ``state_dict()`` or themselves) as a sharded
    checkpoint directory at ``path`` with ``record``. Collective.

    Raises:
        ValueError: see :func:`split_state`.
    """
    from lightning_par.checkpoint.sharded import save_sharded

    module_key, optimizer_keys, others = split_state(parallel, state)
    checkpoint: dict[str, Any] = {}
    for k in others:
        v = state[k]
        checkpoint[k] = v.state_dict() if hasattr(v, "state_dict") and callable(v.state_dict) else v
    checkpoint[STATE_KEYS] = {"module": module_key, "optimizers": optimizer_keys}
    checkpoint["state_dict"] = parallel.model_state_dict()
    checkpoint["optimizer_states"] = [
        parallel.optimizer_state_dict(getattr(state[k], "optimizer", state[k])) for k in optimizer_keys
    ]
    save_sharded(path, checkpoint, record, is_rank0=is_rank0, barrier=barrier)


def load_state(parallel: Any, path: Path, state: Any, strict: bool = True) -> dict[str, Any]:
    """Load a checkpoint of :func:`save_state` (any layout, dp mode or strategy that wrote it) into the module and
    optimizers of ``state``; the other entries of ``state`` are replaced by the saved ones (an object with
    ``load_state_dict`` loads its saved state). An empty ``state``: the whole checkpoint, the model's weights in full.
    Returns the saved entries ``state`` did not name. Collective.

    Raises:
        KeyError: ``strict`` and an entry of ``state`` the checkpoint lacks.
        ValueError: see :func:`lightning_par.checkpoint.load_sharded`; ``state`` without the set-up model, or with
            other optimizers than the saved ones.
    """
    from lightning_par.checkpoint.loading import read_full_checkpoint
    from lightning_par.checkpoint.safe import load_metadata_file
    from lightning_par.checkpoint.sharded import METADATA_FILENAME

    if not state:
        checkpoint = read_full_checkpoint(path)
        keys = checkpoint.pop(STATE_KEYS, {"module": "state_dict"})
        checkpoint[keys["module"]] = checkpoint.pop("state_dict")
        return checkpoint
    _, optimizer_keys, others = split_state(parallel, state)

    def check(meta: dict[str, Any]) -> None:
        saved_opt = list((meta.get(STATE_KEYS) or {}).get("optimizers", []))
        if sorted(saved_opt) != sorted(optimizer_keys) and (strict or not set(optimizer_keys) <= set(saved_opt)):
            raise ValueError(
                f"checkpoint {str(path)!r} holds the optimizers {saved_opt}, state has {optimizer_keys}: pass "
                f"the same keys."
            )
        missing = [k for k in others if k not in meta]
        if strict and missing:
            raise KeyError(
                f"checkpoint {str(path)!r} has no entries {missing}; it has "
                f"{sorted(k for k in meta if k != STATE_KEYS)}. Pass strict=False to skip them."
            )

    # the optimizers in the order the checkpoint saved them (its optimizer_<i> entries)
    saved = list((load_metadata_file(path / METADATA_FILENAME).get(STATE_KEYS) or {}).get("optimizers", []))
    order = [k for k in saved if k in optimizer_keys] if set(optimizer_keys) <= set(saved) else optimizer_keys
    meta = load_parallel_state(parallel, path, [getattr(state[k], "optimizer", state[k]) for k in order],
                               before_load=check)
    meta.pop(STATE_KEYS, None)
    for k in others:
        if k not in meta:
            continue
        value = meta.pop(k)
        if hasattr(state[k], "load_state_dict") and callable(state[k].load_state_dict):
            state[k].load_state_dict(value)
        else:
            state[k] = value
    return meta
