"""Structured-config schemas for the Hydra recipes: a bad override fails when the config is composed.

Each config group under ``conf/`` (``parallel``, ``strategy``, ``model``, ``data``, ``trainer``) has a dataclass here,
stored in Hydra's ConfigStore as ``<group>/schema_<name>`` so that the YAML options extend it
(``defaults: [schema_ddp_overlap, _self_]``). A type error (``parallel.dp_size=two``) or an unknown key is then
reported by OmegaConf at compose time; an unknown option of a group (``strategy=foo``) by Hydra, which lists the
options it has.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore

__all__ = [
    "DataConfig",
    "PipelineGroup",
    "ReducerGroup",
    "TensorParallelGroup",
    "ZeroGroup",
    "DDPOverlapConfig",
    "ModelConfig",
    "Parallel3DConfig",
    "ParallelConfig",
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
class ReducerGroup:
    """``strategy.reducer``: the dp axis's bucketed gradient reducer (:class:`lightning_par.data_parallel.options.
    ReducerOptions`)."""

    #: bucket size in MiB (None: 25; ZeRO-1/2 also bucket their all-gather and reduce-scatter with it; unset at zero3).
    bucket_cap_mb: Optional[float] = None
    #: gradients as views of the buckets (None: True for ZeRO modes, False for ddp).
    gradient_as_bucket_view: Optional[bool] = None
    static_graph: bool = False
    #: none | fp16 | bf16 | powersgd (ddp and zero1).
    comm_hook: str = "none"
    powersgd_rank: int = 1
    powersgd_start_iter: int = 2


@dataclass
class ZeroGroup:
    """``strategy.zero``: ZeRO's options (the stage comes from the strategy name or ``dp_mode``)."""

    #: stage 3 only, needs an accelerator: keep the shards in CPU memory and step there.
    cpu_offload: bool = False
    #: None, a dtype name ("bf16", "fp16") or {"param_dtype": ..., "reduce_dtype": ...}.
    mixed_precision: Any = None
    #: stage 3: free gathered parameters after each block's forward.
    reshard_after_forward: bool = True


@dataclass
class TensorParallelGroup:
    """``strategy.tensor_parallel``: the tp axis's options."""

    sequence_parallel: bool = False
    #: module path (relative to the network) -> style name; None uses the model's own tp_plan().
    plan: Optional[dict[str, str]] = None


@dataclass
class PipelineGroup:
    """``strategy.pipeline``: the pp axis's options (:class:`lightning_par.pipeline_parallel.options.
    PipelineOptions`)."""

    #: gpipe | 1f1b | interleaved_1f1b | interleaved_zero_bubble | zbv_zero_bubble | dualpipev
    schedule: str = "1f1b"
    num_microbatches: int = 4
    #: model chunks per rank (None: 2 for interleaved and V schedules, else 1).
    virtual_stages: Optional[int] = None
    #: params | time | size | [layers per virtual stage]
    split: Any = "params"
    split_timeout_s: float = 1.0
    measure_bubble: bool = True


@dataclass
class StrategyConfig:
    """Fields every strategy accepts; ``name`` is the Lightning registry name. The sizes come from ``parallel``."""

    name: str = "ddp_overlap"
    #: seconds a collective may wait for a peer before it raises (a dead rank ends the job, never hangs it).
    timeout_s: float = 1800.0
    #: attribute of the LightningModule holding the network (see lightning_par.contract).
    module_attr: Optional[str] = "model"
    #: also show the strategy's own figures (parallel/...) in the progress bar.
    prog_bar: bool = False


@dataclass
class DDPOverlapConfig(StrategyConfig):
    """:class:`lightning_par.strategies.DDPOverlapStrategy`."""

    name: str = "ddp_overlap"
    reducer: ReducerGroup = field(default_factory=ReducerGroup)


@dataclass
class ZeroConfig(StrategyConfig):
    """:class:`lightning_par.strategies.ZeroStrategy`; the name (``zero1``/``zero2``/``zero3``) sets the stage."""

    name: str = "zero3"
    zero: ZeroGroup = field(default_factory=ZeroGroup)
    reducer: ReducerGroup = field(default_factory=ReducerGroup)


@dataclass
class TensorParallelConfig(StrategyConfig):
    """:class:`lightning_par.strategies.TensorParallelStrategy`."""

    name: str = "tensor_parallel"
    tensor_parallel: TensorParallelGroup = field(default_factory=TensorParallelGroup)
    reducer: ReducerGroup = field(default_factory=ReducerGroup)


@dataclass
class PipelineConfig(StrategyConfig):
    """:class:`lightning_par.strategies.PipelineStrategy` (``gpipe`` and ``1f1b`` fix the schedule; ``pipeline``
    takes any)."""

    name: str = "pipeline"
    pipeline: PipelineGroup = field(default_factory=PipelineGroup)
    reducer: ReducerGroup = field(default_factory=ReducerGroup)


@dataclass
class Parallel3DConfig(StrategyConfig):
    """:class:`lightning_par.strategies.Parallel3DStrategy`: every axis, every group."""

    name: str = "parallel_3d"
    #: ddp | zero1 | zero2 | zero3
    dp_mode: str = "ddp"
    reducer: ReducerGroup = field(default_factory=ReducerGroup)
    zero: ZeroGroup = field(default_factory=ZeroGroup)
    tensor_parallel: TensorParallelGroup = field(default_factory=TensorParallelGroup)
    pipeline: PipelineGroup = field(default_factory=PipelineGroup)


@dataclass
class ModelConfig:
    """The reference GPT: a preset plus optional overrides, and its optimiser."""

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


@dataclass
class DataConfig:
    """Byte-level text: the interpreter's standard library by default, or ``path`` (a file or directory)."""

    path: Optional[str] = None
    synthetic: bool = False
    #: micro-batch per data-parallel replica, in sequences.
    batch_size: int = 16
    num_workers: int = 0
    #: validation batches per replica at each validation.
    val_batches: int = 20
    cache_dir: Optional[str] = None


@dataclass
class TrainerConfig:
    """Lightning ``Trainer`` settings used by the recipes."""

    accelerator: str = "auto"
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


@dataclass
class RunConfig:
    """The root config: one option per group, plus run-wide settings."""

    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    strategy: Any = field(default_factory=StrategyConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
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
    "pipeline": PipelineConfig,
    "parallel_3d": Parallel3DConfig,
}


def register_configs(cs: ConfigStore | None = None) -> None:
    """Store every schema in Hydra's ConfigStore (call before composing)."""
    cs = cs or ConfigStore.instance()
    cs.store(name="schema_run", node=RunConfig)
    cs.store(group="parallel", name="schema_parallel", node=ParallelConfig)
    cs.store(group="model", name="schema_model", node=ModelConfig)
    cs.store(group="data", name="schema_data", node=DataConfig)
    cs.store(group="trainer", name="schema_trainer", node=TrainerConfig)
    for name, schema in STRATEGY_SCHEMAS.items():
        cs.store(group="strategy", name=f"schema_{name}", node=schema)
