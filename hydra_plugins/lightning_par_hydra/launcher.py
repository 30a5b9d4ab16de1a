"""``hydra/launcher=lightning_par``: a Hydra launcher that runs each sweep job as its own world of processes.

The Hydra process runs the sweep: for each job it composes the job's config, creates the job directory and logging
(Hydra's ``run_job``, as the basic launcher does), then starts ``nprocs`` processes with
:func:`lightning_par.launcher.run_distributed`. Each process gets the variables torchrun would set (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and calls the app's task
function with the job's config. Lightning then sees processes created externally and never launches again, so a
child never re-runs the command line, and therefore never the sweep (the failure behind Lightning #18175 and
Hydra #2070). Rank 0's return value is the job's return value.

Jobs run one after another, each with its own ``nprocs`` (an interpolation resolved per job: by default the job's
``parallel.world_size``), so one sweep can mix world sizes. A job whose rank raises, dies or runs past ``timeout_s``
is a failed ``JobReturn`` (Hydra reports it at the end); the following jobs still run. SIGTERM or SIGHUP to the Hydra
process stops the sweep (exit status ``128 + signal``); with the recipe, whose config has
``trainer.preemption_signal``, that signal is forwarded to the ranks, which save a checkpoint, and the sweep exits
with status 75 (:mod:`lightning_par.fault.preemption`).

In your own app::

    @hydra.main(config_path="conf", config_name="config", version_base=None)
    def main(cfg):
        trainer = L.Trainer(strategy="ddp_overlap", accelerator="cpu", devices=cfg.devices)
        ...

    python app.py -m hydra/launcher=lightning_par 'hydra.launcher.nprocs=${devices}' devices=1,2
"""

import importlib
import inspect
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

__all__ = ["LightningParLauncher", "TaskRef"]

log = logging.getLogger(__name__)

_START_METHODS = ("fork", "spawn", "forkserver")


@dataclass(frozen=True)
class TaskRef:
    """A task function by name, for ``spawn``: the function ``@hydra.main`` decorated cannot be pickled by value
    (its module attribute is the decorated wrapper), so children import the module and unwrap the attribute."""

    module: str
    qualname: str

    @classmethod
    def of(cls, fn: TaskFunction) -> "TaskRef":
        return cls(fn.__module__, fn.__qualname__)

    def resolve(self) -> TaskFunction:
        """The undecorated task function (``inspect.unwrap`` of the module attribute)."""
        obj: Any = importlib.import_module(self.module)
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return inspect.unwrap(obj)


def _rank_main(task: TaskFunction | TaskRef, cfg: DictConfig, hydra_cfg: DictConfig | None) -> Any:
    """What each rank runs: the task function on the job's config. Under ``spawn`` the child starts bare: Hydra's
    resolvers, ``HydraConfig`` (the job's ``hydra`` node) and job logging are set up again from ``hydra_cfg``.
    Lightning's loggers are re-attached to the job's log file."""
    from lightning_par.job_logging import attach_job_log

    if hydra_cfg is not None:
        setup_globals()
        HydraConfig.instance().set_config(hydra_cfg)
        configure_log(HydraConfig.get().job_logging, HydraConfig.get().verbose)
    attach_job_log(None)
    # Look like torchrun to Lightning, so that it takes the world from the environment (its torchelastic cluster
    # environment) and checks it against Trainer(devices=, num_nodes=): otherwise it builds a world of `devices`
    # ranks of which only `nprocs` exist and waits for the missing ones until the job's timeout.
    os.environ.setdefault("GROUP_RANK", os.environ.get("NODE_RANK", "0"))
    os.environ.setdefault("TORCHELASTIC_RUN_ID", f"lightning_par-hydra-{os.environ.get('MASTER_PORT', '0')}")
    fn = task.resolve() if isinstance(task, TaskRef) else task
    try:
        return fn(cfg)
    except ValueError as err:
        if "does not match the world size" not in str(err):
            raise
        world = os.environ.get("WORLD_SIZE")
        raise ValueError(
            f"hydra.launcher.nprocs={world} is not valid for this job: {err} The launcher starts hydra.launcher.nprocs "
            f"processes per job; set it to the Trainer's devices * num_nodes, e.g. hydra.launcher.nprocs=2 or an "
            f"interpolation such as 'hydra.launcher.nprocs=${{devices}}'."
        ) from err


def _check_nprocs(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"hydra.launcher.nprocs={value!r} is not valid: expected an integer >= 1 (processes per job), e.g. "
            f"hydra.launcher.nprocs=2 or an interpolation such as hydra.launcher.nprocs=${{trainer.devices}}."
        )
    return value


