"""One validated description of a parallel layout: named mesh axes, and the meshes built from them, by name.

The mesh axes, outermost first (:data:`MESH_AXES`):

========================  ===========================================================================================
axis (size field)         what its ranks share
========================  ===========================================================================================
``pp`` (``pp_size``)      nothing but activations: each holds other layers (pipeline stages; GPipe, Huang et al. 2019)
``dp_replicate``          whole copies of the model state (HSDP's replicas: gradients all-reduced across them)
``dp_shard``              one copy of the model state split between them (ZeRO's ``N``; Rajbhandari et al. 2020)
``cp`` (``cp_size``)      one sequence split between them (context parallelism)
``tp`` (``tp_size``)      each layer's matrices split between them (Megatron-LM, Shoeybi et al. 2019, §3)
========================  ===========================================================================================

``dp_size = dp_replicate_size * dp_shard_size`` is the user-facing size of plain data parallelism (ranks that read
different batches). The tensor-parallel axis is innermost (adjacent ranks: the fastest links on a GPU node), the
pipeline axis outermost (point-to-point traffic only), as Megatron-LM and torchtitan order them.

Derived meshes, each one flattened axis built once (:data:`DERIVED_MESHES`): ``dp`` (batches, ``ddp``'s all-reduce),
``dp_shard_cp`` (ZeRO's sharding and gradient reduction group) and ``dp_cp`` (loss averaging). Everything asks for a
mesh by name through :meth:`ParallelDims.get_mesh`; no other module lists the axes.

Expert parallelism (``ep_size``) borrows its ranks from ``dp_shard x cp`` (as torchtitan and Megatron-core's
expert-data-parallel do): the ``dp_shard_cp`` ranks are regrouped into ``(edp_shard, ep)``, ``ep`` innermost, on a
second mesh of the same ranks (:data:`EXPERT_MESHES`): ``ep`` holds different experts and exchanges tokens,
``edp_shard`` holds the same experts (their ZeRO ``N``), ``edp`` (``dp_replicate x edp_shard``) averages their
gradients.

````ParallelDims`` is the only place a layout is validated: everything else trusts it. Importing this module imports no
torch (the planner uses it without one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from lightning_par.validation import check_int

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "AXIS_OF_SIZE", "DERIVED_MESHES", "EXPERT_MESHES", "MESH_AXES", "SIZE_FIELDS", "ParallelDims", "broadcast_from_rank0"
]

#: Names of the mesh axes, outermost first.
MESH_AXES: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
#: The meshes built in this process, by (device type, mesh shape, ep size), for the default process group under
#: ``"world"`` (another default group, after a destroy and a new init, empties it): see ParallelDims.build_mesh.
_MESHES: dict = {}
_RETIRED: list[dict] = []

#: The size field of each axis.
SIZE_FIELDS: dict[str, str] = {axis: f"{axis}_size" for axis in MESH_AXES}
#: The axis of each size field.
AXIS_OF_SIZE: dict[str, str] = {size: axis for axis, size in SIZE_FIELDS.items()}

#: Flattened meshes: name -> the axes it spans (outermost first).
DERIVED_MESHES: dict[str, tuple[str, ...]] = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}

#: Meshes of expert parallelism (built when ``ep_size > 1``): ``ep`` (ranks holding different experts), ``edp_shard``
#: (ranks holding the same experts, within one ``dp_shard x cp`` group) and ``edp`` (``dp_replicate x edp_shard``: every
#: rank holding the same experts).
EXPERT_MESHES: tuple[str, ...] = ("ep", "edp_shard", "edp")


@dataclass
class ParallelDims:
    """The sizes of the mesh axes for ``world_size`` processes, validated once.

    Args:
        dp_size: data-parallel ranks (different batches), ``dp_replicate_size * dp_shard_size``. ``-1`` infers it as
            ``world_size // (pp_size * cp_size * tp_size)``.
        tp_size: ranks that split each layer's matrices.
        pp_size: pipeline stages.
        world_size: total number of processes.
        dp_replicate_size: HSDP replicas: groups of ``dp_shard_size`` ranks that each hold one sharded copy.
        dp_shard_size: ranks one copy of the model state is sharded over (ZeRO's ``N``); ``-1`` infers it as
            ``dp_size // dp_replicate_size``.
        cp_size: ranks one sequence is split over.
        ep_size: ranks the experts of each mixture-of-experts layer are split over, borrowed from ``dp_shard x cp``
            (it does not multiply into ``world_size``).

    Raises:
        ValueError: a size that is not a positive integer (or ``-1`` where it may be inferred), sizes whose product is
            not ``world_size``, ``dp_replicate_size`` not dividing ``dp_size``, or ``ep_size`` not dividing
            ``dp_shard_size * cp_size``. The message names the fields, the values and what would be valid.
    """

    dp_size: int = -1
    tp_size: int = 1
    pp_size: int = 1
    world_size: int = 1
    dp_replicate_size: int = 1
    dp_shard_size: int = -1
    cp_size: int = 1
    ep_size: int = 1

    def __post_init__(self) -> None:
        # The mesh cache: plain attributes, not fields, so that this class is also the recipe's ``parallel`` schema
        # (lightning_par.config.schema), whose nodes hold the sizes only.
        self._mesh: DeviceMesh | None = None
        self._meshes: dict[str, DeviceMesh] = {}
        check_int("world_size", self.world_size, 1)
        for name in ("tp_size", "pp_size", "cp_size", "dp_replicate_size", "ep_size"):
            check_int(name, getattr(self, name), 1)
        check_int("dp_size", self.dp_size, 1, allow_infer=True)
        check_int("dp_shard_size", self.dp_shard_size, 1, allow_infer=True)
        model = [("pp_size", self.pp_size), ("cp_size", self.cp_size), ("tp_size", self.tp_size)]
        shown = [(n, v) for n, v in model if n != "cp_size" or v != 1][::-1]  # tp first, as users write it
        model_parallel = math.prod(v for _, v in model)
        if self.dp_size == -1 and self.dp_shard_size != -1:
            self.dp_size = self.dp_replicate_size * self.dp_shard_size
        if self.dp_size == -1:
            if self.world_size % model_parallel != 0:
                names = " * ".join(n for n, _ in shown)
                values = " * ".join(str(v) for _, v in shown)
                raise ValueError(
                    f"dp_size=-1 cannot be inferred: world_size={self.world_size} is not divisible by "
                    f"{names} = {values} = {model_parallel}. "
                    f"Choose {' and '.join(n for n, _ in shown)} whose product divides {self.world_size}."
                )
            self.dp_size = self.world_size // model_parallel
        elif self.dp_size * model_parallel != self.world_size:
            valid = sorted(d for d in range(1, self.world_size + 1) if self.world_size % d == 0)
            names = " * ".join(["dp_size", *(n for n, _ in shown)])
            values = " * ".join(str(v) for v in [self.dp_size, *(v for _, v in shown)])
            raise ValueError(
                f"{names} = {values} = {self.dp_size * model_parallel} does not equal world_size={self.world_size}. "
                f"Each size must be one of the divisors {valid} and their product must be {self.world_size}; "
                f"dp_size=-1 infers the data-parallel size."
            )
        if self.dp_size % self.dp_replicate_size != 0:
            valid = [d for d in range(1, self.dp_size + 1) if self.dp_size % d == 0]
            raise ValueError(
                f"dp_replicate_size={self.dp_replicate_size} is not valid with dp_size={self.dp_size}: expected a "
                f"divisor of dp_size, one of {valid} (dp_size = dp_replicate_size * dp_shard_size)."
            )
        shard = self.dp_size // self.dp_replicate_size
        if self.dp_shard_size == -1:
            self.dp_shard_size = shard
        elif self.dp_shard_size != shard:
            raise ValueError(
                f"dp_shard_size={self.dp_shard_size} is not valid: dp_size={self.dp_size} with "
                f"dp_replicate_size={self.dp_replicate_size} leaves dp_shard_size={shard} "
                f"(dp_size = dp_replicate_size * dp_shard_size); set dp_shard_size={shard} or -1."
            )
        borrowed = self.dp_shard_size * self.cp_size
        if borrowed % self.ep_size:
            valid = [d for d in range(1, borrowed + 1) if borrowed % d == 0]
            raise ValueError(
                f"ep_size={self.ep_size} is not valid: expert parallelism borrows its ranks from dp_shard_size * "
                f"cp_size = {self.dp_shard_size} * {self.cp_size} = {borrowed}; expected a divisor of it, one of "
                f"{valid}."
            )

    # ------------------------------------------------------------------ sizes
    @classmethod
    def size_names(cls) -> tuple[str, ...]:
        """Every size field a layout is given by (``dp_size``, ``tp_size``, ..., ``ep_size``), in declaration order."""
        return tuple(f.name for f in fields(cls) if f.init and f.name != "world_size")

    def size(self, axis: str) -> int:
        """The size of a mesh axis or derived mesh (``"dp"`` is ``dp_size``).

        Raises:
            ValueError: an unknown name.
        """
        if axis in DERIVED_MESHES:
            return math.prod(self.size(a) for a in DERIVED_MESHES[axis])
        if axis in EXPERT_MESHES:
            edp_shard = self.dp_shard_size * self.cp_size // self.ep_size
            return {"ep": self.ep_size, "edp_shard": edp_shard, "edp": self.dp_replicate_size * edp_shard}[axis]
        self._check_name(axis)
        return getattr(self, SIZE_FIELDS[axis])

    def stride(self, name: str) -> int:
        """Distance in global rank order between consecutive ranks of one group of ``name`` (an axis or a derived
        mesh): the product of the sizes of the axes inside it (``tp``: 1; ``dp``: ``cp_size * tp_size``). A group
        spans ``size(name) * stride(name)`` consecutive ranks.

        Raises:
            ValueError: an unknown name.
        """
        self._check_name(name)
        if name in ("ep", "edp_shard"):  # the inner and outer parts of dp_shard_cp
            return self.tp_size * (self.ep_size if name == "edp_shard" else 1)
        if name == "edp":
            if self.dp_replicate_enabled:
                raise ValueError("stride('edp') is not valid under HSDP: its ranks (dp_replicate x edp_shard) are not "
                                 "evenly spaced; use stride('edp_shard') and stride('dp_replicate').")
            return self.stride("edp_shard")
        innermost = DERIVED_MESHES.get(name, (name,))[-1]
        return math.prod(self.size(a) for a in MESH_AXES[MESH_AXES.index(innermost) + 1:])

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
    def cp_enabled(self) -> bool:
        return self.cp_size > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep_size > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        """HSDP: more than one replica of the sharded model state."""
        return self.dp_replicate_size > 1

    @property
    def shape(self) -> tuple[int, ...]:
        """Mesh shape in :data:`MESH_AXES` order."""
        return tuple(self.size(axis) for axis in MESH_AXES)

    def sizes(self) -> dict[str, int]:
        """Every size field that is not 1, plus ``dp_size``: ``{"dp_size": 2, "tp_size": 2}`` (what a checkpoint's
        record and ``summary.json`` keep)."""
        out = {"dp_size": self.dp_size}
        out.update({SIZE_FIELDS[a]: self.size(a) for a in MESH_AXES if a != "dp_shard" and self.size(a) > 1})
        if self.ep_size > 1:
            out["ep_size"] = self.ep_size
        return out

    def coordinates(self, rank: int) -> dict[str, int]:
        """Position of global ``rank`` on each axis and derived mesh, e.g. ``{"pp": 1, "dp_replicate": 0,
        "dp_shard": 1, "cp": 0, "tp": 1, "dp": 1, ...}``.

        Raises:
            ValueError: ``rank`` outside ``[0, world_size)``.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is not valid: expected 0 <= rank < world_size={self.world_size}.")
        coords: dict[str, int] = {}
        rest = rank
        for axis in reversed(MESH_AXES):  # innermost varies fastest
            rest, coords[axis] = divmod(rest, self.size(axis))
        for name, axes in DERIVED_MESHES.items():
            index = 0
            for axis in axes:
                index = index * self.size(axis) + coords[axis]
            coords[name] = index
        return {axis: coords[axis] for axis in (*MESH_AXES, *DERIVED_MESHES)}

    # ------------------------------------------------------------------ meshes
    def build_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """Build the mesh of :data:`MESH_AXES` over the default process group (which must exist) and the derived
        meshes. Axes of size 1 are kept, so every name always resolves. Cached on this object.

        Raises:
            RuntimeError: the default process group is missing or its size differs from ``world_size``.
        """
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from lightning_par.compat import flatten_mesh

        if not dist.is_initialized():
            raise RuntimeError("ParallelDims.build_mesh needs an initialized default process group.")
        if dist.get_world_size() != self.world_size:
            raise RuntimeError(
                f"The process group has {dist.get_world_size()} ranks but ParallelDims.world_size={self.world_size}."
            )
        if self._mesh is None or self._mesh.device_type != device_type:
            # One set of meshes per layout and default process group in a process: each Trainer (fit, validate,
            # test, a second Trainer) resolves its own ParallelDims, and building the meshes again would start
            # another set of process groups each time, never freed (measured: a world-8 run of 26 fits held 185
            # gloo groups and 555 threads per rank, and its collectives slowed as they grew).
            world = dist.group.WORLD
            key = (device_type, self.shape, self.ep_size)
            if _MESHES.get("world") is not world:
                # retired, not freed: in a process forked from one that built them, dropping the last reference
                # would destroy process groups whose threads only the parent has (the rank would hang there)
                _RETIRED.append(dict(_MESHES))
                _MESHES.clear()
                _MESHES["world"] = world
            if key not in _MESHES:
                mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_AXES)
                self._mesh, self._meshes = mesh, {axis: mesh[axis] for axis in MESH_AXES}
                for name, axes in DERIVED_MESHES.items():
                    self._meshes[name] = flatten_mesh(mesh[axes], name)
                if self.ep_enabled:
                    self._build_expert_meshes(mesh)
                _MESHES[key] = (mesh, dict(self._meshes))
            mesh, meshes = _MESHES[key]
            self._mesh, self._meshes = mesh, dict(meshes)
        return self._mesh

    def _build_expert_meshes(self, mesh: DeviceMesh) -> None:
        """The ``dp_shard x cp`` ranks regrouped into ``(edp_shard, ep)`` on a second mesh of the same ranks."""
        from torch.distributed.device_mesh import DeviceMesh

        from lightning_par.compat import flatten_mesh

        pp, replicate, shard, cp, tp = self.shape
        ranks = mesh.mesh.reshape(pp, replicate, shard * cp // self.ep_size, self.ep_size, tp)
        expert = DeviceMesh(mesh.device_type, ranks, mesh_dim_names=("pp", "dp_replicate", "edp_shard", "ep", "tp"))
        self._meshes["ep"] = expert["ep"]
        self._meshes["edp_shard"] = expert["edp_shard"]
        self._meshes["edp"] = flatten_mesh(expert["dp_replicate", "edp_shard"], "edp")
        self._meshes["dp_replicate_edp_shard"] = expert["dp_replicate", "edp_shard"]

    def get_mesh(self, name: str) -> DeviceMesh:
        """The 1-D mesh of an axis of :data:`MESH_AXES` or a derived mesh of :data:`DERIVED_MESHES` that contains
        this rank.

        Raises:
            ValueError: an unknown name.
            RuntimeError: :meth:`build_mesh` has not run.
        """
        self._check_name(name)
        if self._mesh is None:
            raise RuntimeError("ParallelDims.get_mesh called before build_mesh.")
        if name in EXPERT_MESHES and not self.ep_enabled:
            raise RuntimeError(f"ParallelDims.get_mesh({name!r}): the expert meshes exist only when ep_size > 1.")
        return self._meshes[name]

    def get_meshes(self, *names: str) -> DeviceMesh:
        """The multi-dimensional mesh over ``names`` (axes or derived meshes, outermost first), e.g. HSDP's
        ``("dp_replicate", "dp_shard_cp")``.

        Raises:
            ValueError, RuntimeError: as :meth:`get_mesh`.
        """
        for name in names:
            self.get_mesh(name)
        assert self._mesh is not None
        return self._mesh[names]

    def group(self, name: str) -> ProcessGroup:
        """The process group of :meth:`get_mesh` ``(name)``."""
        return self.get_mesh(name).get_group()

    def expert_meshes(self) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh | None, DeviceMesh]:
        """``(ep, edp_shard, dp_replicate or None, fsdp)`` of the experts: their ep mesh, the ranks their state is
        sharded over, HSDP's replicas, and FSDP2's mesh (2-D ``(dp_replicate, edp_shard)`` under HSDP).

        Raises:
            RuntimeError: ``ep_size == 1`` or :meth:`build_mesh` has not run.
        """
        if self._mesh is None or not self.ep_enabled:
            raise RuntimeError("ParallelDims.expert_meshes needs ep_size > 1 and build_mesh first.")
        replicate = self._meshes["dp_replicate"] if self.dp_replicate_enabled else None
        fsdp = self._meshes["dp_replicate_edp_shard"] if replicate is not None else self._meshes["edp_shard"]
        return self._meshes["ep"], self._meshes["edp_shard"], replicate, fsdp

    def _check_name(self, name: str) -> None:
        if name not in MESH_AXES and name not in DERIVED_MESHES and name not in EXPERT_MESHES:
            raise ValueError(
                f"axis={name!r} is not valid: expected one of {[*MESH_AXES, *DERIVED_MESHES, *EXPERT_MESHES]}."
            )


def broadcast_from_rank0(module: nn.Module, group: ProcessGroup, skip: set[int] | frozenset[int] = frozenset()) -> None:
    """Give every rank of ``group`` (the ranks of one mesh axis or derived mesh) the parameters and buffers of the
    group's rank 0, in place (a DTensor's local shard), except the tensors whose ``id`` is in ``skip``; a no-op for a
    group of one."""
    import torch
    import torch.distributed as dist

    from lightning_par.compat import local_tensor

    if dist.get_world_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0)
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) in skip:
            continue
        data = local_tensor(t).data
        flatten = getattr(data, "__tensor_flatten__", None)
        if callable(flatten) and type(data) is not torch.Tensor:
            # a tensor subclass holding plain tensors (torchao's NF4Tensor of a QLoRA base): it has no collectives of
            # its own ("NF4Tensor dispatch: attempting to run c10d.broadcast_"), so its inner tensors are broadcast
            for name in flatten()[0]:
                dist.broadcast(getattr(data, name), src=src, group=group)
            continue
        dist.broadcast(data, src=src, group=group)
