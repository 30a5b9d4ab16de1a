"""Turn a composed run config into the objects of a run: strategy, model, data module.

Runtime objects (process groups, meshes) are never built through Hydra's recursive ``_target_``: the strategy builds
them in ``setup_environment``, after its process group exists. Here only plain values are passed on.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_par.data import ByteCorpusDataModule
from lightning_par.models import GPTConfig, GPTLightningModule
from lightning_par.parallel_dims import ParallelDims
from lightning_par.parallelize import OPTION_GROUPS

__all__ = ["build_datamodule", "build_module", "build_parallel_dims", "build_strategy", "strategy_classes"]


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
    """The strategy named by ``strategy.name`` with the layout of ``parallel`` and its own options (option groups
    nested as in the schemas: ``strategy.pipeline.schedule``, ``strategy.reducer.comm_hook``, ...).

    Raises:
        ValueError: an unknown strategy name; an option that contradicts the name (``strategy=gpipe
            strategy.pipeline.schedule=1f1b``); a size > 1 on an axis the strategy does not have; an option the
            strategy rejects.
    """
    options = _plain(cfg.strategy)
    name = options.pop("name")
    classes = strategy_classes()
    if name not in classes:
        raise ValueError(f"strategy.name={name!r} is not valid: expected one of {sorted(classes)}.")
    cls = classes[name]
    preset = cls.registry_presets.get(name, {})
    for key, value in preset.items():
        group = next((g for g, names in OPTION_GROUPS.items() if key in names), None)
        given = (options.get(group) or {}).get(key) if group else options.get(key)
        if given is not None and given != value:
            path = f"strategy.{group}.{key}" if group else f"strategy.{key}"
            raise ValueError(
                f"{path}={given!r} contradicts strategy={name!r}, which runs {key}={value!r}: drop the override, or "
                f"use a strategy name that takes any {key}" + (" (strategy=pipeline)." if key == "schedule" else ".")
            )
        if group and given is not None:
            options[group].pop(key)
    dims = build_parallel_dims(cfg)
    layout = {"dp_size": dims.dp_size}
    for axis in ("tp", "pp"):
        value = getattr(dims, f"{axis}_size")
        if axis in cls.axes:
            layout[f"{axis}_size"] = value
        elif value != 1:
            raise ValueError(
                f"parallel.{axis}_size={value} is not valid for strategy {name!r}, which has no {axis} axis: use "
                f"parallel.{axis}_size=1 or a strategy that has it (parallel_3d has all three)."
            )
    options = {k: v for k, v in options.items() if not (k in OPTION_GROUPS and not v)}
    return cls(**{**preset, **options, **layout})


def build_module(cfg: Any) -> GPTLightningModule:
    """The reference GPT LightningModule from the ``model`` group (preset + overrides).

    Raises:
        ValueError: an unknown preset or an invalid field.
    """
    m = _plain(cfg.model)
    overrides = {k: m[k] for k in ("n_layer", "n_head", "n_embd", "block_size") if m.get(k) is not None}
    config = GPTConfig.from_preset(
        m["preset"], vocab_size=m["vocab_size"], dropout=m["dropout"], bias=m["bias"], **overrides
    )
    return GPTLightningModule(
        config,
        learning_rate=m["learning_rate"],
        weight_decay=m["weight_decay"],
        warmup_steps=m["warmup_steps"],
        min_lr_ratio=m["min_lr_ratio"],
        max_steps=max(cfg.trainer.max_steps, m["warmup_steps"], 1),
        adam_eps=m["adam_eps"],
    )


def build_datamodule(cfg: Any, block_size: int) -> ByteCorpusDataModule:
    """The byte-corpus data module from the ``data`` group; ``block_size`` comes from the model."""
    d = _plain(cfg.data)
    return ByteCorpusDataModule(
        path=d["path"],
        block_size=block_size,
        batch_size=d["batch_size"],
        num_workers=d["num_workers"],
        synthetic=d["synthetic"],
        seed=cfg.seed,
        cache_dir=d["cache_dir"],
        val_batches=d["val_batches"],
    )
