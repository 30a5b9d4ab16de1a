"""Communication volumes and times: ring collectives, tensor-parallel layers, ZeRO steps, pipeline messages.

Volumes are bytes *sent per rank* under bandwidth-optimal ring algorithms (Patarasuk & Yuan 2009; the model of
Narayanan et al. 2021, §3.2 and Rajbhandari et al. 2020, §7): an all-reduce of ``n`` bytes over ``k`` ranks sends
``2 n (k-1)/k``; an all-gather with output ``n`` or a reduce-scatter with input ``n`` sends ``n (k-1)/k``. Times follow
the alpha-beta model per ring step: a ring all-reduce takes ``2 (k-1)`` steps, an all-gather or reduce-scatter
``k-1``, a point-to-point send one, each paying the link's per-message latency, plus ``bytes / bandwidth``.

Which link a group uses follows the ``("pp", "dp", "tp")`` mesh (rank = ``pp_idx * dp * tp + dp_idx * tp + tp_idx``)
on nodes of ``devices_per_node`` consecutive ranks: a tp group stays in a node when ``tp <= devices_per_node``, a dp
group when ``tp * dp <= devices_per_node``, pipeline neighbours when ``tp * dp * pp <= devices_per_node``.

Across nodes, each device has its own network adapter (DGX A100: eight 200 Gb/s HDR adapters per node, one per GPU;
Narayanan et al. 2021, §5), and ``inter_node_bandwidth`` is one device's share. A collective whose group has ``k``
members in each node runs ``k`` rings at once, each leaving the node through another member's adapter (NCCL's
channels; the hops inside a node go over NVLink): its bytes cross the network at ``k * inter_node_bandwidth``
(:func:`group_ranks_per_node`). All the groups of a node run at once, so the node's adapters are shared, not
oversubscribed: with ``tp`` ranks per node on the tp axis, a dp group has ``devices_per_node / tp`` members per node.
A pipeline send goes from one device to one device: one adapter, ``k = 1``.

Pure Python: no torch import.
"""

from __future__ import annotations

from lightning_par.planner.devices import DeviceSpec
from lightning_par.planner.layouts import Layout

__all__ = [
    "allgather_bytes",
    "allreduce_bytes",
    "collective_time",
    "group_link",
    "group_ranks_per_node",
    "reduce_scatter_bytes",
    "ring_steps",
    "tp_layer_comm_bytes",
    "zero_step_comm_bytes",
]


