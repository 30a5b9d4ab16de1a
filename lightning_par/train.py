"""The training job behind ``recipes/train.py``: one Hydra job = one multi-process world.

The Hydra process never trains. It validates the config, then starts ``parallel.world_size`` worker processes that
each run :func:`train_worker` (a function, not the command line), waits for them, and returns rank 0's summary. So a
multirun sweep (``-m``) runs its jobs one after another, each in a fresh world, and no child ever re-runs the sweep:
the failure that made Lightning drop its Hydra support (Lightning #18175, Hydra #2070) cannot happen.

When the processes are created by someone else (``torchrun``: ``RANK`` and ``WORLD_SIZE`` are set; SLURM's ``srun`` or
Hydra's submitit launcher: ``SLURM_PROCID`` and ``SLURM_NTASKS`` are set), the job runs :func:`train_worker` in place
instead, so the same recipe runs on a cluster.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_par.config.build import build_datamodule, build_module, build_parallel_dims, build_strategy
from lightning_par.launcher import run_distributed

__all__ = ["launch_job", "train_worker", "validate_run"]


def _external_world_size() -> int | None:
    """World size set by an outside launcher (torchrun: ``WORLD_SIZE``; SLURM ``srun`` / submitit:
    ``SLURM_NTASKS`` with ``SLURM_PROCID``), or ``None`` when this process must start the world itself."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if "SLURM_PROCID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return int(os.environ["SLURM_NTASKS"])  # Lightning's SLURMEnvironment reads the rest
    return None


def _loggers(run_dir: Path) -> list[Any]:
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    loggers: list[Any] = [CSVLogger(save_dir=str(run_dir), name="logs", version="")]
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return loggers
    loggers.append(TensorBoardLogger(save_dir=str(run_dir), name="tb", version=""))
    return loggers


def train_worker(cfg_dict: dict[str, Any], run_dir: str) -> dict[str, Any] | None:
    """Train on this rank (the torchrun environment variables must be set); rank 0 returns the run summary.

    Args:
        cfg_dict: the resolved run config as plain containers.
        run_dir: where logs, checkpoints and ``summary.json`` go.

    Returns:
        The contents of ``summary.json`` on rank 0, ``None`` on other ranks.
    """
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

    from lightning_par.callbacks import LRScalingCallback, ParallelMetricsCallback, RunSummaryCallback, TimelineCallback

    cfg = OmegaConf.create(cfg_dict)
    out = Path(run_dir)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    module = build_module(cfg)
    datamodule = build_datamodule(cfg, module.config.block_size)
    strategy = build_strategy(cfg)
    metrics = ParallelMetricsCallback(peak_flops_per_device=cfg.trainer.peak_flops_per_device)
    summary_path = out / "summary.json"
    sources: list[Any] = [LRScalingCallback(**OmegaConf.to_container(cfg.lr_scaling))]
    if cfg.get("profile"):
        sources.append(TimelineCallback(out / "timeline", cfg.profile_start_step, cfg.profile_steps))
    callbacks: list[Any] = [
        metrics,
        *sources,
        RunSummaryCallback(summary_path, metrics, extra={"config": cfg_dict}, sources=sources),
        LearningRateMonitor(logging_interval="step"),
    ]
    if cfg.trainer.checkpoint:
        callbacks.append(ModelCheckpoint(dirpath=str(out / "checkpoints"), save_last=True, every_n_train_steps=cfg.trainer.val_check_interval))
    accelerator = cfg.trainer.accelerator
    if accelerator == "auto":
        accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    trainer = L.Trainer(
        accelerator=accelerator,
        devices=cfg.parallel.world_size,
        num_nodes=1,
        strategy=strategy,
        precision=cfg.trainer.precision,
        max_steps=cfg.trainer.max_steps,
        val_check_interval=cfg.trainer.val_check_interval,
        check_val_every_n_epoch=None,
        log_every_n_steps=cfg.trainer.log_every_n_steps,
        accumulate_grad_batches=cfg.trainer.accumulate_grad_batches,
        gradient_clip_val=cfg.trainer.gradient_clip_val,
        enable_progress_bar=cfg.trainer.enable_progress_bar,
        enable_checkpointing=bool(cfg.trainer.checkpoint),
        enable_model_summary=False,
        logger=_loggers(out),
        callbacks=callbacks,
        default_root_dir=str(out),
    )
    trainer.fit(module, datamodule=datamodule)
    if trainer.global_rank != 0:
        return None
    return json.loads(summary_path.read_text())


def validate_run(cfg: DictConfig) -> None:
    """Check the strategy's options and the model against the layout in this process, before any rank starts.

    The model is built on the ``meta`` device (no memory, no initialisation), so this is cheap for any preset.

    Raises:
        ValueError: the first problem found, naming the field, the value and what would be valid.
    """
    import torch

    from lightning_par.lr_scaling import check_lr_scaling
    from lightning_par.precision import check_precision
    from lightning_par.validation import check_int

    if cfg.get("profile"):
        check_int("profile_start_step", cfg.profile_start_step, 0)
        check_int("profile_steps", cfg.profile_steps, 1)
    scaling = cfg.lr_scaling
    check_lr_scaling(scaling.rule, scaling.reference_batch, scaling.warmup_samples, prefix="lr_scaling.")
    strategy = build_strategy(cfg)
    with torch.device("meta"):
        module = build_module(cfg)
    own_warmup = getattr(module, "hparams", {}).get("warmup_steps")
    if scaling.warmup_samples and own_warmup:
        raise ValueError(
            f"lr_scaling.warmup_samples={scaling.warmup_samples} is not valid with the model's own warm-up "
            f"(warmup_steps={own_warmup}): both would warm the learning rate up. Set model.warmup_steps=0 to warm up "
            f"per sample, or lr_scaling.warmup_samples=0."
        )
    strategy.connect(module)
    dims = build_parallel_dims(cfg)
    check_precision(str(cfg.trainer.precision), dims.pp_size)
    strategy.validate_model(dims)


def launch_job(cfg: DictConfig, run_dir: str | Path) -> dict[str, Any] | None:
    """Validate ``cfg``, then run the whole world for it and return rank 0's summary.

    Raises:
        ValueError: an impossible layout or an invalid strategy option, before any process starts.
        lightning_par.launcher.DistributedRunError: a rank failed, died or the job ran past
            ``trainer.job_timeout_s``; the message holds the first failure.
    """
    dims = build_parallel_dims(cfg)  # raises before anything starts
    validate_run(cfg)
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    run_dir = str(run_dir)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    external = _external_world_size()
    if external is not None:
        if external != dims.world_size:
            raise ValueError(
                f"parallel.world_size={dims.world_size} does not match the {external} processes started by the "
                f"launcher (WORLD_SIZE / SLURM_NTASKS): set parallel.world_size={external}."
            )
        return train_worker(cfg_dict, run_dir)
    import torch

    gpu = cfg.trainer.accelerator in ("gpu", "cuda") or (cfg.trainer.accelerator == "auto" and torch.cuda.is_available())
    threads = None if gpu else max(1, (os.cpu_count() or 1) // dims.world_size)
    results = run_distributed(
        train_worker,
        dims.world_size,
        (cfg_dict, run_dir),
        timeout_s=cfg.trainer.job_timeout_s,
        start_method="spawn" if gpu else None,
        threads_per_rank=threads,
    )
    return results[0]
