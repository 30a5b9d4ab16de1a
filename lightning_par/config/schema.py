"""Structured-config schemas for the Hydra recipes: a bad override fails when the config is composed.

Each config group under ``conf/`` (``parallel``, ``strategy``, ``model``, ``data``, ``trainer``, ``logger``) has a
dataclass per kind of entry here, stored in Hydra's ConfigStore as ``<group>/schema_<name>`` so that the YAML options
extend it (``defaults: [schema_ddp_overlap, _self_]``). A type error (``parallel.dp_size=two``) or an unknown key is
then reported by OmegaConf at compose time; an unknown option of a group (``strategy=foo``) by Hydra, which lists the
options it has.

Each option is declared once: the strategy option groups (``strategy.reducer``, ``.zero``, ``.tensor_parallel``,
``.pipeline``, ``.context_parallel``, ``.compile``, ``.float8``, ``.fault_tolerance``) *are* the options dataclasses
of their axes (frozen dataclasses that validate themselves; their nodes are stored writable so that overrides merge),
and the fields every strategy accepts take their defaults from ``MeshStrategy``'s constructor. The YAML options under
``conf/strategy/`` set only what makes the preset (``tests/config/test_option_defaults.py`` checks both).

``model``, ``data`` and ``logger`` entries carry a ``_target_`` and are built with ``hydra.utils.instantiate``: our
entries (the reference GPT, the byte corpora, Lightning's loggers) have closed schemas, ``model=custom`` and
``data=custom`` an open one for any user class.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import typing

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from omegaconf import II, MISSING, OmegaConf

from hydra.core.config_store import ConfigStore

from lightning_par.compile import CompileOptions
from lightning_par.context_parallel.options import ContextParallelOptions
from lightning_par.fault_tolerance.options import FaultToleranceOptions
from lightning_par.data_parallel.options import ReducerOptions, ZeroGroupOptions
from lightning_par.fault.preemption import PREEMPTION_SIGNALS
from lightning_par.float8 import Float8Options
from lightning_par.parallel_dims import ParallelDims
from lightning_par.pipeline_parallel.options import PipelineOptions
from lightning_par.strategies import MeshStrategy, Parallel3DStrategy
from lightning_par.tensor_parallel.options import TensorParallelOptions

__all__ = [
    "BYTE_CORPUS_TARGET",
    "ByteCorpusDataConfig",
    "CSVLoggerConfig",
    "CustomDataConfig",
    "CustomModelConfig",
    "DataConfig",
    "DevicePreset",
    "FitCheckConfig",
    "LRScalingConfig",
    "CompileGroup",
    "ContextParallelGroup",
    "Float8Group",
    "PipelineGroup",
    "ReducerGroup",
    "TensorParallelGroup",
    "ZeroGroup",
    "GPT_TARGET",
    "GPTModelConfig",
    "HFModelConfig",
    "LOGGER_SCHEMAS",
    "MLFlowLoggerConfig",
    "TensorBoardLoggerConfig",
    "TRAINER_RECIPE_KEYS",
    "WandbLoggerConfig",
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
    "check_run_config",
    "register_configs",
]


#: The ``parallel`` group's schema is :class:`lightning_par.ParallelDims` itself (the sizes, their defaults and their
#: checks, declared once); the name is kept for code that imports it.
ParallelConfig = ParallelDims


@dataclass(frozen=True)
class ReducerGroup(ReducerOptions):
    """``strategy.reducer``: :class:`~lightning_par.data_parallel.options.ReducerOptions` itself, but for one default:
    ``bucket_cap_mb`` is unset here (None, which ReducerOptions documents as its 25 MiB), because ``zero3`` has no
    buckets and refuses any value, so a preset must be able to leave it out."""

    bucket_cap_mb: Optional[float] = None


#: The option groups' Hydra schemas are their options dataclasses (each option declared once, with its default, in
#: its own axis's folder); these names are kept for code that imports them.
ZeroGroup = ZeroGroupOptions
TensorParallelGroup = TensorParallelOptions
PipelineGroup = PipelineOptions
ContextParallelGroup = ContextParallelOptions
CompileGroup = CompileOptions
Float8Group = Float8Options
FaultToleranceGroup = FaultToleranceOptions

def signature_defaults(function: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """The defaults of ``names`` in ``function``'s signature (the constructor that is their one source).

    Raises:
        ValueError: a name that is not a parameter of ``function`` with a default.
    """
    params = inspect.signature(function).parameters
    missing = [k for k in names if k not in params or params[k].default is inspect.Parameter.empty]
    if missing:
        raise ValueError(f"{missing[0]!r} is not valid for {function.__qualname__}: expected a parameter with a default.")
    return {k: params[k].default for k in names}


#: ``MeshStrategy``'s own keywords, with their defaults (the constructor is their source).
_STRATEGY_DEFAULTS: dict[str, Any] = signature_defaults(
    MeshStrategy.__init__, ("timeout_s", "module_attr", "activation_checkpointing", "prog_bar")
)


@dataclass
class StrategyConfig:
    """Fields every strategy accepts; ``name`` is the Lightning registry name. The sizes come from ``parallel``; the
    defaults are :class:`lightning_par.strategies.MeshStrategy`'s."""

    name: str = "ddp_overlap"
    #: seconds a collective may wait for a peer before it raises (a dead rank ends the job, never hangs it).
    timeout_s: float = _STRATEGY_DEFAULTS["timeout_s"]
    #: attribute of the LightningModule holding the network (see lightning_par.contract).
    module_attr: Optional[str] = _STRATEGY_DEFAULTS["module_attr"]
    #: none | full (recompute every block in backward) | selective (the attention of every block).
    activation_checkpointing: str = _STRATEGY_DEFAULTS["activation_checkpointing"]
    #: also show the strategy's own figures (parallel/...) in the progress bar.
    prog_bar: bool = _STRATEGY_DEFAULTS["prog_bar"]
    #: torch.compile of every block (docs/compile.md), in every strategy.
    compile: CompileGroup = field(default_factory=CompileGroup)
    #: float8 training of the selected nn.Linear layers (torchao; the ``float8`` extra).
    float8: Float8Group = field(default_factory=Float8Group)