def allreduce_bytes(size_bytes: float, group_size: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``size_bytes``: ``2 n (k-1)/k``."""
    return 2.0 * size_bytes * (group_size - 1) / group_size


def allgather_bytes(output_bytes: float, group_size: int) -> float:
    """Bytes one rank sends in a ring all-gather with ``output_bytes`` of output: ``n (k-1)/k``."""
    return output_bytes * (group_size - 1) / group_size


def reduce_scatter_bytes(input_bytes: float, group_size: int) -> float:
    """Bytes one rank sends in a ring reduce-scatter of ``input_bytes`` of input: ``n (k-1)/k``."""
    return input_bytes * (group_size - 1) / group_size


def tp_layer_comm_bytes(micro_batch_size: int, seq_len: int, hidden_size: int, tp_size: int,
                        element_bytes: int, recompute_forward: bool = False) -> float:
    """Bytes one rank sends per transformer layer per micro-batch under Megatron tensor parallelism.

    Two all-reduces forward and two backward of ``b s h`` elements: ``8 b s h (t-1)/t`` elements (Narayanan et al.
    2021, §3.2); sequence parallelism replaces each by an all-gather and a reduce-scatter of the same volume
    (Korthikanti et al. 2022, §4.2.2). Full recomputation repeats the two forward ones: ``12 b s h (t-1)/t``.
    """
    count = 6 if recompute_forward else 4
    return count * allreduce_bytes(micro_batch_size * seq_len * hidden_size * element_bytes, tp_size)


def zero_step_comm_bytes(dp_mode: str, params: float, dp_size: int, param_bytes: int, grad_bytes: int,
                         num_microbatches: int = 1) -> float:
    """Bytes one rank sends per optimizer step on the dp axis, as lightning_par's dp modes run.

    * ddp: all-reduce of the gradients, ``2 G Psi (d-1)/d`` (§7 of Rajbhandari et al. 2020: ``2 Psi``);
    * zero1: the gradient all-reduce, then an all-gather of the updated parameter shards, ``(2 G + P) Psi (d-1)/d``
      (lightning_par's stage 1 keeps torch DDP's all-reduce; the paper's stage 1 reduce-scatters, ``2 Psi``);
    * zero2: reduce-scatter of the gradients plus all-gather of the parameters, ``(G + P) Psi (d-1)/d`` (``2 Psi``);
    * zero3: per micro-batch, parameters all-gathered for forward and again for backward and gradients
      reduce-scattered, ``m (2 P + G) Psi (d-1)/d`` (``3 Psi`` per micro-batch).

    Raises:
        ValueError: an unknown ``dp_mode``.
    """
    f = (dp_size - 1) / dp_size
    volumes = {
        "ddp": 2 * grad_bytes,
        "zero1": 2 * grad_bytes + param_bytes,
        "zero2": grad_bytes + param_bytes,
        "zero3": num_microbatches * (2 * param_bytes + grad_bytes),
    }
    if dp_mode not in volumes:
        raise ValueError(f"dp_mode={dp_mode!r} is not valid: expected one of {sorted(volumes)}.")
    return volumes[dp_mode] * params * f


def collective_time(sent_bytes: float, bandwidth: float, latency_s: float, num_ops: int = 1, steps: int = 1) -> float:
    """Seconds for ``num_ops`` operations of ``steps`` ring steps each, sending ``sent_bytes`` in total:
    ``num_ops * steps * latency + bytes / bandwidth``."""
    return num_ops * steps * latency_s + sent_bytes / bandwidth


def ring_steps(op: str, group_size: int) -> int:
    """Ring steps of a collective over ``group_size`` ranks: all-reduce ``2 (k-1)``, all-gather and reduce-scatter
    ``k-1``, point-to-point 1.

    Raises:
        ValueError: an unknown ``op``.
    """
    steps = {"all_reduce": 2 * (group_size - 1), "all_gather": group_size - 1, "reduce_scatter": group_size - 1,
             "p2p": 1}
    if op not in steps:
        raise ValueError(f"op={op!r} is not valid: expected one of {sorted(steps)}.")
    return steps[op]


def group_ranks_per_node(layout: Layout, axis: str, devices_per_node: int) -> int:
    """Members of one ``axis`` group in each node it spans, at least (nodes of ``devices_per_node`` consecutive ranks).

    A tp group is ``tp`` consecutive ranks, a dp group ``dp`` ranks ``tp`` apart; a ``"pp"`` send joins two devices
    (1). When the group spans nodes unevenly (``tp * dp`` not a multiple of ``devices_per_node``), the node holding
    the fewest members sets the rate.

    Raises:
        ValueError: an unknown axis.
    """
    if axis == "pp":
        return 1
    if axis not in ("tp", "dp"):
        raise ValueError(f"axis={axis!r} is not valid: expected 'tp', 'dp' or 'pp'.")
    g, tp, dp = devices_per_node, layout.tp_size, layout.dp_size
    size, stride = (tp, 1) if axis == "tp" else (dp, tp)
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


def group_link(device: DeviceSpec, layout: Layout, axis: str, devices_per_node: int) -> tuple[float, float]:
    """``(bandwidth, latency)`` of the link a group of ``axis`` (``"tp"``, ``"dp"`` or ``"pp"``) uses.

    Inside a node: ``intra_node_bandwidth``. Across nodes: ``k * inter_node_bandwidth`` with ``k`` the group's
    members per node (:func:`group_ranks_per_node`: one adapter per member; 1 for a pipeline send), at most
    ``intra_node_bandwidth``, and ``inter_node_latency_s`` per ring step.

    Raises:
        ValueError: an unknown axis.
    """
    span = {"tp": layout.tp_size, "dp": layout.tp_size * layout.dp_size,
            "pp": layout.tp_size * layout.dp_size * layout.pp_size}
    if axis not in span:
        raise ValueError(f"axis={axis!r} is not valid: expected 'tp', 'dp' or 'pp'.")
    if span[axis] <= devices_per_node:
        return device.intra_node_bandwidth, device.intra_node_latency_s
    adapters = group_ranks_per_node(layout, axis, devices_per_node)
    bandwidth = min(adapters * device.inter_node_bandwidth, device.intra_node_bandwidth)  # rings also cross NVLink
    return bandwidth, device.inter_node_latency_s
