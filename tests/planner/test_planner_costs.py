"""The step-time model's costs against hand computation (Narayanan et al. 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", SC21): where each axis's bytes go and at what rate, what is exposed,
and the memory-bound kernels. Pure Python, no processes."""

from __future__ import annotations

import math

import pytest

from lightning_par.planner import DEVICE_PRESETS, DeviceSpec, Layout, ModelSpec, get_precision, plan, predict
from lightning_par.planner.comm import group_link, group_ranks_per_node
from lightning_par.planner.elementwise import elementwise_bytes_per_layer
from lightning_par.planner.step_time import pp_message_time

A100 = DEVICE_PRESETS["a100-80gb"].replace(calibration=None)  # the fields alone: hand-computable (per-shape GEMM
# rates and per-payload link rates are tested in test_planner_calibration.py)
NVLINK, NIC = A100.intra_node_bandwidth, A100.inter_node_bandwidth  # 300 GB/s, 25 GB/s per GPU (one HDR HCA)
#: Megatron-LM's 7.5B and 18.4B GPTs of Table 1 (s = 2048, V = 51200, tied embeddings).
GPT_7B = ModelSpec(num_layers=36, hidden_size=4096, num_heads=32, vocab_size=51200, seq_len=2048, tied_embeddings=True)
GPT_18B = ModelSpec(num_layers=40, hidden_size=6144, num_heads=48, vocab_size=51200, seq_len=2048,
                    tied_embeddings=True)
BF16 = get_precision("mixed-bf16")


def _megatron(dp, tp, pp, m, schedule="none", v=1):
    return Layout(dp, tp, pp, "ddp", 1, m, schedule, v, "full", False)


# ------------------------------------------------------------------------------------------------ links
@pytest.mark.parametrize(("layout", "axis", "per_node", "bandwidth"), [
    # dp groups across nodes: one network adapter per member in each node (DGX A100: 8 HCAs, §5)
    (_megatron(32, 1, 1, 16), "dp", 8, 8 * NIC),  # t = 1: all 8 GPUs of a node are one dp group's
    (_megatron(64, 2, 1, 8), "dp", 4, 4 * NIC),
    (_megatron(32, 4, 1, 16), "dp", 2, 2 * NIC),
    (_megatron(32, 8, 1, 32), "dp", 1, NIC),  # t = 8 fills a node: one member per node
    (_megatron(16, 2, 4, 32, "1f1b"), "dp", 4, 4 * NIC),
    (Layout(4, 2, 1), "dp", 4, NVLINK),  # the whole group in one node
    (_megatron(32, 4, 1, 16), "tp", 4, NVLINK),  # tp inside a node
    # a pipeline send joins one device to one device: one adapter, whatever tp and dp are
    (_megatron(16, 2, 4, 32, "1f1b"), "pp", 1, NIC),
    (_megatron(1, 8, 2, 32, "1f1b"), "pp", 1, NIC),  # t = 8 fills a node: every stage boundary crosses nodes
    (Layout(1, 2, 4, schedule="1f1b", num_microbatches=4), "pp", 1, NVLINK),  # the whole pipeline in one node
])
def test_a_group_crosses_nodes_through_one_adapter_per_member(layout, axis, per_node, bandwidth):
    assert group_ranks_per_node(layout, axis, 8) == per_node
    assert group_link(A100, layout, axis, 8) == (pytest.approx(bandwidth), pytest.approx(
        A100.intra_node_latency_s if bandwidth == NVLINK else A100.inter_node_latency_s))


def test_uneven_groups_go_at_the_rate_of_their_emptiest_node_and_never_beyond_nvlink():
    # dp 12 x pp 2 on 8-GPU nodes: stage 0 holds ranks 0-11 (8 in node 0, 4 in node 1), stage 1 ranks 12-23 (4, 8)
    lay = Layout(12, 1, 2, schedule="1f1b", num_microbatches=2)
    assert group_ranks_per_node(lay, "dp", 8) == 4
    fast_network = A100.replace(inter_node_bandwidth=100e9)  # 8 adapters x 100 GB/s > 300 GB/s of NVLink
    assert group_link(fast_network, _megatron(32, 1, 1, 16), "dp", 8)[0] == pytest.approx(NVLINK)


