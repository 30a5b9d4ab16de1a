"""Structured-config schemas for the Hydra recipes: a bad override fails when the config is composed.

Each config group under ``conf/`` (``parallel``, ``strategy``, ``model``, ``data``, ``trainer``, ``logger``) has a
dataclass per kind of entry here, stored in Hydra's ConfigStore as ``<group>/schema_<name>`` so that the YAML options
extend it (``defaults: [schema_ddp_overlap, _self_]``). A type error (``parallel.dp_size=two``) or an unknown key is
then reported by OmegaConf at compose time; an unknown option of a group (``strategy=foo``) by Hydra, which lists the
options it has.

``model``, ``data`` and ``logger`` entries carry a ``_target_`` and are built with ``hydra.utils.instantiate``: our
entries (the reference GPT, the byte corpora, Lightning's loggers) have closed schemas, ``model=custom`` and
``data=custom`` an open one for any user class.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import II, MISSING

from hydra.core.config_store import ConfigStore

__all__ = [
    "BYTE_CORPUS_TARGET",
    "ByteCorpusDataConfig",
    "CSVLoggerConfig",
    "CustomDataConfig",
    "CustomModelConfig",
    "DataConfig",
    "GPT_TARGET",
    "GPTModelConfig",
    "LOGGER_SCHEMAS",
    "MLFlowLoggerConfig",
    "TensorBoardLoggerConfig",
    "TRAINER_RECIPE_KEYS",
    "WandbLoggerConfig",
    "DDPOverlapConfig",
    "ModelConfig",
    "Parallel3DConfig",
    "ParallelConfig",
    "ReducerConfig",
    "PipelineConfig",
    "RunConfig",
    "STRATEGY_SCHEMAS",
    "StrategyConfig",
    "TensorParallelConfig",
    "TrainerConfig",
    "ZeroConfig",
    "register_configs",
]


@dataclass
class ParallelConfig:
    """The layout: how many processes, and how they split over the ``("pp", "dp", "tp")`` mesh."""

    #: processes to start (one per device; on CPU, gloo processes).
    world_size: int = 2
    #: data-parallel replicas; -1 infers ``world_size // (tp_size * pp_size)``.
    dp_size: int = -1
    #: tensor-parallel ranks per layer.
    tp_size: int = 1
    #: pipeline stages.
    pp_size: int = 1


@dataclass
class StrategyConfig:
    """Fields every strategy accepts; ``name`` is the Lightning registry name."""

    name: str = "ddp_overlap"
    #: seconds a collective may wait for a peer before it raises (a dead rank ends the job, never hangs it).
    timeout_s: float = 1800.0


@dataclass
class ReducerConfig(StrategyConfig):
    """The dp-axis gradient reducer's options (:func:`lightning_par.data_parallel.reducer.reducer_options`), shared
    by every strategy whose dp axis all-reduces gradients."""

    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False
    comm_hook: str = "none"
    powersgd_rank: int = 1
    powersgd_start_iter: int = 2


@dataclass
class DDPOverlapConfig(ReducerConfig):
    """:class:`lightning_par.strategies.DDPOverlapStrategy` options."""

    name: str = "ddp_overlap"
    static_graph: bool = False


@dataclass
class TensorParallelConfig(ReducerConfig):
    """:class:`lightning_par.strategies.TensorParallelStrategy` options (tp_size/dp_size come from ``parallel``)."""

    name: str = "tensor_parallel"
    sequence_parallel: bool = False
    #: a user plan: module path (relative to the LightningModule) -> style name; None uses the model's own plan.
    plan: Optional[dict[str, str]] = None
    static_graph: bool = False


@dataclass
class ZeroConfig(StrategyConfig):
    """:class:`lightning_par.strategies.ZeroStrategy` options; the registry name (``zero1``/``zero2``/``zero3``) sets
    the stage."""

    name: str = "zero3"
    #: stage 3 only, needs an accelerator: keep the shards in CPU memory and step there.
    cpu_offload: bool = False
    #: None, a dtype name ("bf16", "fp16") or {"param_dtype": ..., "reduce_dtype": ...}.
    mixed_precision: Any = None
    #: stage 3: free gathered parameters after each block's forward.
    reshard_after_forward: bool = True
    #: stages 1 and 2 (None: 25 MiB); must stay None at stage 3.
    bucket_cap_mb: Optional[float] = None
    #: stage 1 reducer options (as ddp_overlap).
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    comm_hook: str = "none"


@dataclass
class PipelineConfig(ReducerConfig):
    """:class:`lightning_par.strategies.PipelineStrategy` options (pp_size/dp_size come from ``parallel``)."""

    name: str = "gpipe"
    #: gpipe | 1f1b | interleaved_1f1b
    schedule: str = "gpipe"
    num_microbatches: int = 4
    #: chunks per rank for interleaved_1f1b (None: 2 for interleaved, 1 otherwise).
    virtual_stages: Optional[int] = None
    #: params | time | size | [layers per (virtual) stage]
    split: Any = "params"
    measure_bubble: bool = True


@dataclass
class Parallel3DConfig(ReducerConfig):
    """:class:`lightning_par.strategies.Parallel3DStrategy` options (the three sizes come from ``parallel``)."""

    name: str = "parallel_3d"
    #: ddp | zero1 | zero2 | zero3
    dp_mode: str = "ddp"
    sequence_parallel: bool = False
    #: a user TP plan, relative to the network (``.model``); None uses the reference GPT's.
    plan: Optional[dict[str, str]] = None
    schedule: str = "1f1b"
    num_microbatches: int = 4
    virtual_stages: Optional[int] = None
    split: Any = "params"
    reshard_after_forward: bool = True
    #: zero modes only: None, "bf16", "fp16".
    mixed_precision: Optional[str] = None
    measure_bubble: bool = True


#: The GPT factory that model entries with the reference GPT instantiate.
GPT_TARGET = "lightning_par.config.build.gpt_lightning_module"
#: The byte-corpus data module that the corpus entries instantiate.
BYTE_CORPUS_TARGET = "lightning_par.data.ByteCorpusDataModule"


@dataclass
class GPTModelConfig:
    """The reference GPT (``model=tiny|small|gpt2|gpt2-medium``): a preset plus optional overrides, and its optimiser.

    Built with ``hydra.utils.instantiate`` like any other ``model`` entry: ``_target_`` is
    :func:`lightning_par.config.build.gpt_lightning_module`.
    """

    _target_: str = GPT_TARGET
    preset: str = "small"
    n_layer: Optional[int] = None
    n_head: Optional[int] = None
    n_embd: Optional[int] = None
    block_size: Optional[int] = None
    vocab_size: int = 256
    dropout: float = 0.0
    bias: bool = True
    learning_rate: float = 1e-3
    weight_decay: float = 0.1
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    adam_eps: float = 1e-8
    #: optimizer step where the cosine schedule ends; the trainer's ``max_steps`` by default.
    max_steps: Optional[int] = II("trainer.max_steps")


#: Kept for code that imports the old name: the reference GPT's schema.
ModelConfig = GPTModelConfig


@dataclass
class CustomModelConfig:
    """Any LightningModule: ``model=custom model._target_=my_pkg.MyModule +model.hidden=512``.

    Open: every key added with ``+model.KEY=VALUE`` is passed to ``_target_`` as a keyword argument (nested entries
    with their own ``_target_`` are instantiated too). The module brings its tensor-parallel plan and pipeline split
    through the model contract (``tp_plan()``, ``pipeline_layers()``; README "Bring your own model").
    """

    _target_: str = MISSING


@dataclass
class ByteCorpusDataConfig:
    """Byte-level text: the interpreter's standard library by default, or ``path`` (a file or directory)."""

    _target_: str = BYTE_CORPUS_TARGET
    path: Optional[str] = None
    synthetic: bool = False
    #: tokens per sample; None takes the model's ``block_size`` (``module.config.block_size`` or ``module.block_size``).
    block_size: Optional[int] = None
    #: micro-batch per data-parallel replica, in sequences.
    batch_size: int = 16
    num_workers: int = 0
    #: validation batches per replica at each validation.
    val_batches: int = 20
    cache_dir: Optional[str] = None
    seed: int = II("seed")


