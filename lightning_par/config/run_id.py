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

import hashlib
import os
import re
import time

from omegaconf import OmegaConf

__all__ = ["JOB_DIR_RESOLVER", "RUN_ID_RESOLVER", "job_dir_name", "job_run_id", "register_resolvers"]

#: Name of the OmegaConf resolver.
RUN_ID_RESOLVER = "lp_run_id"
#: Name of the resolver of a sweep job's directory name (``hydra.sweep.subdir``).
JOB_DIR_RESOLVER = "lp_job_dir"
#: Longest job directory name (file systems allow 255 bytes a name).
JOB_DIR_MAX = 96


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


def job_dir_name(num: int | str, overrides: str = "", max_len: int = JOB_DIR_MAX) -> str:
    """A sweep job's directory name: ``<num>_<overrides>``, one path component of at most ``max_len`` characters.

    ``overrides`` (Hydra's ``override_dirname``) is kept readable where it can be: ``/`` and characters outside
    ``[A-Za-z0-9._,=+-]`` become ``_`` (a swept ``data.path=/a/b`` would otherwise nest directories), and a name too
    long (13 overrides already passed the 255-byte limit of a file name) is cut and ends with 8 hex digits of the
    overrides' SHA-1. The job number keeps names unique within a sweep.
    """
    prefix = f"{num}_" if overrides else str(num)
    slug = re.sub(r"[^A-Za-z0-9._,=+-]", "_", str(overrides))
    if len(prefix) + len(slug) > max_len:
        digest = hashlib.sha1(str(overrides).encode()).hexdigest()[:8]
        slug = slug[: max(0, max_len - len(prefix) - 9)] + "-" + digest
    return (prefix + slug)[:max_len]


def register_resolvers() -> None:
    """Register the ``lp_run_id`` resolver (cached: one value per process, like Hydra's ``now``) and ``lp_job_dir``
    (:func:`job_dir_name`)."""
    if not OmegaConf.has_resolver(RUN_ID_RESOLVER):
        OmegaConf.register_new_resolver(RUN_ID_RESOLVER, lambda: job_run_id(), use_cache=True)
    if not OmegaConf.has_resolver(JOB_DIR_RESOLVER):
        OmegaConf.register_new_resolver(JOB_DIR_RESOLVER, lambda num, overrides="": job_dir_name(num, overrides or ""))