# ------------------------------------------------------------------------------------------------ pipeline sends
def test_pipeline_send_per_micro_batch_and_its_scatter_gather():
    bsh = 1 * 2048 * 4096 * 2  # one micro-batch's activation, bf16 bytes
    lay = _megatron(16, 2, 4, 32, "interleaved_1f1b", 3)
    lat, nv_lat = A100.inter_node_latency_s, A100.intra_node_latency_s
    # §3.2: b s h per micro-batch between consecutive stages, over the network (t * d = 32 GPUs per stage)
    assert pp_message_time(bsh, lay, A100, 8) == pytest.approx(lat + bsh / NIC)
    # §4.1: each tp rank sends b s h / t over its own adapter, then the next stage all-gathers over NVLink
    sg = pp_message_time(bsh, lay, A100, 8, scatter_gather=True)
    assert sg == pytest.approx(lat + bsh / 2 / NIC + nv_lat + bsh * (2 - 1) / 2 / NVLINK)
    # sequence parallelism: the activation is already sharded over the sequence
    sp = Layout(16, 2, 4, "ddp", 1, 32, "interleaved_1f1b", 3, "full", True)
    assert pp_message_time(bsh, sp, A100, 8) == pytest.approx(lat + bsh / 2 / NIC)
    # in the step: one send forward and one backward per chunk and micro-batch, v chunks (§2.2.2: "the amount of
    # communication also increases by v")
    for scatter_gather, message in ((False, lat + bsh / NIC), (True, sg)):
        pred = predict(GPT_7B, lay, A100, pp_scatter_gather=scatter_gather)
        assert pred.time.pp_comm_s == pytest.approx(32 * 2 * 3 * message)


# ------------------------------------------------------------------------------------------------ the whole step
def test_unpipelined_megatron_step_by_hand():
    """18.4B at (t, p) = (8, 1), d = 32, m = 32 (Table 1's layout): every cost exposed, as Megatron-LM (2021) runs
    it -- tp all-reduces on the critical path (§2.3), the dp all-reduce after the last micro-batch."""
    lay = _megatron(32, 8, 1, 32)
    got = predict(GPT_18B, lay, A100).time
    s, h, a, t, L, V, e, m = 2048, 6144, 48, 8, 40, 51200, 2, 32
    flops = A100.peak_flops * A100.matmul_efficiency
    n_layer = 12 * h * h + 13 * h  # Megatron's block: 12 h^2 weights, 13 h biases and norms (§5.1, eq. 2)
    assert sum(GPT_18B.layer_params()) == n_layer
    f_layer = 6 * n_layer + 12 * h * s + 6 * 2 * h / L  # 6 N + 12 h s per layer, and the final norm's share
    compute = s * (L * f_layer * 4 / 3 + 6 * V * h) / t / flops  # full recomputation: one more forward per layer
    sbh = s * h
    fwd_bytes = (10 * sbh * e + 2 * sbh) + (2 * s * 4 * h * e + a * s * s * (4 * e + 1)) / t
    memory = L * fwd_bytes * (1 + 1.5 + 1) / A100.memory_bandwidth
    allreduce = 2 * (t - 1) * A100.intra_node_latency_s + 2 * sbh * e * (t - 1) / t / NVLINK
    tp = L * 6 * allreduce  # 2 forward + 2 recomputed forward + 2 backward, over NVLink
    split, replicated = 12 * h * h + 7 * h, 6 * h  # matrices, q/k/v and fc biases; 2 norms, 2 row-parallel biases
    params = L * (split / t + replicated) + math.ceil(V / t) * h + s * h + 2 * h  # + vocab shard, positions, final norm
    grads = params * 2
    buckets = math.ceil(grads / (25 << 20))
    dp = buckets * 2 * 31 * A100.inter_node_latency_s + 2 * grads * 31 / 32 / (1 * NIC)  # t = 8: 1 adapter per node
    optimizer = params * (2 + 2 + 2 * 12) / A100.memory_bandwidth
    assert got.compute_s == pytest.approx(m * compute)
    assert got.memory_bound_s == pytest.approx(m * memory)
    assert got.tp_comm_s == pytest.approx(m * tp)
    assert got.dp_comm_s == pytest.approx(dp)
    assert got.optimizer_s == pytest.approx(optimizer)
    assert got.step_time_s == pytest.approx(m * (compute + memory + tp) + dp + optimizer)