@dataclass
class DDPOverlapConfig(StrategyConfig):
    """:class:`lightning_par.strategies.DDPOverlapStrategy`."""

    name: str = "ddp_overlap"
    reducer: ReducerGroup = field(default_factory=ReducerGroup)
    fault_tolerance: FaultToleranceGroup = field(default_factory=FaultToleranceGroup)


@dataclass
class ZeroConfig(StrategyConfig):
    """:class:`lightning_par.strategies.ZeroStrategy`; the name (``zero1``/``zero2``/``zero3``) sets the stage."""

    name: str = "zero3"
    zero: ZeroGroup = field(default_factory=ZeroGroup)
    reducer: ReducerGroup = field(default_factory=ReducerGroup)
    fault_tolerance: FaultToleranceGroup = field(default_factory=FaultToleranceGroup)


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
    dp_mode: str = signature_defaults(Parallel3DStrategy.__init__, ("dp_mode",))["dp_mode"]
    reducer: ReducerGroup = field(default_factory=ReducerGroup)
    fault_tolerance: FaultToleranceGroup = field(default_factory=FaultToleranceGroup)
    zero: ZeroGroup = field(default_factory=ZeroGroup)
    tensor_parallel: TensorParallelGroup = field(default_factory=TensorParallelGroup)
    pipeline: PipelineGroup = field(default_factory=PipelineGroup)
    context_parallel: ContextParallelGroup = field(default_factory=ContextParallelGroup)


#: The GPT factory that model entries with the reference GPT instantiate.
GPT_TARGET = "lightning_par.config.build.gpt_lightning_module"
#: The byte-corpus data module that the corpus entries instantiate.
BYTE_CORPUS_TARGET = "lightning_par.data.ByteCorpusDataModule"


