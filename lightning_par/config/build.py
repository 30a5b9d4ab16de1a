"""Turn a composed run config into the objects of a run: strategy, model, data module, loggers, Trainer arguments.

``model``, ``data`` and ``logger`` entries are built with ``hydra.utils.instantiate`` from their ``_target_`` (our
reference GPT and corpora are ordinary entries of those groups), after their keys were checked against the target's
signature, so a typo fails before any process starts. Runtime objects (process groups, meshes) are never built
through Hydra's recursive ``_target_``: the strategy builds them in ``setup_environment``, after its process group
exists.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_par.config.schema import TRAINER_RECIPE_KEYS
from lightning_par.models import GPTConfig, GPTLightningModule
from lightning_par.parallel_dims import ParallelDims

__all__ = [
    "build_datamodule",
    "build_loggers",
    "build_module",
    "build_parallel_dims",
    "build_strategy",
    "build_trainer_kwargs",
    "check_loggers",
    "cluster_nodes_and_devices",
    "gpt_lightning_module",
    "instantiate_entry",
    "model_block_size",
    "strategy_classes",
]

log = logging.getLogger(__name__)

#: Keys ``hydra.utils.instantiate`` reads itself; never passed to the target.
_HYDRA_KEYS = frozenset({"_target_", "_args_", "_convert_", "_recursive_", "_partial_"})


def _plain(cfg: Any) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)


def strategy_classes() -> dict[str, type]:
    """Registry name -> strategy class, for every lightning_par strategy."""
    from lightning_par.strategies import STRATEGIES

    names: dict[str, type] = {}
    for cls in STRATEGIES:
        for name in cls.registry_names or (cls.strategy_name,):
            names[name] = cls
    return names


def build_parallel_dims(cfg: Any) -> ParallelDims:
    """Validated layout from the ``parallel`` group.

    Raises:
        ValueError: an impossible layout (names the field, the value and what would be valid).
    """
    p = _plain(cfg.parallel)
    return ParallelDims(dp_size=p["dp_size"], tp_size=p["tp_size"], pp_size=p["pp_size"], world_size=p["world_size"])


def build_strategy(cfg: Any) -> Any:
    """The strategy named by ``strategy.name`` with the layout of ``parallel`` and its own options.

    Raises:
        ValueError: an unknown strategy name, an option the strategy rejects, or a layout it cannot run.
    """
    options = _plain(cfg.strategy)
    name = options.pop("name")
    classes = strategy_classes()
    if name not in classes:
        raise ValueError(f"strategy.name={name!r} is not valid: expected one of {sorted(classes)}.")
    cls = classes[name]
    dims = build_parallel_dims(cfg)
    layout = {"dp_size": dims.dp_size}
    for axis in ("tp_size", "pp_size"):
        value = getattr(dims, axis)
        if axis in cls.__init__.__code__.co_varnames:
            layout[axis] = value
        elif value != 1:
            raise ValueError(
                f"parallel.{axis}={value} is not valid for strategy {name!r}, which has no {axis.split('_')[0]} axis: "
                f"use parallel.{axis}=1 or a strategy that supports it."
            )
    preset = getattr(cls, "registry_presets", {}).get(name, {})
    return cls(**{**preset, **options, **layout})


def gpt_lightning_module(
    preset: str = "small",
    n_layer: int | None = None,
    n_head: int | None = None,
    n_embd: int | None = None,
    block_size: int | None = None,
    vocab_size: int = 256,
    dropout: float = 0.0,
    bias: bool = True,
    learning_rate: float = 1e-3,
    weight_decay: float = 0.1,
    warmup_steps: int = 20,
    min_lr_ratio: float = 0.1,
    adam_eps: float = 1e-8,
    max_steps: int | None = None,
) -> GPTLightningModule:
    """The reference GPT LightningModule from a preset plus overrides: the ``_target_`` of ``model=tiny|small|...``.

    Args:
        preset: a key of :data:`lightning_par.models.GPT_PRESETS`.
        n_layer, n_head, n_embd, block_size: replace the preset's value when not None.
        vocab_size, dropout, bias: :class:`~lightning_par.models.GPTConfig` fields.
        learning_rate, weight_decay, warmup_steps, min_lr_ratio, adam_eps: AdamW and its warmup + cosine schedule.
        max_steps: optimizer step where the cosine ends (raised to ``max(warmup_steps, 1)``); None keeps the rate flat
            after warmup.

    Raises:
        ValueError: an unknown preset or an invalid field (named, with what is valid).
    """
    shape = {"n_layer": n_layer, "n_head": n_head, "n_embd": n_embd, "block_size": block_size}
    config = GPTConfig.from_preset(
        preset, vocab_size=vocab_size, dropout=dropout, bias=bias, **{k: v for k, v in shape.items() if v is not None}
    )
    return GPTLightningModule(
        config,
        learning_rate=learning_rate,
        weight_decay=weight_decay,
        warmup_steps=warmup_steps,
        min_lr_ratio=min_lr_ratio,
        max_steps=None if max_steps is None else max(max_steps, warmup_steps, 1),
        adam_eps=adam_eps,
    )


def _target_of(group: str, node: Mapping[str, Any]) -> Any:
    """The object ``node["_target_"]`` names, imported.

    Raises:
        ValueError: ``_target_`` is missing or cannot be imported.
    """
    target = node.get("_target_") if isinstance(node, Mapping) else None
    if target is None or target == "???":
        raise ValueError(
            f"{group}._target_ is missing: {group}=custom needs {group}._target_=my_pkg.MyClass (a class or function "
            f"importable from PYTHONPATH), plus its arguments as +{group}.KEY=VALUE."
        )
    if not isinstance(target, str):
        return target
    from hydra.utils import get_object

    try:
        return get_object(target)
    except Exception as err:  # noqa: BLE001 - Hydra wraps import failures in several exception types
        raise ValueError(
            f"{group}._target_={target!r} cannot be imported ({err}): expected a dotted path to a class or function "
            f"on PYTHONPATH (the current directory is {os.getcwd()})."
        ) from err


def _check_arguments(group: str, target: Any, node: Mapping[str, Any]) -> None:
    """Refuse keys of ``node`` that ``target`` does not accept (unless it takes ``**kwargs``).

    Raises:
        ValueError: an unknown key, naming it and the valid ones.
    """
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):  # builtins and C types without a signature: let the call decide
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    valid = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = sorted(set(node) - _HYDRA_KEYS - set(valid))
    if unknown:
        name = getattr(target, "__qualname__", repr(target))
        raise ValueError(
            f"{group}.{unknown[0]}={node[unknown[0]]!r} is not valid: {name} takes no argument {unknown[0]!r}; "
            f"valid keys are {sorted(valid)}."
        )


def instantiate_entry(group: str, node: Any, **kwargs: Any) -> Any:
    """Build a config group entry (``model``, ``data``, a logger) from its ``_target_`` with ``hydra.utils.instantiate``.

    The entry's keys are checked against the target's signature first, so a typo (``+model.hiden=512``) is a
    ``ValueError`` naming the key and the valid ones instead of a ``TypeError`` deep in a worker. Containers reach the
    target as plain ``dict``/``list`` (``_convert_="all"``), nested entries with a ``_target_`` are built too.

    Args:
        group: the entry's place in the config, for messages (``"model"``, ``"logger.csv"``).
        node: the entry (a ``DictConfig`` or a plain mapping) with a ``_target_``.
        **kwargs: arguments that replace the entry's own (e.g. a ``block_size`` taken from the model).

    Raises:
        ValueError: no ``_target_``, a target that cannot be imported, or an argument the target does not take.
    """
    from hydra.utils import instantiate

    plain = _plain(node)
    target = _target_of(group, plain)
    plain.update(kwargs)
    _check_arguments(group, target, plain)
    return instantiate(plain, _convert_="all")


def build_module(cfg: Any) -> Any:
    """The LightningModule of the ``model`` group entry (the reference GPT's presets or any ``_target_``).

    Raises:
        ValueError: a missing or unimportable ``_target_``, an argument the target does not take, or (for the GPT) an
            unknown preset or invalid field.
    """
    return instantiate_entry("model", cfg.model)


def model_block_size(module: Any) -> int | None:
    """The sequence length a module was built for: ``module.config.block_size``, ``module.block_size`` or the same on
    its network ``module.model``; ``None`` when it declares none."""
    for owner in (module, getattr(module, "model", None)):
        for holder in (getattr(owner, "config", None), owner):
            value = getattr(holder, "block_size", None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def build_datamodule(cfg: Any, module: Any = None) -> Any:
    """The LightningDataModule of the ``data`` group entry (a byte corpus or any ``_target_``).

    A ``data.block_size`` left ``null`` is taken from the model (:func:`model_block_size`).

    Args:
        cfg: the run config.
        module: the LightningModule being trained (or an ``int`` block size).

    Raises:
        ValueError: as :func:`instantiate_entry`, or ``data.block_size`` is null and the model declares none.
    """
    plain = _plain(cfg.data)
    extra: dict[str, Any] = {}
    if "block_size" in plain and plain["block_size"] is None:
        block = module if isinstance(module, int) else model_block_size(module)
        if block is None:
            raise ValueError(
                f"data.block_size=None is not valid for {type(module).__name__}, which declares no block_size "
                f"(module.config.block_size or module.block_size): set data.block_size=N."
            )
        extra["block_size"] = block
    return instantiate_entry("data", plain, **extra)


# ---------------------------------------------------------------------------------------------------- loggers
#: Logger class name -> (modules of which one must be importable, the pip extra that installs one).
_LOGGER_PACKAGES: dict[str, tuple[tuple[str, ...], str]] = {
    "TensorBoardLogger": (("tensorboard", "tensorboardX"), "tensorboard"),
    "WandbLogger": (("wandb",), "wandb"),
    "MLFlowLogger": (("mlflow",), "mlflow"),
}


#: Optional loggers already reported missing in this process (forked ranks inherit it: one warning per job).
_WARNED: set[str] = set()


def check_loggers(cfg: Any) -> list[str]:
    """The names of the ``logger`` entries that will be built, after checking that their packages are installed.

    An entry whose package is missing fails with an install hint, unless it says ``required: false`` (the default
    ``tensorboard`` entry): then it is skipped with a warning.

    Raises:
        ModuleNotFoundError: a required logger's package is missing (the message says what to install).
        ValueError: an entry without ``_target_``.
    """
    entries = _plain(cfg.get("logger") or {}) if hasattr(cfg, "get") else {}
    names = []
    for name, node in entries.items():
        if node is None:
            continue
        target = node.get("_target_") if isinstance(node, Mapping) else None
        if not target:
            raise ValueError(f"logger.{name} has no _target_: expected a Lightning logger config such as logger=csv.")
        modules, extra = _LOGGER_PACKAGES.get(str(target).rsplit(".", 1)[-1], ((), ""))
        if modules and not any(importlib.util.find_spec(m) is not None for m in modules):
            hint = f"pip install 'lightning-par[{extra}]' or pip install {modules[0]}"
            if node.get("required", True):
                raise ModuleNotFoundError(
                    f"logger.{name} ({target}) needs the {modules[0]!r} package, which is not installed: {hint}, or "
                    f"leave it out of the logger list (logger=[csv])."
                )
            if name not in _WARNED:
                _WARNED.add(name)
                log.warning("logger.%s skipped: %s is not installed; %s.", name, " or ".join(modules), hint)
            continue
        names.append(name)
    return names


def build_loggers(cfg: Any, run_dir: str | Path) -> list[Any] | bool:
    """The Lightning loggers of the ``logger`` group; ``False`` (no logging) when it is empty.

    A logger whose ``save_dir`` is ``null`` writes into ``run_dir``.

    Raises:
        ModuleNotFoundError, ValueError: see :func:`check_loggers` and :func:`instantiate_entry`.
    """
    entries = _plain(cfg.get("logger") or {})
    loggers = []
    for name in check_loggers(cfg):
        node = dict(entries[name])
        node.pop("required", None)
        if "save_dir" in node and node["save_dir"] is None:
            node["save_dir"] = str(run_dir)
        loggers.append(instantiate_entry(f"logger.{name}", node))
    return loggers or False


# ---------------------------------------------------------------------------------------------------- Trainer
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


def _resolve_nodes_and_devices(cfg: Any, env: Mapping[str, str] | None) -> tuple[int, int]:
    world = build_parallel_dims(cfg).world_size
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


def build_trainer_kwargs(cfg: Any, env: Mapping[str, str] | None = None) -> dict[str, Any]:
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

    Raises:
        ValueError: an unknown ``trainer`` key (named, with the valid ones), a key the recipe sets elsewhere, or
            ``num_nodes``/``devices`` that contradict the layout or the launcher.
    """
    import lightning as L

    options = _plain(cfg.trainer)
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
    kwargs["num_nodes"], kwargs["devices"] = _resolve_nodes_and_devices(cfg, env)
    kwargs["enable_checkpointing"] = bool(options.get("checkpoint", False))
    return kwargs
