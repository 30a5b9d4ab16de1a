"""The register's Lightning Fabric part: the private names of ``lightning.fabric`` the package uses, under public
names of ours. Imports ``lightning.fabric`` only (never ``lightning.pytorch``), so the Fabric adapter can use it.

Checked on lightning 2.6.6 (the lock); each entry of :data:`PRIVATE_USES` is looked up by the canary in
tests/compat/test_private_api.py, which fails naming the entry when upstream moves it.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device

from lightning_par.compat.register import PrivateName

__all__ = [
    "PRIVATE_USES",
    "BackwardSyncControl",
    "FabricSubprocessScriptLauncher",
    "default_process_group_backend_for_device",
    "fabric_module_strategy",
    "distributed_is_initialized",
    "init_dist_connection",
    "optimizers_to_device",
    "sync_ddp_if_available",
]

_CHECKED = "lightning 2.6.6"
_DISTRIBUTED = "lightning.fabric.utilities.distributed"

#: Fabric's process-group start as its own strategies call it (``(cluster_environment, backend, timeout=...)``).
init_dist_connection = _init_dist_connection
#: ``torch.distributed.is_available() and is_initialized()``.
distributed_is_initialized = _distributed_is_initialized
#: ``"nccl"`` for CUDA, ``"gloo"`` otherwise (Fabric's choice).
default_process_group_backend_for_device = _get_default_process_group_backend_for_device
#: Fabric's reduction of a tensor over a group when one exists (``reduce_op`` ``"mean"``/``"sum"``).
sync_ddp_if_available = _sync_ddp_if_available
#: Moves every optimizer state tensor to a device.
optimizers_to_device = _optimizers_to_device
#: Fabric's launcher that re-runs the script per rank (``lightning.fabric``'s, not the Trainer's).
FabricSubprocessScriptLauncher = _SubprocessScriptLauncher
#: Fabric's base of a strategy's ``no_backward_sync`` control.
BackwardSyncControl = _BackwardSyncControl



def fabric_module_strategy(module: Any) -> Any:
    """The strategy of a module Fabric's ``setup`` wrapped (``_FabricModule._strategy``), ``None`` for another."""
    return getattr(module, "_strategy", None)


PRIVATE_USES: tuple[PrivateName, ...] = (
    PrivateName("lightning", "lightning.fabric.wrappers._FabricModule", "_strategy", "instance", _CHECKED,
                "fabric_module_strategy"),
    PrivateName("lightning", _DISTRIBUTED, "_init_dist_connection", "attribute", _CHECKED, "init_dist_connection"),
    PrivateName("lightning", _DISTRIBUTED, "_distributed_is_initialized", "attribute", _CHECKED,
                "distributed_is_initialized"),
    PrivateName("lightning", _DISTRIBUTED, "_get_default_process_group_backend_for_device", "attribute", _CHECKED,
                "default_process_group_backend_for_device"),
    PrivateName("lightning", _DISTRIBUTED, "_sync_ddp_if_available", "attribute", _CHECKED, "sync_ddp_if_available"),
    PrivateName("lightning", "lightning.fabric.utilities.optimizer", "_optimizers_to_device", "attribute", _CHECKED,
                "optimizers_to_device"),
    PrivateName("lightning", "lightning.fabric.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher",
                "attribute", _CHECKED, "FabricSubprocessScriptLauncher"),
    PrivateName("lightning", "lightning.fabric.strategies.strategy.Strategy", "_configure_launcher", "attribute",
                _CHECKED, "an override in lightning_par.fabric.strategy.MeshStrategy"),
    PrivateName("lightning", "lightning.fabric.strategies.strategy", "_BackwardSyncControl", "attribute", _CHECKED,
                "BackwardSyncControl"),
)