def _optimizer_keywords_schema() -> type:
    """A dataclass of every registered optimizer's keywords (``muon_lr``, ...), typed and defaulted by the optimizer's
    options dataclass (their one declaration, :mod:`lightning_par.optim.registry`): the base of the model schemas
    whose modules take them, so that a new optimizer's keywords compose without an edit here."""
    from lightning_par.optim.registry import OPTIMIZERS, optimizer_entry

    spec = []
    for name, _ in OPTIMIZERS:
        options = optimizer_entry(name).options
        hints = typing.get_type_hints(options)
        spec += [(f"{name}_{f.name}", hints[f.name], field(default=f.default)) for f in dataclasses.fields(options)]
    return dataclasses.make_dataclass("OptimizerKeywordsConfig", spec, namespace={"__module__": __name__})


#: The registered optimizers' keywords (``model.muon_lr=0.01``), a base of :class:`GPTModelConfig` and
#: :class:`HFModelConfig`.
OptimizerKeywordsConfig = _optimizer_keywords_schema()


@dataclass
class GPTModelConfig(OptimizerKeywordsConfig):
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
    #: mixture of experts (null: the preset's): experts per MoE block (0: dense), every n-th block MoE, top-k (1|2),
    #: expert width, gating (softmax|sigmoid), a shared expert, capacity factor (null: dropless), loss weights.
    num_experts: Optional[int] = None
    moe_every: Optional[int] = None
    moe_top_k: Optional[int] = None
    moe_hidden: Optional[int] = None
    moe_gating: Optional[str] = None
    moe_shared_expert: Optional[bool] = None
    moe_capacity_factor: Optional[float] = None
    moe_aux_loss_coeff: Optional[float] = None
    moe_z_loss_coeff: Optional[float] = None
    #: load balancing: aux_loss | bias (DeepSeek-V3's auxiliary-loss-free bias) | both; the bias's rate per step.
    moe_balance: Optional[str] = None
    moe_bias_update_rate: Optional[float] = None
    #: the experts' form: auto | grouped_mm | bmm | loop (lightning_par/expert_parallel/grouped.py).
    moe_experts_form: Optional[str] = None
    #: ``adamw`` or a registered optimizer, e.g. ``muon`` (Muon on the hidden matrices, AdamW at ``learning_rate``
    #: on the rest: docs/muon.md); its keywords (``muon_lr``, ...) come from :class:`OptimizerKeywordsConfig`.
    optimizer: str = "adamw"


#: Kept for code that imports the old name: the reference GPT's schema.
ModelConfig = GPTModelConfig


@dataclass
class CustomModelConfig:
    """Any LightningModule: ``model=custom model._target_=my_pkg.MyModule +model.hidden=512``.

    Open: every key added with ``+model.KEY=VALUE`` is passed to ``_target_`` as a keyword argument (nested entries
    with their own ``_target_`` are instantiated too). The module brings its tensor-parallel plan and pipeline split
    through the model contract (``tp_plan()``, ``pipeline_layers()``; docs/your-model.md).
    """

    _target_: str = MISSING


#: The Hugging Face causal LM factory that ``model=hf`` instantiates.
HF_TARGET = "lightning_par.hf.module.recipe_model"
#: The resolver ``model=hf`` uses: ``${lp_unless:${.pretrained},llama}`` is ``llama`` unless ``pretrained`` is set.
UNLESS_RESOLVER = "lp_unless"


@dataclass
class HFLoraConfig:
    """LoRA fine-tuning of a ``model=hf`` model (:mod:`lightning_par.hf.lora`, docs/lora.md):
    ``model.lora.r=16 model.lora.target_modules=[q_proj,v_proj]``. Needs ``pip install 'lightning-par[lora]'``."""

    #: the adapters' rank; 0: no LoRA (the whole model trains).
    r: int = 0
    #: LoRA's scaling numerator (scaling ``alpha / r``); null: ``2 * r``.
    alpha: Optional[float] = None
    #: dropout on the adapters' input.
    dropout: float = 0.0
    #: names of the ``nn.Linear`` layers that get adapters.
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    #: checkpoints hold the adapters only (the frozen base comes from ``pretrained`` or the seeded build).
    adapter_only_checkpoint: bool = True
    #: QLoRA's quantized base: ``nf4`` (the base's linear weights as torchao NF4 tensors, bf16 compute; one process,
    #: ddp_overlap, zero2, zero3 and HSDP), or null.
    quantize_base: Optional[str] = None


