"""What an axis's planner terms (:class:`~lightning_par.axis_registry.PlannerTerms`) are given: one layout of one model
on one device, with the figures every term needs computed once.

Pure Python: no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from lightning_par.parallel_dims import ParallelDims
from lightning_par.planner.devices import DeviceSpec
from lightning_par.planner.layouts import Layout, sequence_split
from lightning_par.planner.model import ModelSpec
from lightning_par.planner.precision import Precision

__all__ = ["PlanContext"]


@dataclass(frozen=True)
class PlanContext:
    """One layout of one model on one device, as the planner's axis terms read it.

    Attributes:
        model: the model (its ``seq_len`` is the training sequence length).
        layout: the layout.
        device: the device spec (bandwidths in bytes/s, latencies in seconds); ``None`` for memory alone.
        precision: bytes per element of parameters, gradients, optimizer state and activations.
        devices_per_node: devices sharing fast links in one node.
        pp_scatter_gather: pipeline sends as Megatron-LM's scatter/gather (Narayanan et al. 2021, §4.1).
    """

    model: ModelSpec
    layout: Layout
    device: DeviceSpec | None
    precision: Precision
    devices_per_node: int = 1
    pp_scatter_gather: bool = False

    @cached_property
    def dims(self) -> ParallelDims:
        """The runtime's :class:`~lightning_par.parallel_dims.ParallelDims` of the layout."""
        return self.layout.dims()

    @property
    def layers(self) -> float:
        """Layers per pipeline rank, ``L / pp_size``."""
        return self.model.num_layers / self.layout.pp_size

    @cached_property
    def seq_split(self) -> int:
        """Ranks each sequence's tokens are split over (:func:`~lightning_par.planner.layouts.sequence_split`: the
        product of the registered axes' ``token_split``, context parallelism's ``cp``)."""
        return sequence_split(self.layout)

    @property
    def sequence_tokens(self) -> int:
        """Tokens of one sequence on one rank: ``s / cp`` (:attr:`seq_split`)."""
        return self.model.seq_len // self.seq_split

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on one rank: ``b s / cp``."""
        return self.layout.micro_batch_size * self.sequence_tokens

    @property
    def element_bytes(self) -> int:
        """Bytes per activation element."""
        return self.precision.activation_bytes

    @property
    def recompute(self) -> str:
        """The layout's activation checkpointing: ``"none"``, ``"selective"`` or ``"full"``."""
        return self.layout.activation_checkpointing

    def link(self, axis: str, op: str | None = None, payload_bytes: float | None = None) -> tuple[float, float]:
        """``(bytes/s, seconds per message)`` of the link a group of ``axis`` (a mesh axis or derived mesh of
        :class:`~lightning_par.parallel_dims.ParallelDims`) uses for collective ``op`` of messages of
        ``payload_bytes`` (:func:`~lightning_par.planner.comm.group_link`; the op and payload select the measured
        rate of a calibrated device)."""
        from lightning_par.planner.comm import group_link

        return group_link(self.device, self.layout, axis, self.devices_per_node, op=op, payload_bytes=payload_bytes)
