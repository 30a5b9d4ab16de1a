"""Sync BatchNorm with the dp axis: refused on CPU with the reason (torch's own refusal reproduced), given the dp
group on an accelerator; the ``broadcast_buffers`` option validates itself."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_par.data_parallel.buffers import prepare_sync_batchnorm
from lightning_par.data_parallel.options import ReducerOptions
from lightning_par.parallelize import ParallelOptions


def _net() -> nn.Module:
    return nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))


def test_torch_sync_batchnorm_refuses_cpu_input(tmp_path):
    """The reason behind the check below (torch 2.13): a training forward of SyncBatchNorm on CPU raises."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="SyncBatchNorm expected input tensor to be on GPU"):
            _net()(torch.randn(2, 3, 8, 8))
    finally:
        dist.destroy_process_group()


def test_sync_batchnorm_on_cpu_is_refused_naming_the_reason():
    with pytest.raises(ValueError, match=r"1 nn.SyncBatchNorm layer\(s\) found on device='cpu'.*refuses CPU input"):
        prepare_sync_batchnorm(_net(), torch.device("cpu"), group=None)
    assert prepare_sync_batchnorm(nn.BatchNorm1d(3), torch.device("cpu"), group=None) == 0


def test_sync_batchnorm_gets_the_dp_group_on_an_accelerator():
    net, dp_group, own = _net(), object(), object()
    net.add_module("own", nn.SyncBatchNorm(4, process_group=own))
    assert prepare_sync_batchnorm(net, torch.device("cuda"), dp_group) == 2
    assert net[1].process_group is dp_group and net.own.process_group is own


def test_broadcast_buffers_option():
    assert ReducerOptions().broadcast_buffers is True
    assert ParallelOptions.build("zero3", broadcast_buffers=False).reducer.broadcast_buffers is False
    with pytest.raises(ValueError, match="broadcast_buffers"):
        ReducerOptions(broadcast_buffers="yes")