@dataclass
class HFModelConfig(OptimizerKeywordsConfig):
    """A Hugging Face causal LM (``model=hf``, :class:`lightning_par.hf.HFCausalLM`): a ``model_type`` built with
    random weights, or a local ``pretrained`` directory (never downloaded); exactly one of the two.

    ``python recipes/train.py model=hf model.model_type=qwen3 +model.config.hidden_size=64`` or
    ``model=hf model.pretrained=DIR``. Its parallelism comes from the model's own plans (lightning_par.hf.adapter).
    """

    _target_: str = HF_TARGET
    #: a transformers model type (llama, qwen2, qwen3, mistral, qwen3_moe, mixtral...); conf/model/hf.yaml makes it
    #: ``llama`` unless ``pretrained`` is set.
    model_type: Optional[str] = None
    #: a local directory written by ``save_pretrained`` (config.json and safetensors).
    pretrained: Optional[str] = None
    #: config fields overriding ``base_config`` (with ``model_type``) or the directory's config.json
    #: (``+model.config.hidden_size=64``).
    config: dict[str, Any] = field(default_factory=dict)
    #: config fields of a ``model_type`` build under ``config``: a tiny model in conf/model/hf.yaml (vocab 256, as the
    #: byte corpora); ignored with ``pretrained``.
    base_config: dict[str, Any] = field(default_factory=dict)
    #: ``adamw``, ``sgd`` (with ``momentum``) or a registered optimizer, e.g. ``muon`` (Muon at ``muon_lr`` on the
    #: hidden matrices, AdamW at ``learning_rate`` on the rest: docs/muon.md; keywords from the base class).
    optimizer: str = "adamw"
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.9
    adam_eps: float = 1e-8
    #: LoRA adapters on a frozen base (``model.lora.r=16``; docs/lora.md).
    lora: HFLoraConfig = field(default_factory=HFLoraConfig)
    #: ``null`` or ``bias``: DeepSeek-V3's auxiliary-loss-free balancing of the routers' ``e_score_correction_bias``
    #: (deepseek_v3), moved by ``moe_bias_update_rate * sign(mean load - load)`` after every optimizer step.
    moe_balance: Optional[str] = None
    moe_bias_update_rate: float = 1e-3


@dataclass
class ByteCorpusDataConfig:
    """Text: the interpreter's standard library by default, or ``path`` (a file or directory); byte tokens, or a
    local tokenizer's (``tokenizer``)."""

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
    #: a local Hugging Face tokenizer directory (``tokenizer.json``, or what ``AutoTokenizer`` reads offline): the
    #: corpus is tokenized once into the token cache, and the model's vocabulary must hold the tokenizer's; null:
    #: one token per byte.
    tokenizer: Optional[str] = None


#: Kept for code that imports the old name: the byte corpus's schema.
DataConfig = ByteCorpusDataConfig


@dataclass
class CustomDataConfig:
    """Any LightningDataModule: ``data=custom data._target_=my_pkg.MyData +data.batch_size=8`` (open, as
    :class:`CustomModelConfig`)."""

    _target_: str = MISSING


@dataclass
class DocumentDataConfig:
    """Your documents (:mod:`lightning_par.data.datasets`): JSONL / Parquet / text files through Hugging Face
    ``datasets``, or a ``litdata.optimize`` output; tokenized once into the cache, packed whole into blocks with
    attention masked per document (``packing: documents``) or cut into windows across them (``concat``)."""

    _target_: str = "lightning_par.data.DocumentDataModule"
    #: json (JSON Lines or a JSON array), parquet, text (one document per file) or litdata
    source: str = "json"
    #: a file, a directory or a glob; litdata: the optimize output directory
    path: Optional[str] = None
    text_field: str = "text"
    #: a field holding a chat (list of {"role", "content"}), rendered by the tokenizer's chat template
    messages_field: Optional[str] = None
    #: a local Hugging Face tokenizer directory; null: one token per byte
    tokenizer: Optional[str] = None
    #: tokens per block; None takes the model's ``block_size``
    block_size: Optional[int] = None
    batch_size: int = 16
    #: documents (whole documents per block, document-masked attention) or concat (windows across documents)
    packing: str = "documents"
    #: documents longer than a block: split, truncate or error
    long_documents: str = "split"
    buffer_blocks: int = 64
    val_every: int = 20
    val_batches: Optional[int] = 20
    num_workers: int = 0
    seed: int = II("seed")
    cache_dir: Optional[str] = None


