"""Communication cost of collectives: bytes each rank sends, ring steps, and alpha-beta time.

The one home of these formulas: the axes' own per-layer counts are written with them (the cp axis's
:mod:`lightning_par.context_parallel.comm_cost`), the planner predicts with them (:mod:`lightning_par.planner.comm`,
:mod:`lightning_par.planner.calibrate`, :mod:`lightning_par.planner.step_time`) and the byte counters charge the
collectives they see with them (:mod:`lightning_par.data_parallel.comm_volume`,
:mod:`lightning_par.tensor_parallel.comm_volume`).

Volumes are the bytes *one rank sends* in the bandwidth-optimal ring algorithms over a group of ``n`` ranks (Thakur,
Rabenseifner & Gropp 2005, "Optimization of Collective Communication Operations in MPICH"; Patarasuk & Yuan
2009, "Bandwidth optimal all-reduce algorithms for clusters of workstations"; the factors of NCCL's "Performance"
notes, nccl-tests ``doc/PERFORMANCE.md``; the model of Rajbhandari et al. 2020, §7 and Narayanan et al. 2021, §3.2).
Each of the ``n - 1`` steps of one pass around the ring moves ``1/n`` of the buffer, so a pass sends ``B (n-1)/n``:

* all-gather with ``B`` bytes of output, reduce-scatter of ``B`` bytes of input, all-to-all of ``B`` bytes: one pass;
* all-reduce of ``B`` bytes: a reduce-scatter then an all-gather, ``2 B (n-1)/n``;
* broadcast of ``B`` bytes (pipelined chain): every rank but the last forwards ``B``, ``B (n-1)/n`` on average;
* point-to-point send of ``B`` bytes: ``B``.

This is the algorithm's volume, not a trace of the backend's packets (gloo and NCCL pick other algorithms for small
messages). Times follow the alpha-beta (latency-bandwidth) model per ring step (Hockney 1994; Thakur et al. 2005):
``steps * latency + bytes / bandwidth``. Sizes in bytes, bandwidths in bytes/s, times in seconds. Pure Python: no torch
import.
"""

from __future__ import annotations

__all__ = [
    "all_gather_bytes",
    "all_reduce_bytes",
    "all_to_all_bytes",
    "broadcast_bytes",
    "collective_time",
    "megatron_layer_bytes",
    "reduce_scatter_bytes",
    "ring_fraction",
    "ring_pass_bytes",
    "ring_steps",
    "send_bytes",
    "zero_step_comm_bytes",
]


def ring_fraction(group_size: int) -> float:
    """``(n-1)/n``: the share of a buffer one rank sends in one pass around a ring of ``group_size`` ranks."""
    return (group_size - 1) / group_size


def ring_pass_bytes(nbytes: float, group_size: int) -> float:
    """Bytes one rank sends when ``nbytes`` make one pass around a ring of ``group_size`` ranks: ``B (n-1)/n``
    (multiplied before dividing, so whole byte counts stay exact where the result is whole)."""
    return nbytes * (group_size - 1) / group_size


def all_reduce_bytes(nbytes: float, group_size: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``nbytes`` (bytes): ``2 B (n-1)/n`` (Patarasuk & Yuan 2009)."""
    return ring_pass_bytes(2.0 * nbytes, group_size)


def all_gather_bytes(output_bytes: float, group_size: int) -> float:
    """Bytes one rank sends in a ring all-gather with ``output_bytes`` of output (``n`` inputs): ``B (n-1)/n``."""
    return ring_pass_bytes(output_bytes, group_size)


def reduce_scatter_bytes(input_bytes: float, group_size: int) -> float:
    """Bytes one rank sends in a ring reduce-scatter of ``input_bytes`` of input (``n`` outputs): ``B (n-1)/n``."""
    return ring_pass_bytes(input_bytes, group_size)


def all_to_all_bytes(nbytes: float, group_size: int) -> float:
    """Bytes one rank sends in an all-to-all of ``nbytes`` of input: all but its own ``1/n``, ``B (n-1)/n``."""
    return ring_pass_bytes(nbytes, group_size)


def broadcast_bytes(nbytes: float, group_size: int) -> float:
    """Bytes one rank sends in a pipelined-chain broadcast of ``nbytes``, averaged over the ranks: ``B (n-1)/n``
    (every rank but the last forwards the whole buffer once; NCCL's bus-bandwidth factor 1 is that busiest rank's)."""
    return ring_pass_bytes(nbytes, group_size)


def send_bytes(nbytes: float) -> float:
    """Bytes a point-to-point send of ``nbytes`` sends: ``B``."""
    return float(nbytes)


def ring_steps(op: str, group_size: int) -> int:
    """Ring steps of a collective over ``group_size`` ranks: all-reduce ``2 (n-1)``, all-gather, reduce-scatter and
    all-to-all (pairwise exchange) ``n-1``, point-to-point (``"p2p"``) 1.

    Raises:
        ValueError: an unknown ``op``.
    """
    steps = {"all_reduce": 2 * (group_size - 1), "all_gather": group_size - 1, "reduce_scatter": group_size - 1,
             "all_to_all": group_size - 1, "p2p": 1}
    if op not in steps:
        raise ValueError(f"op={op!r} is not valid: expected one of {sorted(steps)}.")
    return steps[op]


def collective_time(sent_bytes: float, bandwidth: float, latency_s: float, num_ops: int = 1, steps: int = 1) -> float:
    """Seconds for ``num_ops`` operations of ``steps`` ring steps each, sending ``sent_bytes`` (bytes) in total over a
    link of ``bandwidth`` (bytes/s) and ``latency_s`` (seconds per message): ``num_ops * steps * latency + bytes /
    bandwidth``."""
    return num_ops * steps * latency_s + sent_bytes / bandwidth


def megatron_layer_bytes(micro_batch_size: int, seq_len: int, hidden_size: int, tp_size: int, element_bytes: int,
                         recompute_forward: bool = False) -> float:
    """Bytes one rank sends per transformer layer per micro-batch under Megatron tensor parallelism.

    Two all-reduces forward and two backward of ``b s h`` elements of ``element_bytes`` bytes: ``8 b s h (t-1)/t``
    elements (Narayanan et al. 2021, §3.2); sequence parallelism replaces each by an all-gather and a reduce-scatter
    of the same volume (Korthikanti et al. 2022, §4.2.2). Full recomputation repeats the two forward ones:
    ``12 b s h (t-1)/t``.
    """
    count = 6 if recompute_forward else 4
    return count * all_reduce_bytes(micro_batch_size * seq_len * hidden_size * element_bytes, tp_size)


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
    f = ring_fraction(dp_size)
    volumes = {
        "ddp": 2 * grad_bytes,
        "zero1": 2 * grad_bytes + param_bytes,
        "zero2": grad_bytes + param_bytes,
        "zero3": num_microbatches * (2 * param_bytes + grad_bytes),
    }
    if dp_mode not in volumes:
        raise ValueError(f"dp_mode={dp_mode!r} is not valid: expected one of {sorted(volumes)}.")
    return volumes[dp_mode] * params * f
