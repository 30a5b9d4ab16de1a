"""Fault tolerance across replica groups (torchft): each group its own world, gradients averaged over the live ones.

Each replica group is a whole world of its own (its own launcher: ``torchrun`` job, Lightning launcher) running the
dp mode inside it (``ddp``, ``zero1``, ``zero2``, ``zero3`` over the group's dp ranks), optionally with tensor
parallelism. Across groups nothing is a process group of ours: torchft's :class:`torchft.Manager` (one per rank) asks
the lighthouse (the server that holds membership) for a quorum of live groups every step, and all-reduces the
gradients the optimizer will step (this rank's full gradients under ``ddp``, this rank's shard under
``zero1``/``zero2``, the local tensor of each DTensor gradient shard after FSDP2's reduce-scatter under ``zero3`` or
tp) with the rank of the same position in every other live group (every group has the same layout, so that rank
holds the same shards). A group that dies or hangs drops out of the next quorum; the others finish with the groups
that remain (the gradient mean over the live groups) and keep stepping. A restarted group joins at a step boundary:
its manager receives the parameters, the optimizer state (local shards, copied in place into its own), Lightning's
step counter and the lr schedulers' states of a live peer over HTTP (torchft's checkpoint transport), not from disk,
and applies them before its forward. With them come Lightning's loop counters (epoch, batch index within the epoch):
the joining group's data loader is moved to the live group's place in the data (same epoch, so the same shuffle, and
the same batch index; each group reads its own share), so it reads the batches it would have read had it never failed.

Where each part lives: :mod:`~lightning_par.fault_tolerance.options` (``strategy.fault_tolerance.*`` and the checks
before any process starts), :mod:`~lightning_par.fault_tolerance.replicas` (this rank's torchft manager and the step
protocol), :mod:`~lightning_par.fault_tolerance.data` (moving a rejoining group's loader to the live group's place),
:mod:`~lightning_par.fault_tolerance.hooks` (the component a Lightning strategy holds and calls from its hooks). This
folder imports no strategy.

torchft is an optional dependency (the ``ft`` extra); it is imported only when ``fault_tolerance.enabled``.
"""

from lightning_par.fault_tolerance.data import check_train_data, move_train_data
from lightning_par.fault_tolerance.options import (
    FaultToleranceOptions,
    check_fault_tolerance,
    check_lighthouse,
    is_loopback_host,
    url_host,
)
from lightning_par.fault_tolerance.replicas import FaultTolerantReplicas

__all__ = ["FaultToleranceOptions", "FaultTolerantReplicas", "check_fault_tolerance", "check_lighthouse",
           "check_train_data", "is_loopback_host", "move_train_data", "url_host"]