@dataclass
class CSVLoggerConfig:
    """Lightning's ``CSVLogger``; ``save_dir: null`` writes into the run directory."""

    _target_: str = "lightning.pytorch.loggers.CSVLogger"
    save_dir: Optional[str] = None
    name: str = "logs"
    version: Any = ""
    #: write at every logged step (Lightning's default, every 100 steps, loses them when a rank is killed).
    flush_logs_every_n_steps: int = 1
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


#: Precision strings Lightning's ``Trainer(precision=...)`` accepts.
PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "64-true", "transformer-engine",
              "transformer-engine-float16")
#: Accelerators the recipes run on.
ACCELERATORS = ("auto", "cpu", "gpu", "cuda")
#: What the run does about a non-finite loss or gradient (:class:`lightning_par.fault.NonFiniteGuard`).
NONFINITE_ACTIONS = ("stop", "skip")
_UINT32_MAX = 2**32 - 1


def _invalid(field_name: str, value: Any, valid: str) -> ValueError:
    return ValueError(f"{field_name}={value!r} is not valid: expected {valid}.")


def _int_at_least(field_name: str, value: Any, minimum: int, none_ok: bool = False, extra: str = "") -> None:
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _invalid(field_name, value, f"an integer >= {minimum}" + (" or null" if none_ok else "") + extra)


def _seconds(field_name: str, value: Any, none_ok: bool) -> None:
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise _invalid(field_name, value, "a number of seconds > 0" + (" or null (no limit)" if none_ok else ""))


