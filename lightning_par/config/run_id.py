"""The default run directory: unique per job, and the same for every rank and every restart of one job.

``hydra.run.dir`` defaults to ``outputs/${lp_run_id:}`` (and ``hydra.sweep.dir`` to ``multirun/${lp_run_id:}``), where
the ``lp_run_id`` resolver gives

* under SLURM: ``slurm-<job id>`` (``<array job id>_<task id>`` for an array task; ``-step<N>`` for a job step), the
  same for every task and after a requeue;
* under ``torchrun``: ``torchrun-<rendezvous id>`` (``--standalone`` draws one, or ``--rdzv-id``), the same for every
  rank and after ``--max-restarts`` restarts;
* otherwise: ``<date>/<time>-<pid>``: two jobs started in the same second on one machine get different directories.

So a restarted or requeued job finds its own checkpoints and resumes (``ckpt_path`` null), and two jobs never share a
directory. Hydra's ``${now:...}`` alone repeats within a second and differs between ranks and restarts.
"""

from __future__ import annotations

import os
import time

from omegaconf import OmegaConf

__all__ = ["RUN_ID_RESOLVER", "job_run_id", "register_resolvers"]

#: Name of the OmegaConf resolver.
RUN_ID_RESOLVER = "lp_run_id"


def job_run_id(environ: dict[str, str] | None = None, now: float | None = None, pid: int | None = None) -> str:
    """This job's run id (see the module docstring); a relative path, possibly with one ``/``.

    Raises:
        ValueError: under ``torchrun`` without a rendezvous id (``--rdzv-id none``): the ranks could not agree on a
            directory; pass ``--standalone``, ``--rdzv-id <job id>`` or ``hydra.run.dir=...``.
    """
    env = os.environ if environ is None else environ
    if env.get("SLURM_JOB_ID"):
        job = env["SLURM_JOB_ID"]
        if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
            job = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
        step = f"-step{env['SLURM_STEP_ID']}" if env.get("SLURM_STEP_ID") not in (None, "") else ""
        return f"slurm-{job}{step}"
    if "TORCHELASTIC_RUN_ID" in env:
        rdzv = env["TORCHELASTIC_RUN_ID"]
        if rdzv in ("", "none"):
            raise ValueError(
                "torchrun was started without a rendezvous id (--rdzv-id none), so its ranks cannot agree on a run "
                "directory: pass --standalone or --rdzv-id <job id>, or set hydra.run.dir=..."
            )
        return f"torchrun-{rdzv}"
    t = time.localtime(time.time() if now is None else now)
    return time.strftime("%Y-%m-%d/%H-%M-%S", t) + f"-{os.getpid() if pid is None else pid}"


def register_resolvers() -> None:
    """Register the ``lp_run_id`` resolver (cached: one value per process, like Hydra's ``now``)."""
    if not OmegaConf.has_resolver(RUN_ID_RESOLVER):
        OmegaConf.register_new_resolver(RUN_ID_RESOLVER, lambda: job_run_id(), use_cache=True)
