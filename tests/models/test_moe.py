"""The MoE layer, the GPT's MoE presets and the ep axis's checks, without processes: shapes, parameter counts, the
bad values each option refuses (before any process starts), and the per-sequence losses' independence of the split."""

from __future__ import annotations

import pytest
import torch

from lightning_par.aux_loss import attach_aux_loss, set_aux_loss_scale
from lightning_par.models import GPTConfig
from lightning_par.models.gpt import GPT
from lightning_par.models.moe import MoE
from lightning_par.parallel_dims import ParallelDims


@pytest.mark.parametrize("preset", ["moe_tiny", "moe_small"])
def test_presets_count_their_parameters_and_make_every_other_block_moe(preset):
    config = GPTConfig.from_preset(preset)
    model = GPT(config)
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    assert model.expert_modules() == [f"blocks.{i}.mlp.experts" for i in range(config.n_layer) if i % 2 == 1]
    # the experts' active size (top-2 of hidden 2 d) equals a dense MLP's weights (4 d); the router comes on top and
    # the experts have no biases (the dense MLP's are 5 d)
    dense = GPTConfig.from_preset(preset.removeprefix("moe_"))
    d = config.n_embd
    assert config.num_active_params() - dense.num_params() == config.n_layer // 2 * (config.num_experts * d - 5 * d)


@pytest.mark.parametrize("field, value, words", [
    ("num_experts", 1, "an integer >= 2"),
    ("moe_top_k", 3, "1 or 2"),
    ("moe_gating", "relu", "softmax"),
    ("moe_capacity_factor", 0.0, "dropless"),
    ("moe_aux_loss_coeff", -1.0, ">= 0"),
    ("moe_every", 5, "at most n_layer"),
])
def test_bad_moe_options_name_the_field(field, value, words):
    with pytest.raises(ValueError, match=field) as err:
        GPTConfig.from_preset("moe_tiny", **{field: value})
    assert words in str(err.value)


def test_ep_size_must_divide_dp_shard_times_cp():
    with pytest.raises(ValueError, match=r"ep_size=3 .* one of \[1, 2, 4\]"):
        ParallelDims(world_size=4, ep_size=3)
    dims = ParallelDims(world_size=8, dp_size=2, cp_size=2, tp_size=2, ep_size=4)
    assert (dims.size("ep"), dims.size("edp_shard"), dims.size("edp")) == (4, 1, 1)
    assert dims.sizes()["ep_size"] == 4


def test_num_experts_not_divisible_by_ep_size_is_refused_before_start():
    from lightning_par.parallelize import ParallelOptions, validate
    from lightning_par.models import GPTLightningModule

    module = GPTLightningModule(GPTConfig.from_preset("moe_tiny", num_experts=6))
    dims = ParallelDims(world_size=4, ep_size=4)
    with pytest.raises(ValueError, match=r"ep_size=4 is not valid for blocks.1.mlp.experts with num_experts=6"):
        validate(module, dims, ParallelOptions.build("ddp", "model", "none"))


def test_a_network_without_experts_is_refused_at_ep2():
    from lightning_par.parallelize import ParallelOptions, validate
    from lightning_par.models import GPTLightningModule

    with pytest.raises(ValueError, match="names no experts"):
        validate(GPTLightningModule(GPTConfig.from_preset("tiny")), ParallelDims(world_size=2, ep_size=2),
                 ParallelOptions.build("ddp", "model", "none"))


def test_sequence_parallel_with_moe_blocks_is_refused():
    model = GPT(GPTConfig.from_preset("moe_tiny"))
    with pytest.raises(ValueError, match="sequence_parallel=True is not valid with GPTConfig.num_experts=4"):
        model.check_tensor_parallel(2, True)
    model.check_tensor_parallel(2, False)


@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
def test_gradients_do_not_depend_on_the_batch_split(gating):
    """Per-sequence load balance and per-token z-loss: a batch's gradient (every parameter, the router's included)
    equals the sum of its halves' gradients, each half's loss weighted by 1/2 and its auxiliary losses too."""
    torch.manual_seed(0)
    layer = MoE(8, 16, 4, 2, gating=gating, shared_expert=True, aux_loss_coeff=1.0, z_loss_coeff=1.0)
    x = torch.randn(4, 6, 8)
    layer(x).pow(2).mean().backward()
    whole = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    set_aux_loss_scale(0.5)
    try:
        for part in (x[:2], x[2:]):
            (layer(part).pow(2).mean() * 0.5).backward()
    finally:
        set_aux_loss_scale(1.0)
    for n, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, whole[n], rtol=1e-5, atol=1e-7)
    # and the auxiliary losses did contribute: without them the router's gradient differs
    layer.zero_grad()
    layer.aux_loss_coeff = layer.z_loss_coeff = 0.0
    layer(x).pow(2).mean().backward()
    assert not torch.allclose(layer.router.gate.weight.grad, whole["router.gate.weight"])


def test_attach_aux_loss_sends_the_scale_into_the_auxiliary_loss():
    w = torch.ones(3, requires_grad=True)
    x = torch.zeros(2, requires_grad=True)
    set_aux_loss_scale(0.25)
    try:
        y = attach_aux_loss(x * 1.0, (w * 2).sum())
    finally:
        set_aux_loss_scale(1.0)
    y.sum().backward()
    torch.testing.assert_close(w.grad, torch.full((3,), 0.5))
    torch.testing.assert_close(x.grad, torch.ones(2))


def test_edp_has_a_stride_only_without_hsdp():
    dims = ParallelDims(world_size=8, dp_size=4, tp_size=2, ep_size=2)
    assert (dims.stride("ep"), dims.stride("edp_shard"), dims.stride("edp")) == (2, 4, 4)
    with pytest.raises(ValueError, match="not evenly spaced"):
        ParallelDims(world_size=8, dp_replicate_size=2, dp_shard_size=4, ep_size=2).stride("edp")