#: Kept for code that imports the old name: the byte corpus's schema.
DataConfig = ByteCorpusDataConfig


@dataclass
class CustomDataConfig:
    """Any LightningDataModule: ``data=custom data._target_=my_pkg.MyData +data.batch_size=8`` (open, as
    :class:`CustomModelConfig`)."""

    _target_: str = MISSING


@dataclass
class CSVLoggerConfig:
    """Lightning's ``CSVLogger``; ``save_dir: null`` writes into the run directory."""

    _target_: str = "lightning.pytorch.loggers.CSVLogger"
    save_dir: Optional[str] = None
    name: str = "logs"
    version: Any = ""
    #: False: skip this logger with a warning when its package is missing, instead of failing.
    required: bool = True


@dataclass
class TensorBoardLoggerConfig:
    """Lightning's ``TensorBoardLogger`` (needs ``tensorboard`` or ``tensorboardX``; skipped with a warning when
    neither is installed, unless ``required: true``)."""

    _target_: str = "lightning.pytorch.loggers.TensorBoardLogger"
    save_dir: Optional[str] = None
    name: str = "tb"
    version: Any = ""
    required: bool = False


@dataclass
class WandbLoggerConfig:
    """Lightning's ``WandbLogger`` (extra: ``pip install 'lightning-par[wandb]'``); more ``wandb.init`` arguments
    with ``+logger.wandb.KEY=VALUE``."""

    _target_: str = "lightning.pytorch.loggers.WandbLogger"
    save_dir: Optional[str] = None
    project: Optional[str] = "lightning_par"
    name: Optional[str] = None
    offline: bool = False
    log_model: Any = False
    required: bool = True


