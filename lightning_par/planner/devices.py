"""Device specifications: memory, compute and links of one device, with presets for common GPUs.

GPU presets hold vendor datasheet figures (dense bf16 tensor-core peak, HBM capacity and bandwidth) and published
measurements read from ``data/calibration.json`` (:mod:`lightning_par.planner.calibration`, every number with its
source): the best measured matmul rate over the peak (``matmul_efficiency``), refined per GEMM shape by the step-time
model, and measured bus bandwidths and latencies of NVLink and of one network adapter (per operation and payload in
the calibration; the point-to-point figures in the link fields). One assumption remains, stated per field: the share
of overlappable communication actually hidden (``comm_overlap``). The ``"cpu"`` device is not a preset: it is
measured on this machine by :func:`lightning_par.planner.calibrate.calibrate_cpu` and loaded from its JSON file
(:func:`lightning_par.planner.calibrate.load_cpu_device`).

Pure Python: no torch import.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from lightning_par.planner.calibration import calibration_for

__all__ = ["DEVICE_PRESETS", "DeviceSpec", "get_device"]

_GiB = 1 << 30


@dataclass(frozen=True)
class DeviceSpec:
    """What the planner assumes about one device and its links.

    Args:
        name: label.
        memory_bytes: memory of one device, in bytes.
        peak_flops: dense peak FLOP/s of one device at the training's matmul dtype.
        memory_bandwidth: device memory bandwidth in bytes/s (the optimizer step and the memory-bound kernels of each
            layer are bound by it).
        intra_node_bandwidth: bytes/s one device sends to the others of its node (one direction), used for
            collectives and point-to-point inside a node.
        inter_node_bandwidth: bytes/s one device sends across nodes (its own network adapter, or its share of the
            node's); a collective with ``k`` members per node crosses at ``k`` times this
            (:func:`~lightning_par.planner.comm.group_link`).
        intra_node_latency_s: fixed seconds per message (one ring step) inside a node.
        inter_node_latency_s: fixed seconds per message (one ring step) across nodes.
        matmul_efficiency: fraction of ``peak_flops`` the matmuls reach (for the GPU presets the best measured
            matmul rate, refined per GEMM shape when ``calibration`` is set; 1.0 for a calibrated CPU, whose peak is
            the measured matmul rate). The memory-bound kernels are charged apart, at
            ``memory_bandwidth``.
        comm_overlap: fraction of overlappable communication (the dp gradient reduction during the last backward,
            ZeRO-3 gathers during compute) that is hidden.
        reserved_bytes: memory not available to tensors (runtime context, communication buffers of the library).
        idle_speedup: how much faster a device runs while the other devices of its node wait: 1 for devices with
            their own compute (GPUs); above 1 when devices share compute units (CPU processes on the same cores, whose
            rates are measured with all of them busy).
        op_overhead_s: fixed seconds per operator (kernel launch, framework dispatch, autograd) beyond its FLOPs;
            0 for the GPU presets, where launches overlap the kernels of large models.
        tp_layer_overhead_s: extra fixed seconds per layer per micro-batch (forward + backward) when the layer is
            tensor-parallel (DTensor dispatch and sharding propagation on the host); 0 for the GPU presets.
        optimizer_tensor_overhead_s: fixed seconds per parameter tensor of an optimizer step on plain tensors.
        sharded_optimizer_tensor_overhead_s: the same for the DTensor shards that the ZeRO modes step.
        default_precision: the precision plans use unless told otherwise (see
            :data:`lightning_par.planner.precision.PRECISIONS`).
        calibration: a family of :mod:`lightning_par.planner.calibration` (``"a100"``, ``"h100"``): matmul time per
            GEMM shape and link figures per collective from its published measurements; None (custom specs, the
            CPU): every matmul at ``achieved_flops``, every collective at the link fields.

    Raises:
        ValueError: a non-positive capacity, peak or bandwidth, or a fraction outside its range.
    """

    name: str
    memory_bytes: float
    peak_flops: float
    memory_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    intra_node_latency_s: float = 3e-6
    inter_node_latency_s: float = 1e-5
    matmul_efficiency: float = 0.75
    comm_overlap: float = 0.8
    reserved_bytes: float = 2 * _GiB
    idle_speedup: float = 1.0
    op_overhead_s: float = 0.0
    tp_layer_overhead_s: float = 0.0
    optimizer_tensor_overhead_s: float = 0.0
    sharded_optimizer_tensor_overhead_s: float = 0.0
    default_precision: str = "mixed-bf16"
    calibration: str | None = None

    def __post_init__(self) -> None:
        for f in ("memory_bytes", "peak_flops", "memory_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"DeviceSpec.{f}={value!r} is not valid: expected a number > 0.")
        for f in ("intra_node_latency_s", "inter_node_latency_s", "reserved_bytes", "op_overhead_s",
                  "tp_layer_overhead_s",
                  "optimizer_tensor_overhead_s", "sharded_optimizer_tensor_overhead_s"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"DeviceSpec.{f}={value!r} is not valid: expected a number >= 0.")
        if not 0 < self.matmul_efficiency <= 1:
            raise ValueError(f"DeviceSpec.matmul_efficiency={self.matmul_efficiency!r} is not valid: expected (0, 1].")
        if not 0 <= self.comm_overlap <= 1:
            raise ValueError(f"DeviceSpec.comm_overlap={self.comm_overlap!r} is not valid: expected [0, 1].")
        if isinstance(self.idle_speedup, bool) or not isinstance(self.idle_speedup, (int, float)) or (
                self.idle_speedup < 1):
            raise ValueError(f"DeviceSpec.idle_speedup={self.idle_speedup!r} is not valid: expected a number >= 1.")
        if self.reserved_bytes >= self.memory_bytes:
            raise ValueError(
                f"DeviceSpec.reserved_bytes={self.reserved_bytes!r} is not valid: expected less than memory_bytes="
                f"{self.memory_bytes!r}."
            )
        if self.calibration is not None:
            calibration_for(self.calibration)  # raises for an unknown family

    @property
    def usable_bytes(self) -> float:
        """Memory a layout may fill: ``memory_bytes - reserved_bytes``."""
        return self.memory_bytes - self.reserved_bytes

    @property
    def achieved_flops(self) -> float:
        """``peak_flops * matmul_efficiency``: the FLOP/s the step-time model assumes."""
        return self.peak_flops * self.matmul_efficiency

    def replace(self, **changes: Any) -> DeviceSpec:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _preset(name: str, family: str, memory_bytes: float, peak_flops: float, memory_bandwidth: float) -> DeviceSpec:
    """A GPU preset: datasheet capacity, peak and HBM bandwidth; matmul plateau and links from the calibration."""
    cal = calibration_for(family)
    intra_bw, intra_lat = cal.link("p2p", inside_node=True)
    inter_bw, inter_lat = cal.link("p2p", inside_node=False)
    return DeviceSpec(
        name=name, memory_bytes=memory_bytes, peak_flops=peak_flops, memory_bandwidth=memory_bandwidth,
        intra_node_bandwidth=intra_bw, inter_node_bandwidth=inter_bw, intra_node_latency_s=intra_lat,
        inter_node_latency_s=inter_lat, matmul_efficiency=cal.plateau, calibration=family,
    )


# Datasheet figures: NVIDIA A100 (SXM4) and H100/H200 (SXM5) product briefs: dense bf16 peak, HBM bandwidth, memory as
# nvidia-smi reports it. Measured figures (matmul plateau, NVLink and network bus bandwidth and latency, one network
# adapter per GPU as in DGX A100/H100): data/calibration.json, with their sources. comm_overlap=0.8: an assumption.
DEVICE_PRESETS: dict[str, DeviceSpec] = {
    "a100-40gb": _preset("a100-40gb", "a100", 40 * _GiB, 312e12, 1.555e12),
    "a100-80gb": _preset("a100-80gb", "a100", 80 * _GiB, 312e12, 2.039e12),
    "h100-80gb": _preset("h100-80gb", "h100", 80 * _GiB, 989e12, 3.35e12),
    "h200": _preset("h200", "h100", 143771 * (1 << 20), 989e12, 4.8e12),
}


def get_device(device: str | DeviceSpec, num_processes: int | None = None, calibration: Any = None) -> DeviceSpec:
    """Resolve a device name or spec.

    Args:
        device: a :class:`DeviceSpec`, a key of :data:`DEVICE_PRESETS`, or ``"cpu"`` (this machine, as calibrated).
        num_processes: for ``"cpu"``: processes sharing the machine (the world size on one node).
        calibration: for ``"cpu"``: a path to the calibration JSON or a loaded
            :class:`~lightning_par.planner.calibrate.CpuCalibration` (None: the default file).

    Returns:
        The spec.

    Raises:
        ValueError: an unknown name (the message lists the valid ones), or ``"cpu"`` without a calibration.
    """
    if isinstance(device, DeviceSpec):
        return device
    if isinstance(device, str) and device in DEVICE_PRESETS:
        return DEVICE_PRESETS[device]
    if device == "cpu":
        from lightning_par.planner.calibrate import load_cpu_device

        return load_cpu_device(num_processes or 1, calibration)
    raise ValueError(
        f"device={device!r} is not valid: expected a DeviceSpec or one of {sorted(DEVICE_PRESETS) + ['cpu']}."
    )
