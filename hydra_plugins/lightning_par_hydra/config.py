"""Structured config of the ``lightning_par`` Hydra launcher (``hydra/launcher=lightning_par``).

No ``from __future__ import annotations`` in this package: Hydra loads plugin modules without registering them in
``sys.modules``, where ``dataclasses`` looks string annotations up.
"""

from dataclasses import dataclass
from typing import Any, Optional

from hydra.core.config_store import ConfigStore

__all__ = ["LightningParLauncherConf"]


@dataclass
class LightningParLauncherConf:
    """Options of :class:`~hydra_plugins.lightning_par_hydra.launcher.LightningParLauncher`, read per job.

    Interpolations are resolved against each job's own config, so one sweep can mix world sizes.
    """

    _target_: str = "hydra_plugins.lightning_par_hydra.launcher.LightningParLauncher"
    #: processes (ranks) of each job's world: the job's ``parallel.world_size`` (lightning_par's recipes), else 1.
    #: In your own app set it, e.g. ``hydra.launcher.nprocs=${trainer.devices}`` or ``hydra.launcher.nprocs=2``.
    nprocs: Any = "${oc.select:parallel.world_size,1}"
    #: wall-clock seconds for one job's world; past it every process is killed and the job fails.
    timeout_s: Any = "${oc.select:trainer.job_timeout_s,3600}"
    #: ``fork`` (fast, the default) or ``spawn`` (needed when the launching process has initialised CUDA).
    start_method: str = "fork"
    #: ``torch.set_num_threads`` in each rank; None: the machine's cores divided by ``nprocs``.
    threads_per_rank: Optional[int] = None


ConfigStore.instance().store(
    group="hydra/launcher", name="lightning_par", node=LightningParLauncherConf, provider="lightning_par"
)