@dataclass
class MLFlowLoggerConfig:
    """Lightning's ``MLFlowLogger`` (extra: ``pip install 'lightning-par[mlflow]'``); ``tracking_uri: null`` uses
    ``$MLFLOW_TRACKING_URI`` or a local ``./mlruns`` store."""

    _target_: str = "lightning.pytorch.loggers.MLFlowLogger"
    experiment_name: str = "lightning_par"
    run_name: Optional[str] = None
    tracking_uri: Optional[str] = None
    save_dir: Optional[str] = "./mlruns"
    log_model: Any = False
    required: bool = True


#: Schema of each ``logger`` group entry; ``conf/logger/<name>.yaml`` extends ``schema_<name>``.
LOGGER_SCHEMAS: dict[str, type] = {
    "csv": CSVLoggerConfig,
    "tensorboard": TensorBoardLoggerConfig,
    "wandb": WandbLoggerConfig,
    "mlflow": MLFlowLoggerConfig,
}


@dataclass
class TrainerConfig:
    """Lightning ``Trainer`` settings used by the recipes.

    Every key is passed to ``lightning.Trainer`` except those in :data:`TRAINER_RECIPE_KEYS`, which the recipe uses
    itself. Another ``Trainer`` argument can be added with ``+trainer.KEY=VALUE`` (e.g. ``+trainer.limit_val_batches=2``);
    a key that is neither is refused before any process starts
    (:func:`lightning_par.config.build.build_trainer_kwargs`).
    """

    accelerator: str = "auto"
    #: machines; None: from the environment (SLURM ``SLURM_NNODES``, torchrun ``WORLD_SIZE // LOCAL_WORLD_SIZE``), else 1.
    num_nodes: Optional[int] = None
    #: processes (devices) per machine; None: ``parallel.world_size // num_nodes``.
    devices: Optional[int] = None
    precision: str = "32-true"
    max_steps: int = 400
    val_check_interval: int = 100
    log_every_n_steps: int = 10
    accumulate_grad_batches: int = 1
    gradient_clip_val: Optional[float] = 1.0
    enable_progress_bar: bool = True
    #: FLOP/s of one device at the training dtype, for MFU; None looks it up on GPUs (none on CPU).
    peak_flops_per_device: Optional[float] = None
    #: save a checkpoint at the end (and every ``val_check_interval`` steps).
    checkpoint: bool = True
    #: wall-clock limit of the whole multi-process job, in seconds.
    job_timeout_s: float = 3600.0


#: ``trainer.*`` keys the recipe uses itself; every other ``trainer`` key is a ``lightning.Trainer`` argument.
TRAINER_RECIPE_KEYS: frozenset[str] = frozenset({"peak_flops_per_device", "checkpoint", "job_timeout_s"})


@dataclass
class RunConfig:
    """The root config: one option per group, plus run-wide settings."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    strategy: Any = field(default_factory=StrategyConfig)
    #: a ``model`` group entry: the reference GPT (``tiny``, ``small``, ...) or ``custom`` (any ``_target_``).
    model: Any = MISSING
    #: a ``data`` group entry: a byte corpus (``stdlib``, ``synthetic``) or ``custom`` (any ``_target_``).
    data: Any = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    #: the ``logger`` group: logger name -> a Lightning logger config with ``_target_`` (empty: no logger).
    logger: dict[str, Any] = field(default_factory=dict)
    seed: int = 1234


#: Schema of each strategy registry name; a strategy YAML extends ``schema_<name>``.
STRATEGY_SCHEMAS: dict[str, type[StrategyConfig]] = {
    "ddp_overlap": DDPOverlapConfig,
    "tensor_parallel": TensorParallelConfig,
    "zero1": ZeroConfig,
    "zero2": ZeroConfig,
    "zero3": ZeroConfig,
    "gpipe": PipelineConfig,
    "1f1b": PipelineConfig,
    "parallel_3d": Parallel3DConfig,
}


def register_configs(cs: ConfigStore | None = None) -> None:
    """Store every schema in Hydra's ConfigStore (call before composing)."""
    cs = cs or ConfigStore.instance()
    cs.store(name="schema_run", node=RunConfig)
    cs.store(group="parallel", name="schema_parallel", node=ParallelConfig)
    cs.store(group="model", name="schema_gpt", node=GPTModelConfig)
    cs.store(group="model", name="schema_custom", node=CustomModelConfig)
    cs.store(group="data", name="schema_byte_corpus", node=ByteCorpusDataConfig)
    cs.store(group="data", name="schema_custom", node=CustomDataConfig)
    for name, schema in LOGGER_SCHEMAS.items():
        cs.store(group="logger", name=f"schema_{name}", node=schema)
    cs.store(group="trainer", name="schema_trainer", node=TrainerConfig)
    for name, schema in STRATEGY_SCHEMAS.items():
        cs.store(group="strategy", name=f"schema_{name}", node=schema)