def _first_line(ret: JobReturn) -> str:
    """The first line of a failed job's error (``JobReturn.return_value`` re-raises it)."""
    try:
        ret.return_value
    except Exception as err:  # noqa: BLE001 - any failure of the job
        lines = str(err).strip().splitlines()
        return lines[0] if lines else type(err).__name__
    return "unknown error"


class _WorldTask:
    """The task ``run_job`` calls in the Hydra process: start the job's world, return rank 0's value."""

    def __init__(self, task_function: TaskFunction, nprocs: Any, timeout_s: float, start_method: str,
                 threads_per_rank: int | None) -> None:
        self.task_function = task_function
        self.nprocs = nprocs
        self.timeout_s = timeout_s
        self.start_method = start_method
        self.threads_per_rank = threads_per_rank
        # Hydra callbacks receive this object as the task function: show the wrapped one's module and name.
        self.__module__ = getattr(task_function, "__module__", __name__)
        self.__name__ = getattr(task_function, "__name__", "task")

    def __call__(self, cfg: DictConfig) -> Any:
        from lightning_par.launcher import LauncherSignalled, run_distributed

        nprocs = _check_nprocs(self.nprocs)
        spawn = self.start_method != "fork"
        task = TaskRef.of(self.task_function) if spawn else self.task_function
        threads = self.threads_per_rank or max(1, (os.cpu_count() or 1) // nprocs)
        try:
            results = run_distributed(
                _rank_main,
                nprocs,
                (task, cfg, HydraConfig.instance().cfg if spawn else None),
                timeout_s=self.timeout_s,
                start_method=self.start_method,
                threads_per_rank=threads,
                # The recipe's ranks agree on preemption (lightning_par.fault.preemption): forward the signal to them.
                preemption_signal=OmegaConf.select(cfg, "trainer.preemption_signal", default=None),
                preemption_grace_s=float(OmegaConf.select(cfg, "trainer.preemption_grace_s", default=60.0)),
            )
        except LauncherSignalled as stopped:
            # SIGTERM/SIGHUP to the sweep stops the sweep, not just this job (a SystemExit passes Hydra's run_job).
            log.error(f"{stopped}; the sweep stops")
            raise SystemExit(128 + stopped.signum) from stopped
        return results[0]


class LightningParLauncher(Launcher):
    """Runs the jobs of a sweep one after another, each as a fresh world of ``nprocs`` local processes.

    Args:
        nprocs: processes per job (resolved per job; see the config's default).
        timeout_s: wall-clock seconds for one job's world.
        start_method: ``"fork"``, ``"spawn"`` or ``"forkserver"``.
        threads_per_rank: ``torch.set_num_threads`` per rank; None divides the machine's cores.

    Raises:
        ValueError: an unknown ``start_method`` (at start-up); an invalid ``nprocs`` fails that job only.
    """

    def __init__(self, nprocs: Any = 1, timeout_s: Any = 3600.0, start_method: str = "fork",
                 threads_per_rank: int | None = None) -> None:
        if start_method not in _START_METHODS:
            raise ValueError(
                f"hydra.launcher.start_method={start_method!r} is not valid: expected one of {list(_START_METHODS)}."
            )
        self.start_method = start_method
        self.threads_per_rank = threads_per_rank
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None
        self.task_function: TaskFunction | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        """Run every job; return one ``JobReturn`` per job, in order (failed jobs included)."""
        setup_globals()
        assert self.config is not None and self.hydra_context is not None and self.task_function is not None
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        log.info(f"Launching {len(job_overrides)} jobs locally, each as its own world of processes")
        runs: list[JobReturn] = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(sweep_config):
                sweep_config.hydra.job.id = idx
                sweep_config.hydra.job.num = idx
            launcher_cfg = sweep_config.hydra.launcher
            nprocs = OmegaConf.select(launcher_cfg, "nprocs", throw_on_missing=True)
            timeout_s = float(OmegaConf.select(launcher_cfg, "timeout_s", default=3600.0))
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))} ({nprocs} processes)")
            task = _WorldTask(self.task_function, nprocs, timeout_s, self.start_method, self.threads_per_rank)
            ret = run_job(
                hydra_context=self.hydra_context,
                task_function=task,
                config=sweep_config,
                job_dir_key="hydra.sweep.dir",
                job_subdir_key="hydra.sweep.subdir",
            )
            if ret.status == JobStatus.FAILED:
                log.error(f"\t#{idx} failed: {_first_line(ret)}")
            runs.append(ret)
            configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return runs
