"""The training job behind ``recipes/train.py``: one Hydra job = one multi-process world.

The Hydra process never trains. It checks the whole config (:func:`preflight`: every field, the strategy's options,
the model against the layout and the data, the corpus size, the checkpoint to resume from), then starts
``parallel.world_size`` worker processes that each run :func:`train_worker` (a function, not the command line), waits
for them under a watchdog, and returns rank 0's summary. So a multirun sweep (``-m``) runs its jobs one after
another, each in a fresh world, and no child ever re-runs the sweep: the failure that made Lightning drop its Hydra
support (Lightning #18175, Hydra #2070) cannot happen.

When the processes are created by someone else (``torchrun``: ``RANK`` and ``WORLD_SIZE`` are set; SLURM's ``srun`` or
Hydra's submitit launcher: ``SLURM_PROCID`` and ``SLURM_NTASKS`` are set), the job runs :func:`train_worker` in place
instead, so the same recipe runs on a cluster; each rank then watches its own progress (the heartbeat thread).

Reliability (docs/reliability.md): a non-finite loss or gradient stops the run before the optimizer step
(or skips it, ``trainer.on_nonfinite=skip``); checkpoints every ``trainer.checkpoint_every_n_steps`` steps, the latest
``trainer.keep_last_k`` kept; ``ckpt_path`` null resumes from the latest complete checkpoint of the run directory
(a restart or a requeue), with the data position restored; a rank that stops progressing for ``trainer.watchdog_s``
ends the job, named.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_par.config.build import (
    build_datamodule,
    build_loggers,
    build_module,
    build_parallel_dims,
    build_strategy,
    build_trainer_kwargs,
    check_loggers,
    model_block_size,
    model_vocab_size,
)
from lightning_par.config.schema import check_run_config
from lightning_par.fault.heartbeat import HEARTBEAT_DIR_ENV
from lightning_par.fault.orphan import guard_outside_launcher
from lightning_par.fault.resume import latest_checkpoint, resolve_ckpt_path
from lightning_par.fault.run_lock import claim_run_dir, job_identity
from lightning_par.job_logging import JOB_LOG_ENV, attach_job_log, job_log_file
from lightning_par.launcher import run_distributed
from lightning_par.parallel_dims import ParallelDims

__all__ = ["Plan", "launch_job", "main", "preflight", "run_recipe", "train_worker", "validate_run"]

log = logging.getLogger(__name__)

#: Sub-directories of a run directory.
CHECKPOINT_DIR = "checkpoints"
HEARTBEAT_DIR = ".heartbeat"
LOG_DIR = "logs"


def _external_world_size() -> int | None:
    """World size set by an outside launcher (torchrun: ``WORLD_SIZE``; SLURM ``srun`` / submitit:
    ``SLURM_NTASKS`` with ``SLURM_PROCID``), or ``None`` when this process must start the world itself."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if "SLURM_PROCID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return int(os.environ["SLURM_NTASKS"])  # Lightning's SLURMEnvironment reads the rest
    return None


def _stale_launcher_variables() -> str | None:
    """``RANK``/``WORLD_SIZE`` with no rendezvous address (``MASTER_ADDR``/``MASTER_PORT``, which torchrun and every
    launcher set with them, SLURM aside): variables left in the environment by another job or a shell, not a launcher
    of this process. Returns their description, or ``None``."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env or "SLURM_PROCID" in env:
        return None
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not env.get(v)]
    if not missing:
        return None
    return (f"RANK={env['RANK']} and WORLD_SIZE={env['WORLD_SIZE']} are set but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not, so no launcher (torchrun, srun) started this process: they "
            f"are stale (left by another job or this shell)")


def _external_rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def _keep_previous_logs(run_dir: Path) -> None:
    """Move an earlier attempt's ``logs/metrics.csv`` to ``logs/metrics-<k>.csv`` (k = 1, 2, ... in order of attempts):
    Lightning's CSV logger deletes the file it finds, and a resumed run must not lose the steps before the restart."""
    current = run_dir / LOG_DIR / "metrics.csv"
    if not current.is_file():
        return
    k = 1
    while (current.with_name(f"metrics-{k}.csv")).exists():
        k += 1
    current.rename(current.with_name(f"metrics-{k}.csv"))


