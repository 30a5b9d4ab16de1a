"""Predicted time of one optimizer step: compute, exposed communication, pipeline bubble, optimizer.

Each axis's communication is its own term, in its folder's ``planner.py``
(:class:`~lightning_par.axis_registry.PlannerTerms` on its registry entry): this module adds every registered axis's
``slot_comm_s`` to a micro-batch slot and every ``step_comm_s`` after the schedule, naming no axis; what each term
models is summarised below.

Per pipeline rank and micro-batch (``b`` sequences of ``s`` tokens), the rank's ``L / p`` layers cost

* **compute**: ``b s (L/p) (f_layer + f_recompute) / t`` FLOPs, plus the head's ``6 V h b s / t`` on the last rank,
  at ``peak_flops * matmul_efficiency`` (on a device with a ``calibration``: at the rate its published measurements
  give each GEMM shape, :func:`~lightning_par.planner.calibration.layer_matmul_rates`) (model FLOPs per token from
  :class:`~lightning_par.planner.model.ModelSpec`;
  full recomputation adds one forward, ``f_layer / 3``; selective adds the attention scores' forward, ``4 s h``:
  Korthikanti et al. 2022, §5);
* **memory-bound kernels**: the bytes that the layer's norms, dropouts, residual adds, bias-GeLU and attention
  softmax read and write (:func:`~lightning_par.planner.elementwise.elementwise_bytes_per_layer`; the norms,
  dropouts and residual adds are not split by tp without sequence parallelism) at ``memory_bandwidth``;
* **framework overhead**: ``layer_ops * op_overhead_s`` per layer (kernel launches, dispatch), plus
  ``tp_layer_overhead_s`` per tensor-parallel layer (DTensor dispatch);
* **tensor-parallel communication**: four all-reduces of ``b s h`` elements per layer (six with full recomputation),
  ``8 b s h (t-1)/t`` elements sent (Narayanan et al. 2021, §3.2), not overlapped;
* **context parallelism** over ``cp`` ranks (the sequence split, each rank holding ``s / cp`` tokens): compute,
  memory-bound kernels and tensor-parallel messages per rank fall as ``1 / cp`` (each rank's queries still attend
  over the whole sequence, so the attention FLOPs per token do not change); per layer and micro-batch the cp axis
  adds ring attention's ``cp - 1`` K/V block sends forward and backward (Liu et al. 2023, §3) or Ulysses' four
  all-to-alls forward and four backward (Jacobs et al. 2023, §3), repeated forward under recomputation
  (:func:`~lightning_par.context_parallel.planner.layer_comm`), over the cp group's link, not overlapped
  (lightning_par's exchanges are blocking);
* **expert parallelism** over ``ep`` ranks (:mod:`lightning_par.expert_parallel.planner`): per MoE block two token
  all-to-alls forward and two backward of the rank's ``b s k`` routed copies; a MoE block's router and experts run
  whole on every tp rank, so their FLOPs are not divided by ``t``; FLOPs per token count the active experts;
* **pipeline point-to-point**: one activation send forward and one gradient send backward per chunk and
  micro-batch, ``b s h`` elements each, so ``v`` times as many with ``v`` chunks per rank (Narayanan et al. 2021,
  §2.2.2: "the amount of communication also increases by v"); ``/ t`` with sequence parallelism; with Megatron's
  scatter/gather (§4.1) ``/ t`` plus an all-gather inside the node (:func:`pp_message_time`). Across nodes each
  device sends over its own adapter.

A step of a pipeline runs ``m + (p-1)/v`` such slots on the slowest rank (GPipe and 1F1B: ``v = 1``): the bubble is
``(p-1)/v`` slots, i.e. a fraction ``(p-1) / (v m + p - 1)`` of the pipeline time (Narayanan et al. 2021, §2.2).
Without pipelining it runs ``m`` slots. Then the dp axis (:mod:`lightning_par.data_parallel.planner`:
:func:`~lightning_par.planner.comm.zero_step_comm_bytes` over the runtime's ``dp_cp`` mesh for ddp, ``dp_shard_cp``
for the ZeRO modes, plus HSDP's all-reduce of each shard over ``dp_replicate``; the experts over ``edp_shard``):
the gradient reduction overlaps the last micro-batch's backward only in the single-micro-batch, unpipelined layouts
whose strategy reduces during backward (``ddp_overlap``, ``zero1``, ``zero2``); the other layouts reduce once after
the schedule; ZeRO-3's gathers overlap compute (prefetch); ``comm_overlap`` of the overlappable part is hidden. Last,
the optimizer reads and writes its shard of parameters, gradients and state at ``memory_bandwidth``, plus
``optimizer_tensor_overhead_s`` per parameter tensor it steps (``sharded_optimizer_tensor_overhead_s`` for the
sharded, DTensor-held tensors of the ZeRO modes).

On devices that share compute units (``idle_speedup > 1``: CPU processes on the same cores), rates are those measured
with every device busy; a rank waiting in the bubble frees its share, so the step is the larger of the busiest
rank's busy time and the critical path run ``idle_speedup`` times faster.

MFU is model FLOPs per second over peak (PaLM, Chowdhery et al. 2022, App. B); HFU counts recomputation too.
All times in seconds. Pure Python: no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_par.planner.calibration import layer_matmul_rates
from lightning_par.planner.comm import pp_message_time
from lightning_par.planner.context import PlanContext
from lightning_par.planner.devices import DeviceSpec
from lightning_par.planner.elementwise import elementwise_bytes_per_layer
from lightning_par.planner.layouts import Layout, planner_terms
from lightning_par.planner.memory import rank_param_groups
from lightning_par.planner.model import ModelSpec
from lightning_par.planner.precision import Precision

__all__ = ["TimeBreakdown", "bubble_fraction", "pp_message_time", "predict_step_time", "recompute_flops_per_token"]


def bubble_fraction(pp_size: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a pipeline step: ``(p-1) / (v m + p - 1)`` (GPipe/1F1B with ``v = 1``; interleaved 1F1B
    with ``v`` chunks per rank: Narayanan et al. 2021, §2.2)."""
    p, m, v = pp_size, num_microbatches, virtual_stages
    return (p - 1) / (v * m + p - 1)


