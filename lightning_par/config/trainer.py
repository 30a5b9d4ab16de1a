"""The ``lightning.Trainer`` arguments of the ``trainer`` config group, and the machines of an outside launcher."""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from typing import Any

from lightning_par.config.instantiate import plain
from lightning_par.config.schema import TRAINER_RECIPE_KEYS

__all__ = ["build_trainer_kwargs", "cluster_nodes_and_devices"]

#: ``lightning.Trainer`` arguments that the recipe sets from elsewhere: where to set them instead.
_RECIPE_OWNED_ARGS: dict[str, str] = {
    "strategy": "the strategy group (strategy=NAME, strategy.KEY=VALUE)",
    "logger": "the logger group (logger=[csv,tensorboard])",
    "callbacks": "the recipe (metrics, summary and checkpoint callbacks)",
    "default_root_dir": "the Hydra run directory (hydra.run.dir)",
    "enable_checkpointing": "trainer.checkpoint",
}


def cluster_nodes_and_devices(env: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """``(num_nodes, processes per node)`` of a world started by an outside launcher, or ``None`` when there is none.

    torchrun: ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE``; SLURM (``srun``, submitit): ``SLURM_NTASKS`` and
    ``SLURM_NNODES`` (with ``SLURM_PROCID`` set and more than one task).
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_WORLD_SIZE", world))
        return max(1, world // max(1, local)), local
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        tasks, nodes = int(env["SLURM_NTASKS"]), int(env.get("SLURM_NNODES", "1"))
        return nodes, tasks // max(1, nodes)
    return None


def _resolve_nodes_and_devices(cfg: Any, env: Mapping[str, str] | None, world_size: int | None) -> tuple[int, int]:
    if world_size is None:  # no layout handed in: validate one (the recipe hands its own, built once per process)
        from lightning_par.config.build import build_parallel_dims  # build re-exports this module

        world_size = build_parallel_dims(cfg).world_size
    world = world_size
    num_nodes, devices = cfg.trainer.get("num_nodes"), cfg.trainer.get("devices")
    cluster = cluster_nodes_and_devices(env)
    if cluster is None:
        if num_nodes not in (None, 1):
            raise ValueError(
                f"trainer.num_nodes={num_nodes} is not valid here: several machines need their processes started on "
                f"every machine by torchrun or SLURM (srun, hydra/launcher=submitit_slurm); without one, use "
                f"trainer.num_nodes=1 (or null)."
            )
        expected = (1, world)
    else:
        expected = cluster
    for key, value, want in (("num_nodes", num_nodes, expected[0]), ("devices", devices, expected[1])):
        if value is not None and value != want:
            raise ValueError(
                f"trainer.{key}={value} is not valid: the world of parallel.world_size={world} processes has {want} "
                f"{'machine(s)' if key == 'num_nodes' else 'process(es) per machine'} here; use trainer.{key}={want} "
                f"or null (taken from the environment)."
            )
    if expected[0] * expected[1] != world:
        raise ValueError(
            f"parallel.world_size={world} does not match the {expected[0]} x {expected[1]} processes started by the "
            f"launcher (nodes x processes per node): set parallel.world_size={expected[0] * expected[1]}."
        )
    return expected


def build_trainer_kwargs(cfg: Any, env: Mapping[str, str] | None = None, dims: Any = None) -> dict[str, Any]:
    """The ``lightning.Trainer`` arguments of the ``trainer`` group (all but ``strategy``, ``logger``, ``callbacks``
    and ``default_root_dir``, which the recipe adds).

    Every ``trainer.*`` key is either a ``lightning.Trainer`` argument, passed on as is (``+trainer.limit_val_batches=2``
    works), or a recipe setting (:data:`~lightning_par.config.schema.TRAINER_RECIPE_KEYS`); anything else is refused.
    ``num_nodes`` and ``devices`` (processes per machine) come from the outside launcher when there is one
    (:func:`cluster_nodes_and_devices`), else ``1`` and ``parallel.world_size``; values set in the config must agree.
    ``accelerator="auto"`` picks ``gpu`` when CUDA is available, else ``cpu``. Defaults the recipe adds unless set:
    ``check_val_every_n_epoch=None`` (validation every ``val_check_interval`` steps), ``enable_model_summary=False``.

    Args:
        cfg: the run config.
        env: the environment to read (``os.environ`` by default).
        dims: the :class:`~lightning_par.parallel_dims.ParallelDims` already validated from ``cfg.parallel`` (``None``:
            validated here).

    Raises:
        ValueError: an unknown ``trainer`` key (named, with the valid ones), a key the recipe sets elsewhere, or
            ``num_nodes``/``devices`` that contradict the layout or the launcher.
    """
    import lightning as L

    options = plain(cfg.trainer)
    valid = set(inspect.signature(L.Trainer.__init__).parameters) - {"self"}
    kwargs: dict[str, Any] = {"check_val_every_n_epoch": None, "enable_model_summary": False}
    for key, value in options.items():
        if key in TRAINER_RECIPE_KEYS or key in ("num_nodes", "devices"):
            continue
        if key in _RECIPE_OWNED_ARGS:
            raise ValueError(f"trainer.{key} is not valid: the recipe sets it from {_RECIPE_OWNED_ARGS[key]}.")
        if key not in valid:
            allowed = sorted((valid - set(_RECIPE_OWNED_ARGS)) | TRAINER_RECIPE_KEYS)
            raise ValueError(
                f"trainer.{key}={value!r} is not valid: it is neither a lightning.Trainer argument nor a recipe "
                f"setting. Valid keys: {allowed}."
            )
        kwargs[key] = value
    if kwargs.get("accelerator", "auto") == "auto":
        import torch

        kwargs["accelerator"] = "gpu" if torch.cuda.is_available() else "cpu"
    world = None if dims is None else dims.world_size
    kwargs["num_nodes"], kwargs["devices"] = _resolve_nodes_and_devices(cfg, env, world)
    kwargs["enable_checkpointing"] = bool(options.get("checkpoint", False))
    return kwargs
