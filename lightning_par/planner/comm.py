"""Communication volumes and times: ring collectives, tensor-parallel layers, ZeRO steps, pipeline messages.

Volumes are bytes *sent per rank* under bandwidth-optimal ring algorithms, times follow the alpha-beta model per ring
step; the formulas are :mod:`lightning_par.comm_cost`'s (re-exported here under the planner's names): an all-reduce
of ``n`` bytes over ``k`` ranks sends ``2 n (k-1)/k`` in ``2 (k-1)`` steps, an all-gather with output ``n`` or a
reduce-scatter with input ``n`` sends ``n (k-1)/k`` in ``k-1``, each step paying the link's per-message latency.

Which link a group uses follows the runtime's rank order (:class:`~lightning_par.parallel_dims.ParallelDims`: tp
innermost, then cp, dp, pp outermost; a group of ``axis`` is ``size(axis)`` ranks ``stride(axis)`` apart) on nodes of
``devices_per_node`` consecutive ranks: a tp group stays in a node when ``tp <= devices_per_node``, a cp group when
``tp * cp <= devices_per_node``, a dp group when ``tp * cp * dp <= devices_per_node``, pipeline neighbours when
``tp * cp * dp * pp <= devices_per_node``. The dp axis's collectives run over the derived mesh ``"dp_cp"`` (dp and cp
together: the runtime averages gradients, and ZeRO shards, over both), ``dp * cp`` ranks ``tp`` apart.

Across nodes, each device has its own network adapter (DGX A100: eight 200 Gb/s HDR adapters per node, one per GPU;
Narayanan et al. 2021, §5), and ``inter_node_bandwidth`` is one device's share. A collective whose group has ``k``
members in each node runs ``k`` rings at once, each leaving the node through another member's adapter (NCCL's
channels; the hops inside a node go over NVLink): its bytes cross the network at ``k * inter_node_bandwidth``
(:func:`group_ranks_per_node`). All the groups of a node run at once, so the node's adapters are shared, not
oversubscribed: with ``tp`` ranks per node on the tp axis, a dp group has ``devices_per_node / tp`` members per node.
A pipeline send goes from one device to one device: one adapter, ``k = 1``; so does each step of ring attention on the
cp axis (every rank sends its K/V block to the next; a step lasts as long as the sends that cross a node boundary).
Ulysses' all-to-alls on the cp axis are collectives like the others.

Pure Python: no torch import.
"""

from __future__ import annotations

from lightning_par.comm_cost import all_gather_bytes as allgather_bytes
from lightning_par.comm_cost import all_reduce_bytes as allreduce_bytes
from lightning_par.comm_cost import collective_time, reduce_scatter_bytes, ring_fraction, ring_steps
from lightning_par.comm_cost import megatron_layer_bytes as tp_layer_comm_bytes
from lightning_par.comm_cost import zero_step_comm_bytes
from lightning_par.pipeline_parallel.planner import pp_message_time as pipeline_message_time
from lightning_par.planner.calibration import calibration_for
from lightning_par.planner.devices import DeviceSpec
from lightning_par.planner.layouts import Layout, planner_terms

__all__ = [
    "allgather_bytes",
    "allreduce_bytes",
    "collective_time",
    "group_link",
    "group_ranks_per_node",
    "pp_message_time",
    "reduce_scatter_bytes",
    "ring_steps",
    "tp_layer_comm_bytes",
    "zero_step_comm_bytes",
]


def _point_to_point(layout: Layout, axis: str) -> bool:
    """Whether the registered axis named ``axis`` sends point to point under ``layout`` (its
    :class:`~lightning_par.axis_registry.PlannerTerms` ``point_to_point``: a ring-attention step on ``"cp"``)."""
    return any(name == axis and terms.point_to_point is not None and terms.point_to_point(layout)
               for name, terms in planner_terms())


