"""Split regions of a tensor-parallel plan: what runs between the column- and row-parallel layers of an attention or
MLP, checked in one process before any split (:mod:`lightning_par.tensor_parallel.regions`), and planned from a
Hugging Face model so that its parameters get their gradients summed over tp (:func:`lightning_par.hf.tensor_parallel.
hf_tp_plan`). No processes."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from lightning_par.tensor_parallel.plan import expand_plan
from lightning_par.tensor_parallel.regions import check_split_regions, split_regions

HEADS, HEAD_DIM, HIDDEN = 4, 8, 32


class ScaledRMS(nn.Module):
    """An RMS norm over the last dim with one learned scale (of any width)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale


class Attention(nn.Module):
    """q/k/v projections split by heads, a per-head norm (right on a part) or a norm over every head (wrong on one)."""

    def __init__(self, norm: str = "per_head", heads_from_config: bool = False, chained: bool = False) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(HIDDEN, HEADS * HEAD_DIM) for _ in range(3))
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN)
        self.gate_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN) if chained else None
        self.q_norm = ScaledRMS()
        self.norm, self.heads_from_config = norm, heads_from_config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        heads = HEADS if self.heads_from_config else -1  # a count of heads read from the config fails on a part
        q = self.q_proj(x)
        q = self.q_norm(q.view(b, s, heads, HEAD_DIM)) if self.norm == "per_head" else self.q_norm(q)
        q, k, v = (t.reshape(b, s, heads, HEAD_DIM).transpose(1, 2) for t in (q, self.k_proj(x), self.v_proj(x)))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        if self.gate_proj is not None:  # a row-parallel output (summed over tp) used again by split code
            out = out * torch.sigmoid(self.gate_proj(out).mean(-1, keepdim=True))
        return self.o_proj(out)


class Net(nn.Module):
    def __init__(self, **kwargs) -> None:
        super().__init__()
        self.attn = Attention(**kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x)


PLAN = {"attn": "colwise_input", "attn.q_proj": "colwise", "attn.k_proj": "colwise", "attn.v_proj": "colwise",
        "attn.o_proj": "rowwise", "attn.q_norm": "replicate_grad_sum"}


def _check(net: nn.Module, plan=PLAN, tp_size: int = 2) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 6, HIDDEN)
    check_split_regions(net, expand_plan(net, plan), tp_size, lambda: net(x), "Net")


def test_a_region_right_on_each_part_passes_and_modes_are_restored():
    torch.manual_seed(0)
    net = Net()
    _check(net)
    _check(net, tp_size=4)
    assert net.training and all(m.training for m in net.modules())
    assert "forward" not in net.attn.q_proj.__dict__  # the simulated layers are given back their forward
    assert list(split_regions(expand_plan(net, PLAN))) == ["attn"]


def test_a_region_in_bf16_is_not_refused_for_rounding():
    torch.manual_seed(0)
    net = Net().to(torch.bfloat16)
    x = torch.randn(2, 6, HIDDEN, dtype=torch.bfloat16)
    check_split_regions(net, expand_plan(net, PLAN), 2, lambda: net(x), "Net")


def test_a_norm_over_every_head_is_refused_naming_the_region():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=re.escape("tensor parallelism (tp_size=2) is not valid for Net: its split "
                                                   "region 'attn' (Attention, column-parallel ['k_proj', 'q_proj', "
                                                   "'v_proj']) computes on one rank's part of its features other "
                                                   "outputs than whole")):
        _check(Net(norm="whole"))


def test_a_count_of_heads_from_the_config_is_refused_with_the_models_error():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"region 'attn' .* fails on one rank's part of its features \(RuntimeError: "):
        _check(Net(heads_from_config=True))


def test_a_reduction_used_again_inside_the_region_is_refused():
    torch.manual_seed(0)
    plan = {**PLAN, "attn.gate_proj": "rowwise"}
    with pytest.raises(ValueError, match=r"sums its row-parallel outputs over the ranks 2 times in one forward"):
        _check(Net(chained=True), plan)


def test_meta_weights_and_plans_without_regions_are_not_run():
    with torch.device("meta"):
        net = Net(norm="whole")
    _check(net)  # nothing to run on meta weights: the ranks check on real ones
    plain = Net(norm="whole")
    _check(plain, {"attn": "replicate"})


# ------------------------------------------------------------------------------------------ Hugging Face models
transformers = pytest.importorskip("transformers")


def _hf(model_type: str, device: str = "meta") -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.support.hf_matrix import quiet, tiny_config

    with quiet(), torch.device(device):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **tiny_config(model_type)))


def test_parameters_inside_a_split_region_get_their_gradients_summed():
    from lightning_par.hf.tensor_parallel import hf_tp_plan

    # Apertus' xIELU activation has learned scalars inside the split MLP; its plan leaves them out
    plan = hf_tp_plan(_hf("apertus"))
    assert plan["model.layers.0.mlp"] == "colwise_input"
    assert plan["model.layers.0.mlp.act_fn"] == "replicate_grad_sum"
    # Sarvam's per-head q_norm / k_norm inside the split attention, which its plan leaves out
    plan = hf_tp_plan(_hf("sarvam_moe"))
    assert plan["model.layers.1.self_attn.q_norm"] == plan["model.layers.1.self_attn.k_norm"] == "replicate_grad_sum"
    # OLMo2's norms over the whole projection run on gathered activations: replicated, gradients whole
    plan = hf_tp_plan(_hf("olmo2"))
    assert plan["model.layers.0.self_attn.q_norm"] == "replicate"


@pytest.mark.parametrize("model_type, block", [("glm4_moe", "model.layers.1.mlp"),
                                               ("llama4_text", "model.layers.1.feed_forward")])
def test_shared_experts_inside_a_moe_block_are_kept_whole(model_type, block):
    from lightning_par.hf.tensor_parallel import hf_tp_plan
    from lightning_par.tensor_parallel.plan import validate_plan

    network = _hf(model_type)
    plan = hf_tp_plan(network)
    assert plan[block] == "sequence_parallel"  # a per-token module: its whole subtree on this rank's tokens
    assert not [p for p in plan if p.startswith(block + ".")], plan
    for sequence_parallel in (False, True):
        validate_plan(network, plan, 2, sequence_parallel)


def test_doges_attention_is_refused_before_any_split():
    from lightning_par import contract

    network = _hf("doge", device="cpu")
    with pytest.raises(ValueError, match=re.escape("tensor parallelism (tp_size=2) is not valid for DogeForCausalLM "
                                                   "(model_type='doge'): its split region 'model.layers.0.self_attn' "
                                                   "(DogeAttention")):
        contract.check_tensor_parallel(network, 2, False, plan=contract.tp_plan(network, network, None))
    llama = _hf("llama", device="cpu")
    contract.check_tensor_parallel(llama, 2, True, plan=contract.tp_plan(llama, llama, None))