def _accelerator(cfg: Any) -> str:
    import torch

    accelerator = cfg.trainer.accelerator
    if accelerator == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    return "gpu" if accelerator == "cuda" else accelerator


def train_worker(cfg_dict: dict[str, Any], run_dir: str, ckpt_path: str | None = None) -> dict[str, Any] | None:
    """Train on this rank (the torchrun environment variables must be set); rank 0 returns the run summary.

    Args:
        cfg_dict: the resolved run config as plain containers.
        run_dir: where logs, checkpoints and ``summary.json`` go.
        ckpt_path: the checkpoint to resume from (already resolved by :func:`preflight`), or ``None``.

    Returns:
        The contents of ``summary.json`` on rank 0, ``None`` on other ranks.
    """
    import lightning as L
    from lightning.pytorch.callbacks import LearningRateMonitor

    from lightning_par.callbacks import LRScalingCallback, ParallelMetricsCallback, RunSummaryCallback, TimelineCallback
    from lightning_par.callbacks.progress import default_progress_bar
    from lightning_par.compat import disable_lightning_signal_handlers
    from lightning_par.fault.heartbeat import HeartbeatCallback
    from lightning_par.fault.no_progress import ProgressGuard
    from lightning_par.fault.nonfinite import NonFiniteGuard
    from lightning_par.fault.preemption import PreemptionCallback
    from lightning_par.fault.step_checkpoint import StepCheckpoint

    attach_job_log(os.environ.get(JOB_LOG_ENV))
    cfg = OmegaConf.create(cfg_dict)
    out = Path(run_dir)
    t = cfg.trainer
    # Preemption: watched from here on (before the model and the process group), agreed at step boundaries.
    preemption = (PreemptionCallback(t.preemption_signal, t.preemption_grace_s, checkpoint_dir=out / CHECKPOINT_DIR)
                  if t.preemption_signal else None)
    if preemption is not None:
        preemption.setup_watch()
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    module = build_module(cfg)
    datamodule = build_datamodule(cfg, module)
    dims = build_parallel_dims(cfg)  # this process's one layout: the strategy and the Trainer arguments share it
    strategy = build_strategy(cfg, dims)
    metrics = ParallelMetricsCallback(peak_flops_per_device=t.peak_flops_per_device)
    summary_path = out / "summary.json"
    sources: list[Any] = [LRScalingCallback(**OmegaConf.to_container(cfg.lr_scaling))]
    if cfg.get("profile"):
        sources.append(TimelineCallback(out / "timeline", cfg.profile_start_step, cfg.profile_steps))
    if callable(getattr(datamodule, "metrics_callback", None)):  # packed documents: tokens that count, padding
        sources.append(datamodule.metrics_callback())
    trainer_kwargs = build_trainer_kwargs(cfg, dims=dims)
    callbacks: list[Any] = [
        metrics,
        *sources,
        RunSummaryCallback(
            summary_path,
            metrics,
            extra={"config": cfg_dict, "resumed_from": ckpt_path, "accelerator": trainer_kwargs["accelerator"]},
            sources=sources,
        ),
        LearningRateMonitor(logging_interval="step"),
        NonFiniteGuard(action=t.on_nonfinite, max_consecutive_skips=t.max_consecutive_skips),
        # Under our launcher it watches the heartbeats itself; under torchrun/SLURM each rank runs the thread.
        HeartbeatCallback(
            os.environ.get(HEARTBEAT_DIR_ENV) or out / HEARTBEAT_DIR,
            watchdog_s=t.watchdog_s,
            startup_grace_s=t.watchdog_startup_s,
        ),
    ]
    if t.checkpoint:
        callbacks.append(StepCheckpoint(
            out / CHECKPOINT_DIR, t.checkpoint_every_n_steps, t.keep_last_k, async_save=t.async_checkpoint
        ))
    if preemption is not None:
        callbacks.append(preemption)
    # First, so that a run that trained no step fails before the summary is written.
    callbacks.insert(0, ProgressGuard())
    if trainer_kwargs.get("enable_progress_bar", True) is not False and (bar := default_progress_bar()) is not None:
        callbacks.append(bar)  # "Epoch 0", not Lightning's "Epoch 0/-2" for a run bounded by max_steps
    trainer = L.Trainer(
        **trainer_kwargs,
        strategy=strategy,
        logger=build_loggers(cfg, out),
        callbacks=callbacks,
        default_root_dir=str(out),
    )
    # Lightning's SIGTERM handler runs a collective inside the handler on the signalled rank only (a deadlock): never
    # installed; the PreemptionCallback handles trainer.preemption_signal, and with null the signal keeps its default.
    disable_lightning_signal_handlers(trainer)
    # Under torchrun --max-restarts every attempt gets a process group of its own: the strategy starts it (see
    # lightning_par.fault.elastic).
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    if preemption is not None and preemption.preempted_at_step is not None:
        raise preemption.error(trainer.global_rank)  # status 75 only with a checkpoint to resume from
    if trainer.global_rank != 0:
        return None
    return json.loads(summary_path.read_text())


