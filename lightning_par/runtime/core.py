"""``StrategyCore``: a strategy's keywords, validated before any process starts, whatever the host.

Lightning's :class:`lightning_par.strategies.MeshStrategy` is a ``StrategyCore`` (and so every preset of it); the
Fabric strategy (:class:`lightning_par.fabric.MeshStrategy`) holds one as its ``core``. Both then take the same
keywords, raise the same ``ValueError``\\ s, resolve the same layout and run :func:`~lightning_par.parallelize.
parallelize` with the same options.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any, ClassVar

from lightning_par.axes import check_options, check_sizes
from lightning_par.parallel_dims import ParallelDims
from lightning_par.parallelize import OPTION_GROUPS, ParallelOptions
from lightning_par.precision import fsdp_mixed_precision
from lightning_par.validation import MAX_TIMEOUT_S, check_number

__all__ = ["StrategyCore"]


class StrategyCore:
    """The sizes, the option groups and the process-group settings of a strategy: the keywords of
    :class:`lightning_par.strategies.MeshStrategy` (the Trainer's), of its presets and of
    :class:`lightning_par.fabric.MeshStrategy`.

    Args:
        dp_size: data-parallel ranks (different batches), ``dp_replicate_size * dp_shard_size``; ``-1`` infers
            ``world_size // (pp_size * cp_size * tp_size)``.
        tp_size: tensor-parallel ranks per stage.
        pp_size: pipeline ranks.
        dp_mode: ``"ddp"`` (bucketed all-reduce overlapped with backward), ``"zero1"``, ``"zero2"`` or ``"zero3"``.
        dp_replicate_size: HSDP replicas (``> 1``: each dp mode shards within ``dp_shard`` and reduces across the
            replicas; ``ddp`` all-reduces over all of them).
        dp_shard_size: ranks the model state is sharded over (ZeRO's ``N``); ``-1``: ``dp_size // dp_replicate_size``.
        module_attr: attribute of the LightningModule (or Fabric's module) holding the network (see
            :mod:`lightning_par.contract`).
        activation_checkpointing: ``"none"``, ``"full"`` (recompute every block in backward) or ``"selective"`` (the
            attention of every block); applied after tensor parallelism and before the dp mode.
        timeout_s: seconds a collective may wait for a peer before it raises (gloo and nccl), so that a dead or
            stuck rank ends the job with an error instead of a hang.
        prog_bar: also show the strategy's own figures (``parallel/...``) in the progress bar.
        process_group_backend: ``"gloo"`` or ``"nccl"``; default: nccl on CUDA, gloo on CPU.
        **options: the size of every further registered axis (a size field of
            :class:`~lightning_par.parallel_dims.ParallelDims`: ``cp_size`` context-parallel ranks, ``ep_size``
            expert-parallel ranks borrowed from ``dp_shard_size * cp_size``; 1 by default), and the option groups,
            flat or nested (:data:`lightning_par.parallelize.OPTION_GROUPS`):
            ``reducer`` (``bucket_cap_mb``, ``gradient_as_bucket_view``, ``static_graph``, ``comm_hook``,
            ``powersgd_rank``, ``powersgd_start_iter``), ``zero`` (``cpu_offload``, ``mixed_precision``,
            ``reshard_after_forward``), ``tensor_parallel`` (``sequence_parallel``, ``plan``), ``pipeline``
            (``schedule``, ``num_microbatches``, ``virtual_stages``, ``split``, ``split_timeout_s``,
            ``measure_bubble``), ``compile`` (``enabled``, ``backend``, ``mode``, ``fullgraph``; given nested only,
            ``compile={"enabled": True}``: ``torch.compile`` of every block, docs/compile.md).

    Raises:
        ValueError: an invalid size, option or combination, or a size or option of an axis this strategy does not
            have; the message names the field, the value and what is valid.
    """

    strategy_name: ClassVar[str] = "mesh"
    #: The registered axes (``Axis.name``) this strategy refuses: a preset named for one classic technique excludes the
    #: other classic axes (``tp``, ``pp``); every other registered axis (``cp``, ``ep``, the next one) is in every preset.
    excluded_axes: ClassVar[frozenset[str]] = frozenset()
    #: Registry names of the class and the options each name implies.
    registry_names: ClassVar[tuple[str, ...]] = ()
    registry_presets: ClassVar[dict[str, dict[str, Any]]] = {}
    #: one line for a registry's listing.
    description: ClassVar[str] = ""

    def __init__(
        self,
        dp_size: int = -1,
        tp_size: int = 1,
        pp_size: int = 1,
        dp_mode: str = ParallelOptions.dp_mode,
        *,
        dp_replicate_size: int = 1,
        dp_shard_size: int = -1,
        module_attr: str | None = ParallelOptions.module_attr,
        activation_checkpointing: str = ParallelOptions.activation_checkpointing,
        timeout_s: float = 1800.0,
        prog_bar: bool = False,
        process_group_backend: str | None = None,
        **options: Any,
    ) -> None:
        sizes = {"dp_size": dp_size, "tp_size": tp_size, "pp_size": pp_size}
        further = {"dp_replicate_size": dp_replicate_size, "dp_shard_size": dp_shard_size,
                   **{k: options.pop(k) for k in [k for k in options if k in ParallelDims.size_names()]}}
        defaults = {f.name: f.default for f in fields(ParallelDims)}
        sizes.update({k: v for k, v in further.items() if v != defaults[k]})  # the further sizes given
        self.check_axes(sizes)
        check_options(options, OPTION_GROUPS, self.has_axis, type(self).__name__)
        self.options = ParallelOptions.build(dp_mode, module_attr, activation_checkpointing, **options)
        self.options.check_layout(pp_size)
        self._sizes = sizes
        self._timeout_s = check_number("timeout_s", timeout_s, unit="seconds", maximum=MAX_TIMEOUT_S)
        self.prog_bar = bool(prog_bar)
        self._process_group_backend = process_group_backend
        self.parallel_dims: ParallelDims | None = None
        self._planned_dims: ParallelDims | None = None  # the caller's layout (use_parallel_dims), meshed in setup

    @classmethod
    def has_axis(cls, name: str) -> bool:
        """Whether this strategy may use the registered axis ``name``."""
        return name not in cls.excluded_axes

    @classmethod
    def check_axes(cls, sizes: dict[str, Any], prefix: str = "", label: str | None = None) -> None:
        """Refuse a size > 1 on an axis this strategy does not have (:func:`lightning_par.axes.check_sizes`).

        Raises:
            ValueError: naming the field, the value, and what would be valid.
        """
        check_sizes(sizes, cls.has_axis, prefix, label or cls.__name__)

    @property
    def dp_mode(self) -> str:
        return self.options.dp_mode

    @property
    def timeout_s(self) -> float:
        """Seconds a collective may wait for a peer before it raises (the process group's timeout)."""
        return self._timeout_s

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @process_group_backend.setter
    def process_group_backend(self, backend: str | None) -> None:
        self._process_group_backend = backend

    @property
    def precision(self) -> str:
        """The host's precision string (``"32-true"`` where the host has none)."""
        return "32-true"

    @property
    def device_mesh(self):  # noqa: ANN201 - DeviceMesh, imported lazily
        """The DeviceMesh of :data:`~lightning_par.parallel_dims.MESH_AXES`.

        Raises:
            RuntimeError: before the host's ``setup_environment()`` has built it.
        """
        if self.parallel_dims is None or self.parallel_dims._mesh is None:
            raise RuntimeError("The device mesh exists only after the strategy's setup_environment().")
        return self.parallel_dims._mesh

    @classmethod
    def registry_entries(cls, registry: Any) -> list[tuple[str, dict[str, Any]]]:
        """``(name, the options it implies)`` of each registry name of this class that ``registry`` does not hold."""
        return [(n, cls.registry_presets.get(n, {})) for n in cls.registry_names or (cls.strategy_name,)
                if n not in registry]

    def group(self, axis: str) -> Any:
        """The process group of one mesh axis or derived mesh (:meth:`ParallelDims.get_mesh`) containing this rank."""
        assert self.parallel_dims is not None
        return self.parallel_dims.group(axis)

    def resolve_parallel_dims(self, world_size: int) -> ParallelDims:
        """Validate the requested sizes against ``world_size`` (no process group needed); the layout handed in by
        :meth:`use_parallel_dims` when it is for this world and has no mesh yet (one ParallelDims per process).

        Raises:
            ValueError: the sizes do not multiply to ``world_size``; the message names the fields and values.
        """
        planned = self._planned_dims
        if planned is not None and planned.world_size == world_size and planned._mesh is None:
            return planned
        return ParallelDims(world_size=world_size, **self._sizes)

    def use_parallel_dims(self, dims: ParallelDims) -> None:
        """Take ``dims``, validated by the caller from the same sizes (the recipe's ``parallel`` group), as this
        process's layout: the host's ``setup_environment`` builds the mesh on it instead of validating a new one.

        Raises:
            ValueError: a size of ``dims`` that differs from this strategy's (named, with both values).
        """
        for key, value in self._sizes.items():
            if value != -1 and getattr(dims, key) != value:
                raise ValueError(f"{key}={getattr(dims, key)} of the layout handed in differs from the strategy's "
                                 f"{key}={value}: build both from the same sizes.")
        self._planned_dims = dims

    def precision_options(self, precision: str | None = None) -> ParallelOptions:
        """The options :func:`~lightning_par.parallelize.parallelize` runs with under this run's precision: with
        ``dp_mode="zero3"`` and no ``zero.mixed_precision`` of the user's, FSDP2's mixed precision policy of
        :func:`lightning_par.precision.fsdp_mixed_precision` (half-precision parameters for compute, fp32 gradient
        reduction) under ``"bf16-mixed"`` / ``"16-mixed"``; the options as given otherwise. ``precision``: another
        precision string than the host's (the Fabric strategies pass Fabric's)."""
        zero = self.options.zero
        policy = fsdp_mixed_precision(precision or self.precision)
        if zero is None or zero.stage != 3 or policy is None or (zero.param_dtype, zero.reduce_dtype) != (None, None):
            return self.options
        return replace(self.options, zero=replace(zero, param_dtype=policy[0], reduce_dtype=policy[1]))