@dataclass
class TrainerConfig:
    """Lightning ``Trainer`` settings used by the recipes, and the run's reliability settings.

    Every key is passed to ``lightning.Trainer`` except those in :data:`TRAINER_RECIPE_KEYS`, which the recipe uses
    itself. Another ``Trainer`` argument can be added with ``+trainer.KEY=VALUE`` (e.g. ``+trainer.limit_val_batches=2``);
    a key that is neither is refused before any process starts
    (:func:`lightning_par.config.build.build_trainer_kwargs`). Checked when built (``__post_init__``, called by
    :func:`check_run_config` before any process starts).

    Raises:
        ValueError: a field out of range, naming ``trainer.<field>``, the value and what is valid.
    """

    accelerator: str = "auto"
    #: machines; None: from the environment (SLURM ``SLURM_NNODES``, torchrun ``WORLD_SIZE // LOCAL_WORLD_SIZE``), else 1.
    num_nodes: Optional[int] = None
    #: processes (devices) per machine; None: ``parallel.world_size // num_nodes``.
    devices: Optional[int] = None
    precision: str = "32-true"
    #: optimizer steps to train (>= 1: a run without end is not supported, it could never finish).
    max_steps: int = 400
    #: validate every this many training batches.
    val_check_interval: int = 100
    log_every_n_steps: int = 10
    accumulate_grad_batches: int = 1
    #: clip the gradient norm (of the whole model) to this; null or 0: no clipping.
    gradient_clip_val: Optional[float] = 1.0
    enable_progress_bar: bool = True
    #: FLOP/s of one device at the training dtype, for MFU; None looks it up on GPUs (none on CPU).
    peak_flops_per_device: Optional[float] = None
    #: write checkpoints (into ``<run dir>/checkpoints``).
    checkpoint: bool = True
    #: save a checkpoint every this many optimizer steps, independent of validation (and always at the end of the
    #: run); null: at the end only.
    checkpoint_every_n_steps: Optional[int] = 100
    #: step checkpoints kept on disk, the latest ones (``step-N.ckpt``); -1 keeps all.
    keep_last_k: int = 2
    #: write step checkpoints in the background (torch.distributed.checkpoint.async_save): a checkpoint counts (is
    #: resumed from) only once every rank's writes finished and its commit record is written.
    async_checkpoint: bool = False
    #: a non-finite loss or gradient: "stop" the run (before the step, nothing non-finite is saved) or "skip" the step
    #: on every rank (counted, logged as ``nonfinite_skipped``).
    on_nonfinite: str = "stop"
    #: with on_nonfinite=skip: stop after this many non-finite steps in a row.
    max_consecutive_skips: int = 10
    #: end the job when a rank makes no progress for this many seconds (a stopped or stuck rank); null: no watchdog.
    watchdog_s: Optional[float] = 300.0
    #: the watchdog's limit before a rank's first optimizer step (imports, data, process group, first step).
    watchdog_startup_s: float = 900.0
    #: wall-clock limit of the whole multi-process job, in seconds; null: no limit.
    job_timeout_s: Optional[float] = 3600.0
    #: the signal that asks for a checkpoint and an exit with code 75 ("preempted, resumable") at the next step
    #: boundary, on any rank or the launcher: "SIGTERM" or "SIGUSR1"; null: not handled (the signal's default).
    preemption_signal: Optional[str] = "SIGTERM"
    #: seconds from that signal to the exit: past it (or at a second signal) the job exits at once, keeping the last
    #: good checkpoint.
    preemption_grace_s: float = 60.0
    #: start more processes on this machine than it can run: on CPU more than 4 per core (os.sched_getaffinity), on
    #: GPUs more than its devices. false (default): such a parallel.world_size is refused before any process starts.
    allow_oversubscribe: bool = False

    def __post_init__(self) -> None:
        if self.accelerator not in ACCELERATORS:
            raise _invalid("trainer.accelerator", self.accelerator, f"one of {list(ACCELERATORS)}")
        if self.precision not in PRECISIONS:
            raise _invalid("trainer.precision", self.precision, f"one of {list(PRECISIONS)}")
        _int_at_least("trainer.max_steps", self.max_steps, 1, extra=" (-1, Lightning's \"no limit\", would never finish)")
        _int_at_least("trainer.val_check_interval", self.val_check_interval, 1, extra=" (training batches)")
        _int_at_least("trainer.log_every_n_steps", self.log_every_n_steps, 1)
        _int_at_least("trainer.accumulate_grad_batches", self.accumulate_grad_batches, 1)
        clip = self.gradient_clip_val
        if clip is not None and (
            isinstance(clip, bool) or not isinstance(clip, (int, float)) or not 0 <= clip < math.inf
        ):  # NaN and inf fail the comparison: Lightning would refuse them only inside the ranks
            raise _invalid("trainer.gradient_clip_val", clip, "a finite norm >= 0, or null (no clipping)")
        flops = self.peak_flops_per_device
        if flops is not None and (isinstance(flops, bool) or not isinstance(flops, (int, float)) or flops <= 0):
            raise _invalid("trainer.peak_flops_per_device", flops, "FLOP/s > 0, or null")
        _int_at_least("trainer.checkpoint_every_n_steps", self.checkpoint_every_n_steps, 1, none_ok=True)
        if self.keep_last_k != -1:
            _int_at_least("trainer.keep_last_k", self.keep_last_k, 1, extra=", or -1 (keep all)")
        if not isinstance(self.async_checkpoint, bool):
            raise _invalid("trainer.async_checkpoint", self.async_checkpoint, "true or false")
        if self.on_nonfinite not in NONFINITE_ACTIONS:
            raise _invalid("trainer.on_nonfinite", self.on_nonfinite, f"one of {list(NONFINITE_ACTIONS)}")
        _int_at_least("trainer.max_consecutive_skips", self.max_consecutive_skips, 1)
        _seconds("trainer.watchdog_s", self.watchdog_s, none_ok=True)
        _seconds("trainer.watchdog_startup_s", self.watchdog_startup_s, none_ok=False)
        _seconds("trainer.job_timeout_s", self.job_timeout_s, none_ok=True)
        if self.preemption_signal is not None and self.preemption_signal not in PREEMPTION_SIGNALS:
            raise _invalid("trainer.preemption_signal", self.preemption_signal,
                           f"one of {list(PREEMPTION_SIGNALS)}, or null (not handled)")
        _seconds("trainer.preemption_grace_s", self.preemption_grace_s, none_ok=False)
        if not isinstance(self.allow_oversubscribe, bool):
            raise _invalid("trainer.allow_oversubscribe", self.allow_oversubscribe, "true or false")


