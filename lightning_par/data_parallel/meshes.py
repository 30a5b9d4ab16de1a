"""The meshes of the data-parallel axis, by role: who averages gradients, who shards, who replicates.

With HSDP (``dp_replicate_size > 1``) the data-parallel ranks are a ``(dp_replicate, dp_shard)`` grid: one copy of the
model state is sharded over each ``dp_shard`` row and the rows are replicas of each other. Every dp mode reads the
role it needs from :class:`DataParallelMeshes`; a 1-D mesh (one group of plain data parallelism) plays every role.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_par.parallel_dims import ParallelDims

__all__ = ["DataParallelMeshes"]


@dataclass(frozen=True)
class DataParallelMeshes:
    """The data-parallel meshes of one rank.

    Attributes:
        dp: every rank whose gradients are averaged together (``dp_cp``: replicas, shards and context ranks): ``ddp``'s
            all-reduce, ZeRO-1's gradient all-reduce, the start-up broadcast from its rank 0.
        shard: the ranks one copy of the model state is sharded over (``dp_shard_cp``; ZeRO's ``N``).
        replicate: HSDP's replicas of the sharded state (``dp_replicate``), ``None`` when there is one copy.
        fsdp: FSDP2's mesh: 2-D ``(dp_replicate, dp_shard_cp)`` under HSDP, else ``shard``.
    """

    dp: DeviceMesh
    shard: DeviceMesh
    replicate: DeviceMesh | None = None
    fsdp: DeviceMesh | None = None

    @classmethod
    def from_dims(cls, dims: ParallelDims) -> DataParallelMeshes:
        """The roles on ``dims``' meshes (built)."""
        shard = dims.get_mesh("dp_shard_cp")
        if not dims.dp_replicate_enabled:
            return cls(dp=dims.get_mesh("dp_cp"), shard=shard, replicate=None, fsdp=shard)
        return cls(
            dp=dims.get_mesh("dp_cp"),
            shard=shard,
            replicate=dims.get_mesh("dp_replicate"),
            fsdp=dims.get_meshes("dp_replicate", "dp_shard_cp"),
        )

    @classmethod
    def of(cls, mesh: DeviceMesh | DataParallelMeshes) -> DataParallelMeshes:
        """``mesh`` itself, or a 1-D mesh in every role (plain data parallelism over its ranks)."""
        if isinstance(mesh, DataParallelMeshes):
            return mesh
        return cls(dp=mesh, shard=mesh, replicate=None, fsdp=mesh)