def validate_run(cfg: DictConfig, dims: ParallelDims | None = None) -> None:
    """Check the strategy's options, the model against the layout and against the data, in this process.

    ``dims`` is the layout already validated from ``cfg.parallel`` (:func:`preflight` builds it once); ``None``
    builds it here.

    The model is built on the ``meta`` device (no memory, no initialisation), so this is cheap for any preset. The
    strategy gets the accelerator and devices a ``Trainer`` would give it, so its device-dependent checks run too.

    Raises:
        ValueError: the first problem found, naming the field, the value and what would be valid.
    """
    import torch
    from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator

    from lightning_par.lr_scaling import check_lr_scaling
    from lightning_par.precision import check_precision
    from lightning_par.validation import check_int

    if cfg.get("profile"):
        check_int("profile_start_step", cfg.profile_start_step, 0)
        check_int("profile_steps", cfg.profile_steps, 1)
    scaling = cfg.lr_scaling
    check_lr_scaling(scaling.rule, scaling.reference_batch, scaling.warmup_samples, prefix="lr_scaling.")
    lr = cfg.model.get("learning_rate") if hasattr(cfg.model, "get") else None
    if isinstance(lr, (int, float)) and not isinstance(lr, bool) and not math.isfinite(lr):
        raise ValueError(f"model.learning_rate={lr!r} is not valid: expected a finite number > 0.")
    dims = dims or build_parallel_dims(cfg)
    gpu = _accelerator(cfg) == "gpu"
    strategy = build_strategy(cfg, dims)
    # What the Trainer's accelerator connector would set (device objects only: no GPU is needed to validate).
    strategy.accelerator = CUDAAccelerator() if gpu else CPUAccelerator()
    strategy.parallel_devices = [torch.device("cuda", i) if gpu else torch.device("cpu") for i in range(dims.world_size)]
    build_trainer_kwargs(cfg)
    check_loggers(cfg)
    with torch.device("meta"):
        module = build_module(cfg)
    _check_model_size(module)
    own_warmup = getattr(module, "hparams", {}).get("warmup_steps")
    if scaling.warmup_samples and own_warmup:
        raise ValueError(
            f"lr_scaling.warmup_samples={scaling.warmup_samples} is not valid with the model's own warm-up "
            f"(warmup_steps={own_warmup}): both would warm the learning rate up. Set model.warmup_steps=0 to warm up "
            f"per sample, or lr_scaling.warmup_samples=0."
        )
    strategy.connect(module)
    check_precision(str(cfg.trainer.precision), dims.pp_size)
    strategy.validate_model(dims)
    datamodule = build_datamodule(cfg, module)
    # Token ids against the model's vocabulary, where both are known (bytes or data.tokenizer's ids; the reference
    # GPT's model.vocab_size or a Hugging Face model's config.vocab_size).
    model_vocab = model_vocab_size(module)
    data_vocab = getattr(datamodule, "vocab_size", None)
    if isinstance(model_vocab, int) and isinstance(data_vocab, int) and model_vocab < data_vocab:
        tokenizer = getattr(datamodule, "tokenizer", None)
        source = f"data.tokenizer={tokenizer!r} has {data_vocab} tokens" if tokenizer else "one token per byte"
        raise ValueError(
            f"model.vocab_size={model_vocab} is not valid for this data: its token ids go up to {data_vocab - 1} "
            f"({source}). Expected model.vocab_size >= {data_vocab} (a Hugging Face model: config.vocab_size, "
            f"+model.config.vocab_size=N or a pretrained model with a vocabulary that large)."
        )
    model_block, data_block = model_block_size(module), getattr(datamodule, "block_size", None)
    if isinstance(model_block, int) and isinstance(data_block, int) and not isinstance(data_block, bool) \
            and data_block > model_block:
        raise ValueError(
            f"data.block_size={data_block} is not valid for this model: it was built for sequences of at most "
            f"{model_block} tokens (its block_size). Expected data.block_size <= {model_block}, null (the model's), or "
            f"a model with a larger block_size (model.block_size={data_block})."
        )
    if callable(getattr(datamodule, "check_corpus", None)):
        datamodule.check_corpus(replicas=dims.dp_size)