def recompute_flops_per_token(model: ModelSpec, checkpointing: str) -> float:
    """Extra FLOPs per token and layer that activation checkpointing recomputes: full, one forward of the layer
    (``f_layer / 3``); selective, the attention scores' forward ``4 s h``; none, 0."""
    if checkpointing == "full":
        return model.layer_flops_per_token() / 3.0
    if checkpointing == "selective":
        return model.attention_score_flops_per_token()
    return 0.0


@dataclass(frozen=True)
class TimeBreakdown:
    """Predicted seconds of one optimizer step.

    Attributes:
        step_time_s: the whole step.
        compute_s: matmul time of the slowest rank over the step (all its micro-batches), recomputation included.
        memory_bound_s: the same rank's memory-bound kernels (norms, dropouts, residual adds, GeLU, softmax) over
            the step, at ``memory_bandwidth``
            (:func:`~lightning_par.planner.elementwise.elementwise_bytes_per_layer`).
        overhead_s: framework overhead over the step (per-layer dispatch).
        tp_comm_s: tensor-parallel collectives over the step.
        cp_comm_s: context-parallel attention exchanges over the step (ring sends or Ulysses all-to-alls): like
            ``ep_comm_s`` (expert-parallel token all-to-alls), read from :attr:`comm_s` (``<axis>_comm_s``).
        pp_comm_s: pipeline sends over the step.
        bubble_s: idle pipeline time (its slots), after what a shared-compute device recovers.
        dp_comm_s: exposed dp-axis communication.
        optimizer_s: the optimizer step.
        model_flops: model FLOPs of the whole step over all devices (no recomputation).
        hardware_flops: the same with recomputation.
        comm_s: every registered axis's communication over the step, by axis name (``"tp"``, ``"cp"``, ``"ep"``,
            ``"pp"`` per micro-batch slot times the slots a rank runs; ``"dp"`` once, exposed): the terms of each
            axis's ``planner.py`` (:class:`~lightning_par.axis_registry.PlannerTerms`).
    """

    step_time_s: float
    compute_s: float
    memory_bound_s: float
    overhead_s: float
    tp_comm_s: float
    pp_comm_s: float
    bubble_s: float
    dp_comm_s: float
    optimizer_s: float
    model_flops: float
    hardware_flops: float
    comm_s: dict[str, float] = field(default_factory=dict, hash=False)

    def __getattr__(self, name: str) -> float:
        """``<axis>_comm_s`` of an axis without a field of its own (``cp_comm_s``: context-parallel attention
        exchanges, ring sends or Ulysses all-to-alls; ``ep_comm_s``: expert-parallel token all-to-alls): its entry of
        :attr:`comm_s`, 0.0 when the axis has no communication term.

        Raises:
            AttributeError: any other name.
        """
        if name.endswith("_comm_s") and name != "_comm_s" and not name.startswith("__"):
            return self.__dict__.get("comm_s", {}).get(name.removesuffix("_comm_s"), 0.0)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def predict_step_time(
    model: ModelSpec,
    layout: Layout,
    device: DeviceSpec,
    precision: Precision,
    devices_per_node: int,
    pp_scatter_gather: bool = False,
) -> TimeBreakdown:
    """Predict one optimizer step of ``model`` under ``layout`` (see the module docstring for the model).

    Args:
        model: the model (its ``seq_len`` is the training sequence length).
        layout: the layout.
        device: the device spec.
        precision: bytes per element of parameters, gradients and activations.
        devices_per_node: devices sharing fast links (NVLink) in one node.
        pp_scatter_gather: the pipeline sends use Megatron-LM's scatter/gather (see :func:`pp_message_time`);
            lightning_par's pipeline does not (each tp rank sends its whole replicated activation).

    Returns:
        The :class:`TimeBreakdown`.
    """
    p, t, m, v = layout.pp_size, layout.tp_size, layout.num_microbatches, layout.virtual_stages
    ctx = PlanContext(model, layout, device, precision, devices_per_node, pp_scatter_gather)
    dims = ctx.dims
    b, s, h = layout.micro_batch_size, model.seq_len, model.hidden_size
    e = precision.activation_bytes
    tokens_mb = ctx.tokens  # b s / cp: each cp rank holds its share of the sequence
    layers = ctx.layers
    layer_rate, head_rate = layer_matmul_rates(model, layout, device, e)  # FLOP/s per GEMM shape (calibration.py)

    # --- one micro-batch on the slowest pipeline rank: compute, overhead, every axis's communication
    f_layer = model.layer_flops_per_token()  # per token over the whole sequence's keys, whatever the cp split
    f_extra = recompute_flops_per_token(model, layout.activation_checkpointing)
    layer_compute = tokens_mb * (f_layer + f_extra) / t / layer_rate
    if model.num_experts and t > 1:  # a MoE block's router and experts run whole on every tp rank
        moe = model.moe_mlp_flops_per_token() * (1.0 + (1.0 / 3.0 if layout.activation_checkpointing == "full" else 0))
        layer_compute += tokens_mb * moe * (1 - 1 / t) / layer_rate * model.moe_layer_count() / model.num_layers
    head_compute = tokens_mb * model.head_flops_per_token() / t / head_rate
    slot_compute = layers * layer_compute + head_compute  # the last rank, which also runs the head
    elementwise = elementwise_bytes_per_layer(
        s, b, h, model.num_heads, t, layout.sequence_parallel, layout.activation_checkpointing, e, model.ffn,
    )
    if ctx.seq_split > 1:  # s / cp tokens per rank, their s / cp x s scores: every term / cp
        elementwise /= ctx.seq_split
    memory_bound = layers * elementwise / device.memory_bandwidth
    overhead = layers * (model.layer_ops * device.op_overhead_s + (device.tp_layer_overhead_s if t > 1 else 0.0))
    terms = planner_terms()
    slot_comm = {name: term.slot_comm_s(ctx) for name, term in terms if term.slot_comm_s is not None}
    slot = slot_compute + memory_bound + overhead + sum(slot_comm.values())
    slots = m + (p - 1) / v if p > 1 else float(m)
    pipeline = slots * slot
    busy = m * slot  # a rank's own work, without waiting

    # --- after the schedule: the dp axis (gradients averaged, ZeRO's shards), overlapping what it can
    if layout.dp_mode == "zero3":
        window = m * (slot_compute + memory_bound)
    elif p == 1 and m == 1:
        window = (slot_compute + memory_bound) * 2.0 / 3.0  # the backward of the only micro-batch
    else:
        window = 0.0
    step_comm = {name: term.step_comm_s(ctx, window) for name, term in terms if term.step_comm_s is not None}
    dp_comm = sum(step_comm.values())

    # --- optimizer: its shard of parameters, gradients and state, read and written once
    dense, experts = max((rank_param_groups(model, layout, r) for r in {0, p - 1}), key=sum)
    sharded = layout.dp_mode != "ddp"
    opt_params = dense / dims.size("dp_shard_cp") + experts / dims.size("edp_shard") if sharded else dense + experts
    traffic = precision.param_bytes + precision.grad_bytes + 2 * precision.optimizer_bytes
    tensors = model.layer_tensors * layers + 4
    per_tensor = device.sharded_optimizer_tensor_overhead_s if sharded and dims.size("dp_shard_cp") > 1 else (
        device.optimizer_tensor_overhead_s)
    optimizer = opt_params * traffic / device.memory_bandwidth + tensors * per_tensor

    critical = pipeline
    bubble = pipeline - busy
    if device.idle_speedup > 1.0:  # shared compute: the bubble's idle share goes to the busy ranks
        critical = max(busy, pipeline / device.idle_speedup)
        bubble = critical - busy
    step = critical + dp_comm + optimizer

    tokens_step = layout.global_batch_size * s
    model_flops = tokens_step * model.model_flops_per_token()
    hardware_flops = model_flops + tokens_step * model.num_layers * f_extra
    return TimeBreakdown(
        step_time_s=step,
        compute_s=m * slot_compute,
        memory_bound_s=m * memory_bound,
        overhead_s=m * overhead,
        tp_comm_s=m * slot_comm.get("tp", 0.0),
        pp_comm_s=m * slot_comm.get("pp", 0.0),
        bubble_s=bubble,
        dp_comm_s=dp_comm,
        optimizer_s=optimizer,
        model_flops=model_flops,
        hardware_flops=hardware_flops,
        comm_s={**{name: m * x for name, x in slot_comm.items()}, **step_comm},
    )