#: ``trainer.*`` keys the recipe uses itself; every other ``trainer`` key is a ``lightning.Trainer`` argument.
TRAINER_RECIPE_KEYS: frozenset[str] = frozenset({
    "peak_flops_per_device", "checkpoint", "job_timeout_s", "checkpoint_every_n_steps", "keep_last_k", "on_nonfinite",
    "max_consecutive_skips", "watchdog_s", "watchdog_startup_s", "async_checkpoint", "preemption_signal",
    "preemption_grace_s", "allow_oversubscribe",
})


@dataclass
class LRScalingConfig:
    """``lr_scaling``: the learning rate scaled with the global batch (Goyal et al. 2017), with a warm-up counted in
    samples (:class:`lightning_par.callbacks.LRScalingCallback`), for any model."""

    #: none | linear | sqrt: multiply the configured rate by 1, k or sqrt(k), k = global batch / reference_batch.
    rule: str = "none"
    #: samples per optimizer step the configured rate was tuned for; None: one replica's micro-batch (data.batch_size).
    reference_batch: Optional[int] = None
    #: samples of linear warm-up (0: none); the reference GPT's own model.warmup_steps must then be 0.
    warmup_samples: int = 0


#: The names of the planner's device presets (:data:`lightning_par.planner.devices.DEVICE_PRESETS`), written here so
#: that composing a config does not load the planner (tests/core/test_import_layers.py checks they are the same).
DEVICE_PRESET_NAMES: tuple[str, ...] = ("a100-40gb", "a100-80gb", "h100-80gb", "h200")

#: The planner's device presets as a config type: ``planner.device=h100-80gb`` is checked against them when the config
#: is composed (a ``str`` enum, so the value stays a plain string in JSON).
DevicePreset = Enum("DevicePreset", {name: name for name in DEVICE_PRESET_NAMES}, type=str, module=__name__)


@dataclass
class FitCheckConfig:
    """``planner``: "will it fit" before start (:func:`lightning_par.planner.fit.check_fit`). With a device, the
    recipe refuses a layout the planner predicts not to fit it, before any process starts, naming the largest memory
    terms and the nearest layout that fits."""

    #: a device preset (a100-40gb | a100-80gb | h100-80gb | h200); null: no check.
    device: Optional[DevicePreset] = None
    #: devices per node (ranks the nearest fitting layouts by predicted step time).
    devices_per_node: int = 8


@dataclass
class RunConfig:
    """The root config: one option per group, plus run-wide settings."""

    #: the layout (``conf/parallel/<name>.yaml``): :class:`lightning_par.ParallelDims`'s sizes.
    parallel: ParallelDims = field(default_factory=ParallelDims)
    strategy: Any = field(default_factory=StrategyConfig)
    #: a ``model`` group entry: the reference GPT (``tiny``, ``small``, ...) or ``custom`` (any ``_target_``).
    model: Any = MISSING
    #: a ``data`` group entry: a byte corpus (``stdlib``, ``synthetic``) or ``custom`` (any ``_target_``).
    data: Any = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    lr_scaling: LRScalingConfig = field(default_factory=LRScalingConfig)
    planner: FitCheckConfig = field(default_factory=FitCheckConfig)
    #: the ``logger`` group: logger name -> a Lightning logger config with ``_target_`` (empty: no logger).
    logger: dict[str, Any] = field(default_factory=dict)
    seed: int = 1234
    #: resume: null (from the latest complete checkpoint of this run directory if there is one: restarts under
    #: torchrun/SLURM requeue), "last" (the same, but an error if there is none) or the path of a checkpoint.
    ckpt_path: Optional[str] = None
    #: record a per-rank timeline of a few steps (lightning_par.callbacks.TimelineCallback): Chrome traces per rank and
    #: timeline.png in <run dir>/timeline/.
    profile: bool = False
    #: the first recorded optimizer step (0-based; moved earlier when the run is shorter).
    profile_start_step: int = 2
    #: optimizer steps to record.
    profile_steps: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= _UINT32_MAX:
            raise _invalid("seed", self.seed, f"an integer in [0, {_UINT32_MAX}]")
        if self.ckpt_path is not None and (not isinstance(self.ckpt_path, str) or not self.ckpt_path.strip()):
            raise _invalid("ckpt_path", self.ckpt_path, 'null, "last" or the path of a checkpoint')