def _host_memory_bytes() -> int | None:
    """This machine's physical memory, in bytes (``None`` where the system does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def _size_fields(module: Any) -> list[tuple[str, int]]:
    """``(field, value)`` of the model's integer config fields, in declaration order (the GPT's ``GPTConfig``, a
    Hugging Face model's config), for naming the fields a tensor's shape comes from."""
    import dataclasses

    config = getattr(module, "config", None)
    if dataclasses.is_dataclass(config):
        items = [(f.name, getattr(config, f.name)) for f in dataclasses.fields(config)]
    else:
        hf = getattr(getattr(module, "model", None), "config", None)
        items = [(f"config.{k}", v) for k, v in (hf.to_dict() if hasattr(hf, "to_dict") else {}).items()]
    return [(k, v) for k, v in items if isinstance(v, int) and not isinstance(v, bool) and v > 1]


def _check_model_size(module: Any) -> None:
    """Refuse, before any process starts, a model whose parameters alone exceed this machine's memory (each rank
    builds the whole model in host memory before the strategy splits it), naming the fields of its largest tensor:
    ``model.vocab_size=2147483648`` is named here, not by an allocation error of 274,877,906,944 bytes in every rank.

    Raises:
        ValueError: naming the field, its value, the bytes needed and the memory there is.
    """
    memory = _host_memory_bytes()
    params = dict(module.named_parameters())  # tied weights once
    need = sum(p.numel() * p.element_size() for p in params.values())
    if memory is None or need <= memory or not params:
        return
    name, largest = max(params.items(), key=lambda item: item[1].numel())
    fields = _size_fields(module)
    named = []
    for dim in largest.shape:
        match = next((f for f, v in fields if v == dim), None)
        named.append((f"model.{match}" if match else str(dim), dim))
    field, value = max(((f, d) for f, d in named if f.startswith("model.")), key=lambda fd: fd[1],
                       default=(f"the model's parameter {name}", largest.numel()))
    gib = 1024**3
    raise ValueError(
        f"{field}={value} is not valid: the model's parameters alone take {need / gib:,.0f} GiB "
        f"({sum(p.numel() for p in params.values()):,} parameters of {largest.dtype}), more than this machine's "
        f"{memory / gib:,.0f} GiB of memory, and every rank builds the whole model before the strategy splits it. "
        f"Its largest tensor, {name} of shape {tuple(largest.shape)}, is {' x '.join(f for f, _ in named)}. Expected "
        f"a model that fits: a smaller {field}."
    )


#: CPU processes per core the recipe starts without ``trainer.allow_oversubscribe``: gloo ranks run one thread each,
#: and 8 ranks on 2 cores (a tiny 3D layout) take seconds (NOTES-cpu-distributed.md); far beyond, a typo such as
#: parallel.world_size=10000 would fork a machine to a standstill.
CPU_PROCESSES_PER_CORE = 4


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _check_machine(cfg: Any, dims: ParallelDims, external: int | None) -> None:
    """The accelerator the config asks for exists here, with enough devices (GPU) or cores (CPU: at most
    :data:`CPU_PROCESSES_PER_CORE` processes per core, unless ``trainer.allow_oversubscribe``) for the processes
    started here."""
    import torch

    if _accelerator(cfg) != "gpu":
        cores = _usable_cores()
        limit = CPU_PROCESSES_PER_CORE * cores
        if external is None and dims.world_size > limit and not cfg.trainer.get("allow_oversubscribe", False):
            raise ValueError(
                f"parallel.world_size={dims.world_size} is not valid on this machine: the recipe would start "
                f"{dims.world_size} processes on {cores} CPU cores. Expected parallel.world_size <= {limit} "
                f"({CPU_PROCESSES_PER_CORE} per core), several nodes under torchrun/SLURM, or "
                f"trainer.allow_oversubscribe=true to start them anyway."
            )
        return
    if not torch.cuda.is_available():
        raise ValueError(
            f"trainer.accelerator={cfg.trainer.accelerator!r} is not valid on this machine: torch finds no CUDA GPU "
            f"(torch.cuda.is_available() is False). Expected trainer.accelerator=cpu or auto."
        )
    if external is None and torch.cuda.device_count() < dims.world_size and not cfg.trainer.get("allow_oversubscribe",
                                                                                                 False):
        raise ValueError(
            f"parallel.world_size={dims.world_size} is not valid on this machine: it has {torch.cuda.device_count()} "
            f"GPUs and the recipe starts one process per GPU. Expected parallel.world_size <= "
            f"{torch.cuda.device_count()}, several nodes under torchrun/SLURM, or trainer.allow_oversubscribe=true."
        )


def _check_fit(cfg: DictConfig) -> None:
    """With ``planner.device``: refuse a layout the planner predicts not to fit that device (see
    :func:`lightning_par.planner.fit.check_fit`); without one, nothing."""
    planner = cfg.get("planner")
    device = planner.get("device") if planner is not None else None
    if device is None:
        return
    from lightning_par.planner.fit import check_fit

    name = device.value if hasattr(device, "value") else str(device)
    check_fit(OmegaConf.to_container(cfg, resolve=True), name, int(planner.get("devices_per_node", 8)))


@dataclass(frozen=True)
class Plan:
    """What :func:`preflight` settled: the layout, the checkpoint to resume from, whether ranks are started here."""

    dims: ParallelDims
    ckpt_path: Path | None
    external_world_size: int | None


def preflight(cfg: DictConfig, run_dir: str | Path) -> Plan:
    """Every check that can run before a process starts, in the order a user would fix them.

    Raises:
        ValueError: a field out of range (``trainer.*``, ``seed``, ``ckpt_path``), an impossible layout, an option the
            strategy rejects, a model that does not fit the layout or the data, a corpus too small, a layout predicted
            not to fit ``planner.device`` (when set), a checkpoint that does not exist, is damaged, would run code if
            loaded or was written with other model, optimizer or data settings (``model.n_head`` 2 -> 4, a new
            ``model.learning_rate``, ...), a world size that does not match an outside launcher. The message names the field, the
            value and what would be valid.
    """
    check_run_config(cfg)
    dims = build_parallel_dims(cfg)
    external = _external_world_size()
    stale = _stale_launcher_variables()
    if external is not None and external != dims.world_size:
        raise ValueError(
            f"parallel.world_size={dims.world_size} does not match the {external} processes started by the "
            f"launcher (WORLD_SIZE / SLURM_NTASKS): set parallel.world_size={external}."
            + (f" But {stale}: unset them (unset RANK WORLD_SIZE LOCAL_RANK) and the recipe starts its own world."
               if stale else "")
        )
    if stale is not None:
        raise ValueError(
            f"{stale}. Unset them (unset RANK WORLD_SIZE LOCAL_RANK) and the recipe starts its own world of "
            f"parallel.world_size={dims.world_size} processes, or start it under torchrun."
        )
    _check_machine(cfg, dims, external)
    validate_run(cfg, dims)
    _check_fit(cfg)
    ckpt = resolve_ckpt_path(cfg.get("ckpt_path"), Path(run_dir) / CHECKPOINT_DIR)
    if ckpt is not None:
        _check_resume(cfg, ckpt, dims)
    return Plan(dims, ckpt, external)


def _check_resume(cfg: DictConfig, ckpt: Path, dims: ParallelDims) -> None:
    """Refuse, before any process starts, a resume whose model, optimizer or data settings differ from the
    checkpoint's (:func:`lightning_par.checkpoint.compat.check_resume`; ``meta.pt`` read without running code)."""
    import torch

    from lightning_par.checkpoint import METADATA_FILENAME, is_sharded_checkpoint
    from lightning_par.checkpoint.compat import check_resume
    from lightning_par.checkpoint.safe import load_metadata_file

    if not is_sharded_checkpoint(ckpt):
        return
    with torch.device("meta"):
        module = build_module(cfg)
    datamodule = build_datamodule(cfg, module)
    fingerprint = datamodule.fingerprint() if callable(getattr(datamodule, "fingerprint", None)) else None
    applied = check_resume(ckpt, load_metadata_file(ckpt / METADATA_FILENAME), getattr(module, "hparams", None),
                           getattr(datamodule, "hparams", None), replicas=_data_replicas(cfg, dims),
                           data_fingerprint=fingerprint)
    for change in applied:
        log.info("Resuming from %s with %s", ckpt, change)