# ------------------------------------------------------------------------------------------------ memory-bound kernels
def test_memory_bound_bytes_by_hand():
    s, b, h, a, t, e = 4, 2, 8, 2, 2, 2
    sbh = s * b * h  # 64
    replicated = 10 * sbh * e + 2 * sbh  # 2 layer norms (read + write), 2 dropout-add (2 reads, 1 write, a mask)
    core = a * s * s * b * (4 * e + 1)  # softmax read + write, dropout read + write + mask
    split = 2 * s * b * 4 * h * e + core  # bias-GeLU read + write on 4h
    fwd = replicated + split / t
    assert elementwise_bytes_per_layer(s, b, h, a, t, element_bytes=e) == pytest.approx(2.5 * fwd)
    assert elementwise_bytes_per_layer(s, b, h, a, t, checkpointing="full", element_bytes=e) == pytest.approx(3.5 * fwd)
    assert elementwise_bytes_per_layer(s, b, h, a, t, checkpointing="selective", element_bytes=e) == pytest.approx(
        2.5 * fwd + core / t)
    sp_fwd = (replicated + split) / t
    assert elementwise_bytes_per_layer(s, b, h, a, t, True, element_bytes=e) == pytest.approx(2.5 * sp_fwd)
    with pytest.raises(ValueError, match="checkpointing='some'"):
        elementwise_bytes_per_layer(s, b, h, a, checkpointing="some")


def test_memory_bound_share_falls_with_width_and_its_replicated_part_does_not_shrink_with_tp():
    # the norms, dropouts and residual adds of a layer are not split by tp without sequence parallelism
    one, eight = (elementwise_bytes_per_layer(2048, 1, 6144, 48, t) for t in (1, 8))
    replicated = 2.5 * (10 * 2048 * 6144 * 2 + 2 * 2048 * 6144)
    assert eight - replicated == pytest.approx((one - replicated) / 8)

    def share(model):  # memory-bound time over matmul time, one layer at t = 1
        per_layer = elementwise_bytes_per_layer(model.seq_len, 1, model.hidden_size, model.num_heads)
        matmuls = model.seq_len * model.layer_flops_per_token() / A100.achieved_flops
        return per_layer / A100.memory_bandwidth / matmuls

    # Table 1's 1.7B, 7.5B and 1T widths: per token, O(h + a s) bytes against O(h^2) FLOPs (0.35, 0.16, 0.024 of the
    # matmul time): §5.1, "GPU utilization improves as the models get larger (larger matrix multiplications)"
    shares = [share(ModelSpec(num_layers=L, hidden_size=h, num_heads=a, vocab_size=51200, seq_len=2048))
              for L, h, a in ((24, 2304, 24), (36, 4096, 32), (128, 25600, 160))]
    assert shares[0] > 2 * shares[1] > 4 * shares[2] > 0


# ------------------------------------------------------------------------------------------------ API
def test_scatter_gather_is_a_checked_flag_and_changes_only_pipelined_tensor_parallel_sends():
    with pytest.raises(ValueError, match="pp_scatter_gather=1"):
        plan(GPT_7B, num_devices=16, global_batch_size=16, pp_scatter_gather=1)
    custom = DeviceSpec(name="x", memory_bytes=80e9, peak_flops=1e14, memory_bandwidth=1e12,
                        intra_node_bandwidth=1e11, inter_node_bandwidth=1e10)
    for lay in (_megatron(32, 4, 1, 16), _megatron(32, 1, 4, 16, "1f1b")):  # no pipeline / no tp: the same time
        assert predict(GPT_7B, lay, custom, pp_scatter_gather=True).step_time_s == pytest.approx(
            predict(GPT_7B, lay, custom).step_time_s)
    lay = _megatron(16, 2, 4, 32, "1f1b")
    assert predict(GPT_7B, lay, custom, pp_scatter_gather=True).step_time_s < predict(GPT_7B, lay, custom).step_time_s
