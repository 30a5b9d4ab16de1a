"""Storage-deduplicated byte counts of lightning_par.memory."""

import pytest
import torch
from torch import nn

from lightning_par.memory import model_state_bytes, peak_memory_bytes, storage_bytes


def test_view_and_base_count_once() -> None:
    base = torch.zeros(10, 4)  # 160 bytes
    assert storage_bytes([base, base[2:5], base.t(), base.view(-1)]) == 160


def test_view_counts_whole_storage() -> None:
    base = torch.zeros(100)
    assert storage_bytes([base[:10]]) == 400


def test_two_tensors_count_twice() -> None:
    assert storage_bytes([torch.zeros(10), torch.zeros(10)]) == 80


def test_flat_buffer_with_views_counts_once() -> None:
    flat = torch.zeros(30, dtype=torch.float64)  # 240 bytes
    views = [flat[0:10].view(2, 5), flat[10:25], flat[25:30]]
    assert storage_bytes(views) == 240
    assert storage_bytes([flat, *views]) == 240


def test_none_and_meta() -> None:
    assert storage_bytes([None, torch.empty(8, device="meta")]) == 0
    with pytest.raises(TypeError):
        storage_bytes([3])


def test_model_state_bytes_linear_before_and_after_adam_step() -> None:
    model = nn.Linear(8, 4)  # weight 32 + bias 4 float32 = 144 bytes
    opt = torch.optim.Adam(model.parameters())
    assert model_state_bytes(model, [opt]) == {"param_bytes": 144, "grad_bytes": 0, "optimizer_state_bytes": 0}

    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    counts = model_state_bytes(model, [opt])
    assert counts["param_bytes"] == 144
    assert counts["grad_bytes"] == 144
    # exp_avg + exp_avg_sq = 2 x params, plus one 0-d float32 `step` tensor (4 bytes) per parameter.
    steps = [opt.state[p]["step"] for p in model.parameters()]
    assert all(s.dtype == torch.float32 and s.numel() == 1 for s in steps)
    assert counts["optimizer_state_bytes"] == 2 * 144 + 2 * 4


def test_tied_parameter_counted_once() -> None:
    a, b = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
    b.weight = a.weight
    assert model_state_bytes(nn.Sequential(a, b))["param_bytes"] == 64


def test_lightning_optimizer_unwrapped() -> None:
    model = nn.Linear(2, 2, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(1, 2)).sum().backward()
    opt.step()

    class Wrapper:  # stands in for lightning.pytorch.core.optimizer.LightningOptimizer
        _optimizer = opt

    assert model_state_bytes(model, [Wrapper()])["optimizer_state_bytes"] == 16  # momentum_buffer


def test_peak_memory_cpu_is_positive_rss() -> None:
    assert peak_memory_bytes("cpu") > 1 << 20  # a Python process with torch has more than 1 MiB resident
    with pytest.raises(ValueError):
        peak_memory_bytes("meta")


def test_dtensor_counts_local_shard() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if dist.is_initialized():
        pytest.skip("a process group already exists")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        full = torch.zeros(8, 4)
        dt = distribute_tensor(full, mesh, [Shard(0)])
        local = dt.to_local()
        assert storage_bytes([dt]) == local.untyped_storage().nbytes() == 128
        assert storage_bytes([dt, local]) == 128
    finally:
        dist.destroy_process_group()


def test_step_memory_tracker_counts_live_storages_and_their_peak() -> None:
    from lightning_par.memory import LiveStorageBytes, StepMemoryTracker

    held = torch.zeros(250)  # 1000 bytes alive at entry
    with StepMemoryTracker([held, held[10:]]) as tracker:  # a view of a counted storage adds nothing
        assert tracker.start_bytes == 1000
        a = torch.empty(1000)  # +4000
        b = torch.empty(2000)  # +8000: 13000 alive, the peak
        b.add_(1.0)  # in place: no new storage
        del a  # -4000
        c = torch.empty(500)  # +2000: 11000
        d = c.view(10, 50)  # a view: nothing
    assert tracker.peak_bytes == 13000
    assert tracker.live.live == 11000
    del b, c, d
    assert tracker.live.live == 1000  # frees are seen after the tracker has exited too

    live = LiveStorageBytes()
    x = torch.zeros(4)
    live.add(x)
    live.add(x)
    assert live.live == 16
    del x
    assert live.live == 0 and live.peak == 16


def test_nf4_weight_counts_its_inner_tensors() -> None:
    """torchao's NF4Tensor (QLoRA's frozen base) has no storage of its own: its codes and scales are counted, and a
    frozen NF4 parameter splits as frozen (summary.json's frozen_param_bytes of a QLoRA run)."""
    nf4 = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    from lightning_par.memory import param_split_bytes

    weight = nf4.to_nf4(torch.randn(256, 512, dtype=torch.bfloat16), 64, 256)
    held = storage_bytes([weight])
    # 4-bit codes (half a byte per element) plus the double-quantized scales (measured 67,634 bytes): over a quarter
    # of bf16's 262,144 by the scales only
    assert 256 * 512 // 2 < held < 256 * 512 * 2 * 0.27, held
    layer = torch.nn.Linear(512, 256, bias=False)
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    assert param_split_bytes(layer) == {"trainable_param_bytes": 0, "frozen_param_bytes": held}