def _data_replicas(cfg: DictConfig, dims: ParallelDims) -> int:
    """The data-parallel ranks the data is split over: ``dp_size``, times ``num_replica_groups`` under fault tolerance
    (every replica group's dp ranks share one sample order; see ``MeshStrategy.distributed_sampler_kwargs``)."""
    ft = cfg.strategy.get("fault_tolerance")
    groups = int(ft.get("num_replica_groups", 1)) if ft is not None and ft.get("enabled") else 1
    return int(dims.dp_size) * groups


def _claim(run_dir: Path) -> contextlib.AbstractContextManager[None]:
    """Hold ``<run_dir>/.lock`` while the job runs (:func:`lightning_par.fault.run_lock.claim_run_dir`, rank 0): a
    second job given the same directory fails at once, naming the first, instead of mixing its logs and checkpoints
    with ours. The lock dies with the process (``flock``), so a restart can take it."""
    return claim_run_dir(run_dir, rank=0, job=job_identity())


def _with_resumability(preempted: Any, run_dir: Path) -> Any:
    """``preempted`` with the status the run directory supports: 75 only when it holds a complete checkpoint."""
    from lightning_par.fault.preemption import Preempted, preempted_exit_code

    resumable = latest_checkpoint(run_dir / CHECKPOINT_DIR, on_skip=None) is not None
    if resumable == preempted.resumable:
        return preempted
    code = preempted_exit_code(resumable, preempted.signum)
    why = ("a checkpoint to resume from exists" if resumable else
           f"no checkpoint to resume from in {str(run_dir / CHECKPOINT_DIR)!r}, so not resumable")
    return Preempted(f"{preempted}; {why}: exit code {code}", resumable=resumable, signum=preempted.signum)


