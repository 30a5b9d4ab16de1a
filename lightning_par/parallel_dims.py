"""One validated description of a parallel layout and the device mesh built from it.

Every strategy in lightning_par works on one ``("pp", "dp", "tp")`` mesh. The order puts the tensor-parallel axis
innermost (adjacent ranks, the fastest links on a GPU node) and the pipeline axis outermost (point-to-point traffic
only), as Megatron-LM and torchtitan do. ``ParallelDims`` is the only place a layout is validated: everything else
trusts it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lightning_par.validation import check_int

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["MESH_AXES", "ParallelDims", "broadcast_from_rank0"]

#: Names of the mesh axes, outermost first.
MESH_AXES: tuple[str, str, str] = ("pp", "dp", "tp")


@dataclass
class ParallelDims:
    """Sizes of the data-, tensor- and pipeline-parallel axes for ``world_size`` processes.

    Args:
        dp_size: data-parallel replicas (ranks that see different batches). ``-1`` infers it as
            ``world_size // (tp_size * pp_size)``.
        tp_size: ranks that split each layer's matrices (Megatron-LM, Shoeybi et al. 2019, §3).
        pp_size: pipeline stages (GPipe, Huang et al. 2019).
        world_size: total number of processes.

    Raises:
        ValueError: a size that is not a positive integer, or ``dp_size * tp_size * pp_size != world_size``. The
            message names the field, the value and what would be valid.
    """

    dp_size: int = -1
    tp_size: int = 1
    pp_size: int = 1
    world_size: int = 1
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, 1)
        check_int("tp_size", self.tp_size, 1)
        check_int("pp_size", self.pp_size, 1)
        check_int("dp_size", self.dp_size, 1, allow_infer=True)
        model_parallel = self.tp_size * self.pp_size
        if self.dp_size == -1:
            if self.world_size % model_parallel != 0:
                raise ValueError(
                    f"dp_size=-1 cannot be inferred: world_size={self.world_size} is not divisible by "
                    f"tp_size * pp_size = {self.tp_size} * {self.pp_size} = {model_parallel}. "
                    f"Choose tp_size and pp_size whose product divides {self.world_size}."
                )
            self.dp_size = self.world_size // model_parallel
        elif self.dp_size * model_parallel != self.world_size:
            valid = sorted(d for d in range(1, self.world_size + 1) if self.world_size % d == 0)
            raise ValueError(
                f"dp_size * tp_size * pp_size = {self.dp_size} * {self.tp_size} * {self.pp_size} = "
                f"{self.dp_size * model_parallel} does not equal world_size={self.world_size}. "
                f"Each size must be one of the divisors {valid} and their product must be {self.world_size}; "
                f"dp_size=-1 infers the data-parallel size."
            )

    @property
    def dp_enabled(self) -> bool:
        return self.dp_size > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp_size > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp_size > 1

    @property
    def shape(self) -> tuple[int, int, int]:
        """Mesh shape in :data:`MESH_AXES` order ``(pp_size, dp_size, tp_size)``."""
        return (self.pp_size, self.dp_size, self.tp_size)

    def coordinates(self, rank: int) -> dict[str, int]:
        """Position of global ``rank`` on each axis, e.g. ``{"pp": 1, "dp": 0, "tp": 1}``.

        Raises:
            ValueError: ``rank`` outside ``[0, world_size)``.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is not valid: expected 0 <= rank < world_size={self.world_size}.")
        pp, rest = divmod(rank, self.dp_size * self.tp_size)
        dp, tp = divmod(rest, self.tp_size)
        return {"pp": pp, "dp": dp, "tp": tp}

    def build_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """Build the ``("pp", "dp", "tp")`` mesh over the default process group (which must exist).

        Axes of size 1 are kept, so ``mesh["dp"]`` always works. The mesh is cached on this object.

        Raises:
            RuntimeError: the default process group is missing or its size differs from ``world_size``.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise RuntimeError("ParallelDims.build_mesh needs an initialized default process group.")
        if dist.get_world_size() != self.world_size:
            raise RuntimeError(
                f"The process group has {dist.get_world_size()} ranks but ParallelDims.world_size={self.world_size}."
            )
        if self._mesh is None or self._mesh.device_type != device_type:
            self._mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_AXES)
        return self._mesh

    def get_mesh(self, axis: str) -> DeviceMesh:
        """The 1-D sub-mesh of ``axis`` ("pp", "dp" or "tp") that contains this rank.

        Raises:
            ValueError: ``axis`` is not one of :data:`MESH_AXES`.
            RuntimeError: :meth:`build_mesh` has not run.
        """
        if axis not in MESH_AXES:
            raise ValueError(f"axis={axis!r} is not valid: expected one of {list(MESH_AXES)}.")
        if self._mesh is None:
            raise RuntimeError("ParallelDims.get_mesh called before build_mesh.")
        return self._mesh[axis]


def broadcast_from_rank0(module: nn.Module, group: ProcessGroup) -> None:
    """Give every rank of ``group`` (one mesh axis: dp or tp) the parameters and buffers of the group's rank 0, in
    place (a DTensor's local shard); a no-op for a group of one."""
    import torch.distributed as dist
    from lightning_par.compat import local_tensor

    if dist.get_world_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0)
    for t in list(module.parameters()) + list(module.buffers()):
        local = local_tensor(t)
        dist.broadcast(local.data, src=src, group=group)
