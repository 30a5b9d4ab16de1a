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

from lightning_par.config.build import (
    build_datamodule,
    build_loggers,
    build_module,
    build_parallel_dims,
    build_strategy,
    build_trainer_kwargs,
    check_loggers,
)
from lightning_par.job_logging import JOB_LOG_ENV, attach_job_log, job_log_file
from lightning_par.launcher import run_distributed

__all__ = ["launch_job", "main", "run_recipe", "train_worker", "validate_run"]


def _external_world_size() -> int | None:
    """World size set by an outside launcher (torchrun: ``WORLD_SIZE``; SLURM ``srun`` / submitit:
    ``SLURM_NTASKS`` with ``SLURM_PROCID``), or ``None`` when this process must start the world itself."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if "SLURM_PROCID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return int(os.environ["SLURM_NTASKS"])  # Lightning's SLURMEnvironment reads the rest
    return None


def train_worker(cfg_dict: dict[str, Any], run_dir: str) -> dict[str, Any] | None:
    """Train on this rank (the torchrun environment variables must be set); rank 0 returns the run summary.

    Args:
        cfg_dict: the resolved run config as plain containers.
        run_dir: where logs, checkpoints and ``summary.json`` go.

    Returns:
        The contents of ``summary.json`` on rank 0, ``None`` on other ranks.
    """
    import lightning as L
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint

    from lightning_par.callbacks import ParallelMetricsCallback, RunSummaryCallback

    attach_job_log(os.environ.get(JOB_LOG_ENV))
    cfg = OmegaConf.create(cfg_dict)
    out = Path(run_dir)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    module = build_module(cfg)
    datamodule = build_datamodule(cfg, module)
    strategy = build_strategy(cfg)
    metrics = ParallelMetricsCallback(peak_flops_per_device=cfg.trainer.peak_flops_per_device)
    summary_path = out / "summary.json"
    trainer_kwargs = build_trainer_kwargs(cfg)
    callbacks: list[Any] = [
        metrics,
        RunSummaryCallback(summary_path, metrics, extra={"config": cfg_dict, "accelerator": trainer_kwargs["accelerator"]}),
        LearningRateMonitor(logging_interval="step"),
    ]
    if cfg.trainer.checkpoint:
        callbacks.append(ModelCheckpoint(dirpath=str(out / "checkpoints"), save_last=True, every_n_train_steps=cfg.trainer.val_check_interval))
    trainer = L.Trainer(
        **trainer_kwargs,
        strategy=strategy,
        logger=build_loggers(cfg, out),
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

    strategy = build_strategy(cfg)
    build_trainer_kwargs(cfg)
    check_loggers(cfg)
    with torch.device("meta"):
        module = build_module(cfg)
    strategy.connect(module)
    strategy.validate_model(build_parallel_dims(cfg))


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
        env={JOB_LOG_ENV: log_file} if (log_file := job_log_file()) else None,
    )
    return results[0]


#: Summary fields the recipe prints at the end of a job.
_PRINTED = ("strategy", "world_size", "dp_size", "tp_size", "pp_size", "steps", "initial_train_loss",
            "final_train_loss", "final_val_loss", "tokens_per_s")


def run_recipe(cfg: DictConfig) -> float | None:
    """The recipe's Hydra task: run the job of ``cfg`` in the Hydra output directory, print the main figures and
    return the final validation loss (``None`` on ranks other than 0 under torchrun/SLURM)."""
    from hydra.core.hydra_config import HydraConfig

    summary = launch_job(cfg, HydraConfig.get().runtime.output_dir)
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