def check_run_config(cfg: Any) -> None:
    """Check the ``trainer`` group and the run-wide fields of a composed config (their ``__post_init__``).

    Works on any mapping with those keys (keys the schemas do not know are left to Hydra/OmegaConf).

    Raises:
        ValueError: the first invalid field, named as ``trainer.<field>`` / ``seed`` / ``ckpt_path``.
    """
    from dataclasses import fields

    from omegaconf import DictConfig, OmegaConf

    def plain(node: Any) -> dict[str, Any]:
        return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)

    trainer = plain(cfg["trainer"])
    TrainerConfig(**{f.name: trainer[f.name] for f in fields(TrainerConfig) if f.name in trainer})
    RunConfig(
        parallel=ParallelConfig(), strategy=None, model=ModelConfig(), data=DataConfig(), trainer=TrainerConfig(),
        seed=cfg.get("seed", 1234), ckpt_path=cfg.get("ckpt_path"),
    )


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


def _class_node(schema: type) -> Any:
    """The config node of the dataclass ``schema`` from its fields' defaults, nested dataclass groups included.

    OmegaConf builds a nested group from its ``default_factory``, i.e. from an instance, whose ``__post_init__`` may
    already have resolved a default (``PipelineOptions.virtual_stages`` None -> the schedule's, ``bucket_cap_mb``
    None -> 25): the node must hold the declared defaults, so each nested group is rebuilt from its class.
    """
    node = OmegaConf.structured(schema)
    for f in dataclasses.fields(schema):
        factory = f.default_factory
        if isinstance(factory, type) and dataclasses.is_dataclass(factory):
            node[f.name] = _class_node(factory)
    return node


def _writable(schema: type) -> Any:
    """``schema`` as the config node Hydra stores (:func:`_class_node`), every nested node writable.

    The options dataclasses are frozen (a built options object never changes), and OmegaConf makes the node of a
    frozen dataclass read-only, which would refuse every override and every preset YAML merged onto it; the config
    is still checked against the dataclass's field types and keys at compose time.
    """
    node = _class_node(schema)
    stack = [node]
    while stack:
        current = stack.pop()
        OmegaConf.set_readonly(current, False)
        for key in current:
            if not (OmegaConf.is_missing(current, key) or OmegaConf.is_interpolation(current, key)):
                if OmegaConf.is_dict(child := current[key]):
                    stack.append(child)
    return node


def register_configs(cs: ConfigStore | None = None) -> None:
    """Store every schema in Hydra's ConfigStore and register the resolvers the configs use (call before composing)."""
    from lightning_par.config.run_id import register_resolvers

    register_resolvers()
    if not OmegaConf.has_resolver(UNLESS_RESOLVER):
        OmegaConf.register_new_resolver(UNLESS_RESOLVER, lambda other, value: value if other in (None, "") else None)
    cs = cs or ConfigStore.instance()
    cs.store(name="schema_run", node=_writable(RunConfig))
    cs.store(group="parallel", name="schema_parallel", node=_writable(ParallelDims))
    cs.store(group="model", name="schema_gpt", node=GPTModelConfig)
    cs.store(group="model", name="schema_custom", node=CustomModelConfig)
    cs.store(group="model", name="schema_hf", node=HFModelConfig)
    cs.store(group="data", name="schema_byte_corpus", node=ByteCorpusDataConfig)
    cs.store(group="data", name="schema_custom", node=CustomDataConfig)
    cs.store(group="data", name="schema_documents", node=DocumentDataConfig)
    for name, schema in LOGGER_SCHEMAS.items():
        cs.store(group="logger", name=f"schema_{name}", node=schema)
    cs.store(group="trainer", name="schema_trainer", node=TrainerConfig)
    for name, schema in STRATEGY_SCHEMAS.items():
        cs.store(group="strategy", name=f"schema_{name}", node=_writable(schema))