def group_ranks_per_node(layout: Layout, axis: str, devices_per_node: int) -> int:
    """Members of one ``axis`` group in each node it spans, at least (nodes of ``devices_per_node`` consecutive ranks).

    A tp group is ``tp`` consecutive ranks, a cp group ``cp`` ranks ``tp`` apart, a dp group ``dp`` ranks ``cp * tp``
    apart, a ``"dp_cp"`` group ``dp * cp`` ranks ``tp`` apart; a ``"pp"`` send joins two devices (1), and so does a
    step of ring attention on ``"cp"`` (``layout.cp_method == "ring"``; Ulysses' all-to-alls count as a collective).
    When the group spans nodes unevenly (its ranks not filling whole nodes), the node holding the fewest members sets
    the rate.

    Args:
        layout: the layout (its mesh, and ``cp_method`` for ``"cp"``).
        axis: an axis or derived mesh of :class:`~lightning_par.parallel_dims.ParallelDims` (``"tp"``, ``"cp"``,
            ``"dp"``, ``"dp_cp"``, ``"pp"``).
        devices_per_node: devices per node.

    Returns:
        Members per node (at least 1).

    Raises:
        ValueError: an unknown axis.
    """
    dims = layout.dims()
    size, stride = dims.size(axis), dims.stride(axis)  # raises for an unknown axis
    if axis == "pp" or _point_to_point(layout, axis):
        return 1
    g = devices_per_node
    if (size * stride) % g == 0 and g % stride == 0:  # the group fills whole nodes evenly
        return max(1, min(size, g // stride))
    fewest = size
    for first in range(0, layout.world_size, size * stride):  # the first group of each pipeline stage (tp_idx 0)
        per_node: dict[int, int] = {}
        for i in range(size):
            node = (first + i * stride) // g
            per_node[node] = per_node.get(node, 0) + 1
        fewest = min(fewest, min(per_node.values()))
    return fewest


def group_link(device: DeviceSpec, layout: Layout, axis: str, devices_per_node: int,
               op: str | None = None, payload_bytes: float | None = None) -> tuple[float, float]:
    """``(bandwidth, latency)`` of the link a group of ``axis`` (``"tp"``, ``"cp"``, ``"dp"``, ``"dp_cp"`` or
    ``"pp"``) uses.

    Inside a node: ``intra_node_bandwidth``. Across nodes: ``k * inter_node_bandwidth`` with ``k`` the group's
    members per node (:func:`group_ranks_per_node`: one adapter per member; 1 for a pipeline send or a ring-attention
    step), at most ``intra_node_bandwidth``, and ``inter_node_latency_s`` per ring step.

    Args:
        device: the device spec (bandwidths in bytes/s, latencies in seconds).
        layout: the layout.
        axis: see :func:`group_ranks_per_node`.
        devices_per_node: devices per node.
        op: the operation (:data:`~lightning_par.planner.calibration.COLLECTIVE_OPS`); on a device with a
            ``calibration``, its measured bus bandwidth and latency for that op replace the link fields (None: the
            fields).
        payload_bytes: the operation's buffer in bytes; with ``op`` on a calibrated device, the bandwidth
            measured at that payload where a curve was published, latency then 0
            (:meth:`~lightning_par.planner.calibration.DeviceCalibration.link`).

    Returns:
        ``(bytes/s, seconds per message)``.

    Raises:
        ValueError: an unknown axis or op.
    """
    dims = layout.dims()
    intra_bw, intra_lat = device.intra_node_bandwidth, device.intra_node_latency_s
    inter_bw, inter_lat = device.inter_node_bandwidth, device.inter_node_latency_s
    if op is not None and device.calibration is not None:  # published figures per operation (calibration.json)
        cal = calibration_for(device.calibration)
        intra_bw, intra_lat = cal.link(op, True, payload_bytes)
        inter_bw, inter_lat = cal.link(op, False, payload_bytes)
    if dims.size(axis) * dims.stride(axis) <= devices_per_node:  # the ranks one group spans (raises for an unknown axis)
        return intra_bw, intra_lat
    adapters = group_ranks_per_node(layout, axis, devices_per_node)
    bandwidth = min(adapters * inter_bw, intra_bw)  # rings also cross NVLink
    return bandwidth, inter_lat


def pp_message_time(message_bytes: float, layout: Layout, device: DeviceSpec, devices_per_node: int,
                    scatter_gather: bool = False) -> float:
    """Seconds of one pipeline send between neighbouring stages on ``device``
    (:func:`lightning_par.pipeline_parallel.planner.pp_message_time` over :func:`group_link`)."""
    def link(axis: str, op: str | None = None, payload_bytes: float | None = None) -> tuple[float, float]:
        return group_link(device, layout, axis, devices_per_node, op=op, payload_bytes=payload_bytes)

    return pipeline_message_time(message_bytes, layout, link, scatter_gather)