def launch_job(cfg: DictConfig, run_dir: str | Path) -> dict[str, Any] | None:
    """Check ``cfg`` (:func:`preflight`), then run the whole world for it and return rank 0's summary.

    Raises:
        ValueError: see :func:`preflight`; before any process starts.
        lightning_par.fault.run_lock.RunDirectoryInUse: another job holds the run directory (a ``RuntimeError``
            naming its pid, host, start time and job), under every launcher.
        lightning_par.launcher.DistributedRunError: a rank failed (a non-finite step included), died, stopped making
            progress for ``trainer.watchdog_s``, or the job ran past ``trainer.job_timeout_s``; the message names the
            rank and the cause first.
        lightning_par.fault.preemption.Preempted: ``trainer.preemption_signal`` reached a rank or the launcher: a
            checkpoint was saved at the next step boundary (``SystemExit`` with status 75; resume with
            ``ckpt_path=last``); with no checkpoint to resume from in the run directory, status ``128 + signal``.
    """
    from lightning_par.fault.preemption import Preempted

    run_dir = Path(run_dir)
    if _external_world_size() is not None:
        # A worker of torchrun/SLURM: it ends when its launcher dies (lightning_par.fault.orphan), from here on.
        guard_outside_launcher(clean_stop=bool(cfg.trainer.get("preemption_signal")))
    try:
        plan = preflight(cfg, run_dir)
    except ValueError as err:
        if _raised_here(err):  # a refusal of a field, not the user's own code failing while it was checked
            err.lightning_par_refusal = True  # type: ignore[attr-defined]
        raise
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    ckpt = str(plan.ckpt_path) if plan.ckpt_path is not None else None
    if ckpt is not None:
        log.info("Resuming from %s", ckpt)
    try:
        if plan.external_world_size is not None:
            # Rank 0 locks the run directory for the job; the other ranks wait for it before writing anything.
            with claim_run_dir(run_dir, rank=_external_rank(), job=job_identity()):
                if _external_rank() == 0:
                    _keep_previous_logs(run_dir)
                return train_worker(cfg_dict, str(run_dir), ckpt)
        return _launch_world(cfg, plan, cfg_dict, run_dir, ckpt)
    except Preempted as preempted:
        raise _with_resumability(preempted, run_dir) from None


