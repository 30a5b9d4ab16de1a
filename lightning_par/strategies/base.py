"""The Lightning strategy every lightning_par strategy derives from: one process per device on a 3-D mesh.

``MeshStrategy`` owns what all our strategies share: the validated :class:`~lightning_par.parallel_dims.ParallelDims`,
the process group (with a collective timeout, so a dead rank ends the job instead of hanging it), the
``("pp", "dp", "tp")`` device mesh, data sharding over the **dp** axis only (the tp and pp ranks of one replica see
the same batch), and the collectives Lightning asks of a strategy. Subclasses implement :meth:`parallelize`, which
turns the LightningModule's network into its parallel form once the mesh exists.
"""

from __future__ import annotations

import atexit
import time
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from typing_extensions import override

from lightning_par.parallel_dims import ParallelDims, _check_int

__all__ = ["MeshStrategy"]


#: Set when Lightning reports an exception in this process: then nothing is synchronised at exit.
_FAILED: list[bool] = [False]
_EXIT_KEY = "lightning_par/exited"


def _destroy_process_group() -> None:
    """At interpreter exit, after a successful run: wait (at most 30 s) until every rank got here, then destroy the
    default process group.

    Left to interpreter finalisation, a gloo process may abort after a successful fit ("terminate called without an
    active exception"): measured here with Lightning's own DDPStrategy in 6 of 12 two-process runs. The ranks meet
    through the rendezvous store, not a collective, so a peer that is still inside a collective can never match it.
    After a failure nothing is done: the peers learn of it from the closed connections.
    """
    if _FAILED[0] or not (dist.is_available() and dist.is_initialized()):
        return
    try:
        store = dist.distributed_c10d._get_default_store()
        world = dist.get_world_size()
        store.add(_EXIT_KEY, 1)
        deadline = time.monotonic() + 30.0
        while store.add(_EXIT_KEY, 0) < world and time.monotonic() < deadline:
            time.sleep(0.02)
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort at exit (rank 0's store may already be gone)
        pass


class MeshStrategy(ParallelStrategy):
    """Base strategy: one process per device, a ``("pp", "dp", "tp")`` mesh, batches sharded over dp.

    Args:
        dp_size: data-parallel size; ``-1`` infers ``world_size // (tp_size * pp_size)``.
        tp_size: tensor-parallel size.
        pp_size: pipeline-parallel size.
        timeout_s: seconds a collective may wait for a peer before it raises (gloo and nccl), so that a dead or
            stuck rank ends the job with an error instead of a hang.
        process_group_backend: ``"gloo"`` or ``"nccl"``; default: nccl on CUDA, gloo on CPU.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: as for Lightning's
            ``DDPStrategy`` (the Trainer fills them in).

    Raises:
        ValueError: an invalid size (checked here, and against the world size in :meth:`setup_environment`,
            before the process group starts).
    """

    strategy_name: ClassVar[str] = "mesh"
    #: Lightning registry names of the class (default: ``(strategy_name,)``) and the options each name implies.
    registry_names: ClassVar[tuple[str, ...]] = ()
    registry_presets: ClassVar[dict[str, dict[str, Any]]] = {}
    #: one line for ``StrategyRegistry``'s listing.
    description: ClassVar[str] = ""

    def __init__(
        self,
        dp_size: int = -1,
        tp_size: int = 1,
        pp_size: int = 1,
        *,
        timeout_s: float = 1800.0,
        process_group_backend: str | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        # Validate each size now; their product is checked against the world size before the group starts.
        _check_int("tp_size", tp_size, 1)
        _check_int("pp_size", pp_size, 1)
        _check_int("dp_size", dp_size, 1, allow_infer=True)
        if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s!r} is not valid: expected a number of seconds > 0.")
        self._sizes = {"dp_size": dp_size, "tp_size": tp_size, "pp_size": pp_size}
        self._timeout_s = float(timeout_s)
        self._process_group_backend = process_group_backend
        self.parallel_dims: ParallelDims | None = None
        self.num_nodes = 1

    # ------------------------------------------------------------------ layout
    @property
    def is_distributed(self) -> bool:
        """Always ``True``: Lightning then injects a ``DistributedSampler`` (over the dp axis, see below)."""
        return True

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def device_mesh(self):  # noqa: ANN201 - DeviceMesh, imported lazily
        """The ``("pp", "dp", "tp")`` DeviceMesh.

        Raises:
            RuntimeError: before :meth:`setup_environment` has built it.
        """
        if self.parallel_dims is None or self.parallel_dims._mesh is None:
            raise RuntimeError("The device mesh exists only after the strategy's setup_environment().")
        return self.parallel_dims._mesh

    def resolve_parallel_dims(self, world_size: int) -> ParallelDims:
        """Validate the requested sizes against ``world_size`` (no process group needed).

        Raises:
            ValueError: the sizes do not multiply to ``world_size``; the message names the fields and values.
        """
        return ParallelDims(world_size=world_size, **self._sizes)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Shard batches over the dp axis only: every tp and pp rank of a replica reads the same samples."""
        dims = self.parallel_dims
        assert dims is not None
        return {"num_replicas": dims.dp_size, "rank": dims.coordinates(self.global_rank)["dp"]}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    # ------------------------------------------------------------------ processes
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        # Validate the layout, and the model against it, before any process group starts.
        dims = self.resolve_parallel_dims(self.num_nodes * self.num_processes)
        self.validate_model(dims)
        reset_seed()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        assert self.cluster_environment is not None
        started = not dist.is_initialized()
        _init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=timedelta(seconds=self._timeout_s)
        )
        if started:
            atexit.register(_destroy_process_group)
        dims.build_mesh(self.root_device.type)
        self.parallel_dims = dims

    @override
    def setup(self, trainer: Any) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.parallelize()
            self.setup_optimizers(trainer)
        else:
            self.parallelize_for_eval()
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Remember the failure: the exit hook then leaves the process group alone (see ``_destroy_process_group``)."""
        _FAILED[0] = True
        super().on_exception(exception)

    def validate_model(self, dims: ParallelDims) -> None:
        """Check that ``self.lightning_module`` can run under ``dims`` (e.g. heads divisible by ``tp_size``).

        Runs in :meth:`setup_environment` before the process group starts; raise ``ValueError`` naming the field, the
        value and what would be valid. Nothing to check by default.
        """

    def parallelize(self) -> None:
        """Turn ``self.model`` into its parallel form for training. Called once, after the mesh exists and before
        the optimizers are built (so they see the final parameters)."""

    def parallelize_for_eval(self) -> None:
        """As :meth:`parallelize`, for validate/test/predict; by default the same."""
        self.parallelize()

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ collectives
    def group(self, axis: str) -> dist.ProcessGroup:
        """The process group of one mesh axis (``"pp"``, ``"dp"`` or ``"tp"``) that contains this rank."""
        assert self.parallel_dims is not None
        return self.parallel_dims.get_mesh(axis).get_group()

    @override
    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def summary_extras(self) -> dict[str, Any]:
        """Strategy-specific figures for ``summary.json`` (e.g. overlap fraction, bubble); empty by default."""
        dims = self.parallel_dims
        return {} if dims is None else {"dp_size": dims.dp_size, "tp_size": dims.tp_size, "pp_size": dims.pp_size}

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register every name of :attr:`registry_names` with its preset options (names already taken are kept)."""
        for name in cls.registry_names or (cls.strategy_name,):
            if name not in strategy_registry:
                strategy_registry.register(
                    name, cls, description=cls.description, **cls.registry_presets.get(name, {})
                )
