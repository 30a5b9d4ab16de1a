"""Turn a composed run config into the objects of a run: strategy, model, data module, loggers, Trainer arguments.

``model``, ``data`` and ``logger`` entries are built with ``hydra.utils.instantiate`` from their ``_target_`` (our
reference GPT and corpora are ordinary entries of those groups), after their keys were checked against the target's
signature, so a typo fails before any process starts (:mod:`lightning_par.config.instantiate`). The loggers
(:mod:`lightning_par.config.loggers`) and the Trainer arguments (:mod:`lightning_par.config.trainer`) have their own
modules, re-exported here. Runtime objects (process groups, meshes) are never built
through Hydra's recursive ``_target_``: the strategy builds them in ``setup_environment``, after its process group
exists.
"""

from __future__ import annotations

import inspect
from typing import Any

from lightning_par.config.instantiate import instantiate_entry, plain
from lightning_par.config.loggers import build_loggers, check_loggers
from lightning_par.config.trainer import build_trainer_kwargs, cluster_nodes_and_devices
from lightning_par.models import GPTConfig, GPTLightningModule
from lightning_par.axes import axis_of_size
from lightning_par.parallel_dims import SIZE_FIELDS, ParallelDims
from lightning_par.parallelize import OPTION_GROUPS

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

_plain = plain


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
    return ParallelDims(**_plain(cfg.parallel))


def build_strategy(cfg: Any, dims: ParallelDims | None = None) -> Any:
    """The strategy named by ``strategy.name`` with the layout of ``parallel`` and its own options (option groups
    nested as in the schemas: ``strategy.pipeline.schedule``, ``strategy.reducer.comm_hook``, ...). ``dims`` is the
    layout already validated from ``cfg.parallel`` (``None``: validated here); it is handed to the strategy
    (:meth:`~lightning_par.strategies.MeshStrategy.use_parallel_dims`), which then builds no other.

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
    dims = dims or build_parallel_dims(cfg)
    sizes = {"dp_size": dims.dp_size, **dims.sizes()}
    cls.check_axes(sizes, prefix="parallel.", label=f"strategy {name!r}")
    # Every size of an axis the strategy has (a preset's default is not the layout's), and the rest where not 1.
    layout = {k: getattr(dims, k) for k in (*SIZE_FIELDS.values(), "ep_size") if k != "dp_shard_size"}
    layout = {k: v for k, v in {"dp_size": dims.dp_size, **layout}.items() if v != 1 or k == "dp_size" or (
        axis_of_size(k) is not None and cls.has_axis(axis_of_size(k).name))}
    options = {k: v for k, v in options.items() if not (k in OPTION_GROUPS and not v)}
    strategy = cls(**{**preset, **options, **layout})
    strategy.use_parallel_dims(dims)  # this process's one layout: setup_environment builds the mesh on it
    return strategy


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
    num_experts: int | None = None,
    moe_every: int | None = None,
    moe_top_k: int | None = None,
    moe_hidden: int | None = None,
    moe_gating: str | None = None,
    moe_shared_expert: bool | None = None,
    moe_capacity_factor: float | None = None,
    moe_aux_loss_coeff: float | None = None,
    moe_z_loss_coeff: float | None = None,
    moe_balance: str | None = None,
    moe_bias_update_rate: float | None = None,
    moe_experts_form: str | None = None,
    optimizer: str = "adamw",
    **optimizer_options: Any,
) -> GPTLightningModule:
    """The reference GPT LightningModule from a preset plus overrides: the ``_target_`` of ``model=tiny|small|...``.

    Args:
        preset: a key of :data:`lightning_par.models.GPT_PRESETS`.
        n_layer, n_head, n_embd, block_size: replace the preset's value when not None.
        vocab_size, dropout, bias: :class:`~lightning_par.models.GPTConfig` fields.
        learning_rate, weight_decay, warmup_steps, min_lr_ratio, adam_eps: AdamW and its warmup + cosine schedule.
        max_steps: optimizer step where the cosine ends (raised to ``max(warmup_steps, 1)``); None keeps the rate flat
            after warmup.
        optimizer, optimizer_options: ``"adamw"`` or a registered optimizer (``"muon"``) and its keywords
            (``muon_lr``, ...: :mod:`lightning_par.optim.registry`, docs/muon.md).
        num_experts, moe_*: the mixture-of-experts fields of :class:`~lightning_par.models.GPTConfig`, replacing the
            preset's when not None (``moe_capacity_factor=None`` is dropless).

    Raises:
        ValueError: an unknown preset or an invalid field (named, with what is valid).
    """
    shape = {"n_layer": n_layer, "n_head": n_head, "n_embd": n_embd, "block_size": block_size,
             "num_experts": num_experts, "moe_every": moe_every, "moe_top_k": moe_top_k, "moe_hidden": moe_hidden,
             "moe_gating": moe_gating, "moe_shared_expert": moe_shared_expert,
             "moe_capacity_factor": moe_capacity_factor, "moe_aux_loss_coeff": moe_aux_loss_coeff,
             "moe_z_loss_coeff": moe_z_loss_coeff, "moe_balance": moe_balance,
             "moe_bias_update_rate": moe_bias_update_rate, "moe_experts_form": moe_experts_form}
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
        optimizer=optimizer,
        **optimizer_options,
    )


def _signature_with_optimizer_keywords(function: Any) -> Any:
    """``function`` with its signature showing every registered optimizer's keywords (``muon_lr``, ...) in place of
    ``**optimizer_options``, so that the recipe's argument check (:func:`instantiate_entry`) still names a misspelt
    key and lists the valid ones."""
    from lightning_par.optim.registry import builtin_keywords

    signature = inspect.signature(function)
    params = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params += [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=v) for k, v in builtin_keywords().items()]
    function.__signature__ = signature.replace(parameters=params)
    return function


gpt_lightning_module = _signature_with_optimizer_keywords(gpt_lightning_module)


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


def model_vocab_size(module: Any) -> int | None:
    """The vocabulary a module was built for: ``module.config.vocab_size`` or the same on its network
    ``module.model`` (a Hugging Face model's config); ``None`` when it declares none."""
    for owner in (module, getattr(module, "model", None)):
        value = getattr(getattr(owner, "config", None), "vocab_size", None)
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