def _raised_here(err: BaseException) -> bool:
    """Whether ``err`` was raised by lightning_par's own code (the innermost frame of its traceback lies in the package),
    i.e. it is one of the recipe's refusals rather than an error of the user's model or data raised while checking."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return False
    package = Path(__file__).resolve().parent
    return Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(package)


def _launch_world(cfg: DictConfig, plan: Plan, cfg_dict: Any, run_dir: Path, ckpt: str | None) -> dict[str, Any] | None:
    import torch

    t = cfg.trainer
    gpu = _accelerator(cfg) == "gpu"
    threads = None if gpu else max(1, (os.cpu_count() or 1) // plan.dims.world_size)
    with _claim(run_dir):
        _keep_previous_logs(run_dir)
        results = run_distributed(
            train_worker,
            plan.dims.world_size,
            (cfg_dict, str(run_dir), ckpt),
            timeout_s=t.job_timeout_s,
            start_method="spawn" if gpu or torch.cuda.is_initialized() else None,
            threads_per_rank=threads,
            watchdog_s=t.watchdog_s,
            startup_grace_s=t.watchdog_startup_s,
            heartbeat_dir=run_dir / HEARTBEAT_DIR,
            env={JOB_LOG_ENV: log_file} if (log_file := job_log_file()) else None,
            preemption_signal=t.preemption_signal,
            preemption_grace_s=t.preemption_grace_s,
        )
    return results[0]


#: Summary fields the recipe prints at the end of a job.
_PRINTED = ("strategy", "world_size", "dp_size", "tp_size", "pp_size", "steps", "initial_train_loss",
            "final_train_loss", "final_val_loss", "tokens_per_s")


def run_recipe(cfg: DictConfig) -> float | None:
    """The recipe's Hydra task: run the job of ``cfg`` in the Hydra output directory, print the main figures and
    return the final validation loss (``None`` on ranks other than 0 under torchrun/SLURM)."""
    from hydra.core.hydra_config import HydraConfig

    from lightning_par.fault.preemption import Preempted

    try:
        summary = launch_job(cfg, HydraConfig.get().runtime.output_dir)
    except Preempted as preempted:  # a SystemExit with status 75: it ends the script, and stops a sweep
        sys.stderr.write(f"lightning_par: {preempted}\n")  # one write: ranks share the stream under torchrun
        sys.stderr.flush()
        raise
    except ValueError as err:
        # A refusal before any process started (a field, its value and what is valid): the message alone and exit
        # status 1, with no traceback above it. In a multirun, Hydra reports each job's failure after the sweep
        # (a SystemExit here would stop the other jobs), so there the error is raised as it is.
        from hydra.types import RunMode

        if not getattr(err, "lightning_par_refusal", False) or HydraConfig.get().mode != RunMode.RUN:
            raise
        sys.stderr.write(f"Error: {err}\n")
        sys.stderr.flush()
        raise SystemExit(1) from None
    if summary is None:
        return None
    print(json.dumps({k: summary.get(k) for k in _PRINTED}, indent=2))
    return summary.get("final_val_loss")


def main() -> None:
    """``python -m lightning_par.train [overrides]``: the recipe on the packaged config (``conf/``, found through the
    ``lightning_par`` Hydra search-path plugin), from any directory."""
    import hydra

    import lightning_par  # noqa: F401  (registers the strategies)
    from lightning_par.config.schema import register_configs

    register_configs()
    hydra.main(version_base=None, config_path=None, config_name="config")(run_recipe)()


if __name__ == "__main__":
    main()
