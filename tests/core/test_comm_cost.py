"""lightning_par.comm_cost: the ring volumes, steps and alpha-beta time the planner and the byte counters share."""

import pytest

from lightning_par import comm_cost as cc


def test_ring_volumes_per_rank() -> None:
    # 4 ranks: one pass around the ring sends 3/4 of the buffer
    assert cc.ring_fraction(4) == 0.75
    assert cc.all_reduce_bytes(100, 4) == 150.0  # 2 B (n-1)/n
    assert cc.all_gather_bytes(100, 4) == cc.reduce_scatter_bytes(100, 4) == 75.0  # B (n-1)/n
    assert cc.all_to_all_bytes(100, 4) == cc.broadcast_bytes(100, 4) == 75.0
    assert cc.send_bytes(100) == 100.0
    assert cc.all_reduce_bytes(100, 1) == cc.all_gather_bytes(100, 1) == 0.0  # a group of one sends nothing


def test_whole_byte_counts_stay_exact() -> None:
    # an all-gather of 3 inputs of 1000 bytes sends exactly 2 of them, with no rounding of (n-1)/n first
    assert cc.all_gather_bytes(3 * 1000, 3) == 2000.0


def test_ring_steps_and_time() -> None:
    assert [cc.ring_steps(op, 4) for op in ("all_reduce", "all_gather", "reduce_scatter", "p2p")] == [6, 3, 3, 1]
    with pytest.raises(ValueError, match="op='gather' is not valid"):
        cc.ring_steps("gather", 4)
    # 2 ops of 6 steps at 1 us each, plus 1 MB at 1 GB/s
    assert cc.collective_time(1e6, 1e9, 1e-6, num_ops=2, steps=6) == pytest.approx(12e-6 + 1e-3)


def test_megatron_layer_bytes() -> None:
    # Narayanan et al. 2021, §3.2: 8 b s h (t-1)/t elements; 12 with the forward recomputed
    assert cc.megatron_layer_bytes(2, 8, 32, 4, 4) == 8 * 2 * 8 * 32 * 3 / 4 * 4
    assert cc.megatron_layer_bytes(2, 8, 32, 4, 4, recompute_forward=True) == 12 * 2 * 8 * 32 * 3 / 4 * 4


def test_planner_and_counters_use_these_formulas() -> None:
    from lightning_par.planner import comm
    from lightning_par.tensor_parallel.comm_volume import megatron_layer_comm_bytes

    assert comm.allreduce_bytes is cc.all_reduce_bytes and comm.allgather_bytes is cc.all_gather_bytes
    assert comm.collective_time is cc.collective_time and comm.ring_steps is cc.ring_steps
    assert comm.tp_layer_comm_bytes is cc.megatron_layer_bytes
    assert megatron_layer_comm_bytes(2, 8, 32, 4) == cc.megatron_layer_bytes(2, 8, 32, 4, 4)
