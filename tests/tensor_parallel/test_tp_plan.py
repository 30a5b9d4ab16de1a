"""Tensor-parallel plans and the strategy's checks, without processes: every bad input raises before training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_par.models import GPT, GPTConfig, GPTLightningModule
from lightning_par.models.gpt_tp_plan import GPT_TP_PLAN, gpt_tp_plan, validate_gpt_tp
from lightning_par.parallel_dims import ParallelDims
from lightning_par.strategies.tensor_parallel import TensorParallelStrategy
from lightning_par.tensor_parallel import (
    STYLE_NAMES,
    VOCAB_SIZE_ATTR,
    check_plan_styles,
    expand_plan,
    megatron_layer_comm_bytes,
    padded_vocab_size,
    resolve_style,
    strip_vocab_padding,
    uses_vocab_parallel_loss,
    validate_plan,
)
from lightning_par.tensor_parallel.vocab import mask_padded_logits
from tests.support.tensor_parallel import ToyLM

TINY = dict(n_layer=2, n_head=4, n_embd=32, block_size=16, vocab_size=255)


def gpt(**kw) -> GPT:
    return GPT(GPTConfig(**{**TINY, **kw}))


# ------------------------------------------------------------------------------------------------ the GPT plan
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_gpt_plan_is_valid(tp, sp):
    expanded = validate_plan(gpt(), gpt_tp_plan(), tp, sp)
    assert expanded["blocks.1.attn.q_proj"] == "colwise"
    assert expanded["blocks.0.mlp.c_proj"] == "rowwise"
    assert list(expanded.values())[0] == "colwise_input"  # applied first
    assert uses_vocab_parallel_loss(gpt_tp_plan())


def test_gpt_plan_resolves_per_mode():
    names = gpt_tp_plan()
    assert names == GPT_TP_PLAN and names is not GPT_TP_PLAN
    for sp in (False, True):
        styles = gpt_tp_plan(sp)
        assert styles.keys() == names.keys()
        assert type(styles["lm_head"]).__name__ == "VocabParallelHead"
    assert type(gpt_tp_plan(True)["ln_f"]).__name__ == "PlainSequenceParallel"
    assert type(gpt_tp_plan(False)["ln_f"]).__name__ == "ReplicateParallel"


def test_every_gpt_parameter_is_covered():
    model = gpt()
    expanded = expand_plan(model, gpt_tp_plan())
    owners = {name.rsplit(".", 1)[0] for name, _ in model.named_parameters()}
    assert owners <= set(expanded), owners - set(expanded)


def test_skip_absent_for_pipeline_stages():
    stage = gpt()
    stage.wte = None
    stage.wpe = None
    del stage.blocks["0"]
    with pytest.raises(ValueError, match="'wte'.*None"):
        expand_plan(stage, gpt_tp_plan())
    expanded = expand_plan(stage, gpt_tp_plan(), skip_absent=True)
    assert "wte" not in expanded and "blocks.1.attn.q_proj" in expanded and "blocks.0.attn" not in expanded
    validate_plan(stage, gpt_tp_plan(), 2, True, skip_absent=True)  # sequence shards come from an earlier stage


# ------------------------------------------------------------------------------------------------ GPT shape errors
def test_n_head_not_divisible():
    with pytest.raises(ValueError, match=r"GPTConfig.n_head=3 is not divisible by tp_size=2.*\[1, 3\]"):
        validate_gpt_tp(GPTConfig(n_layer=1, n_head=3, n_embd=48, block_size=16), 2)


def test_n_embd_not_divisible():
    with pytest.raises(ValueError, match=r"GPTConfig.n_embd=36 is not divisible by tp_size=8"):
        validate_gpt_tp(GPTConfig(n_layer=1, n_head=3, n_embd=36, block_size=16), 8)


def test_block_size_with_sequence_parallel():
    cfg = GPTConfig(n_layer=1, n_head=4, n_embd=32, block_size=18)
    validate_gpt_tp(cfg, 4, sequence_parallel=False)
    with pytest.raises(ValueError, match=r"block_size=18 is not divisible by tp_size=4.*sequence_parallel"):
        validate_gpt_tp(cfg, 4, sequence_parallel=True)


# ------------------------------------------------------------------------------------------------ plan errors
def test_missing_module():
    with pytest.raises(ValueError, match=r"plan path 'blocks.\*.attn.qkv' names a missing module.*'q_proj'"):
        validate_plan(gpt(), {**gpt_tp_plan(), "blocks.*.attn.qkv": "colwise"}, 2, False)
    with pytest.raises(ValueError, match=r"plan path 'decoder' names a missing module: the model has no child"):
        expand_plan(gpt(), {"decoder": "replicate"})


def test_unknown_style():
    with pytest.raises(ValueError, match=r"plan\['lm_head'\]='vocab_parallel' is not a valid style: expected one of"):
        check_plan_styles({"lm_head": "vocab_parallel"})
    with pytest.raises(ValueError, match="is not a valid style"):
        TensorParallelStrategy(tp_size=2, plan={"head": "columnwise"})
    with pytest.raises(ValueError, match="tensor-parallel style 'x' is not valid"):
        resolve_style("x", False)


def test_bad_plan_shapes():
    with pytest.raises(ValueError, match="expected a dict"):
        check_plan_styles(["colwise"])
    with pytest.raises(ValueError, match="at least one"):
        check_plan_styles({})
    with pytest.raises(ValueError, match="plan key 3 is not valid"):
        check_plan_styles({3: "replicate"})
    assert expand_plan(nn.Linear(2, 2), {"": "replicate"}) == {"": "replicate"}


def test_style_on_wrong_module_type():
    plan = {**gpt_tp_plan(), "blocks.*.ln_1": "colwise"}
    with pytest.raises(ValueError, match=r"plan\['blocks.0.ln_1'\]='colwise' is not valid for a LayerNorm"):
        validate_plan(gpt(), plan, 2, False)


def test_two_styles_for_one_module():
    with pytest.raises(ValueError, match="two styles"):
        expand_plan(gpt(), {"blocks.*.attn.q_proj": "colwise", "blocks.0.attn.q_proj": "rowwise"})


def test_colwise_not_divisible():
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 4))
    with pytest.raises(ValueError, match=r"out_features=6 is not divisible by tp_size=4"):
        validate_plan(model, {"0": "colwise", "1": "rowwise"}, 4, False)


def test_uncovered_parameters_are_refused_under_sequence_parallelism_only():
    # Without sequence parallelism a module outside the plan runs on replicated activations (a plain replicated
    # parameter, as in torch's own plan); with it, it would see a sequence shard and get a partial gradient.
    plan = {k: v for k, v in gpt_tp_plan().items() if k != "ln_f"}
    validate_plan(gpt(), plan, 2, False)
    with pytest.raises(ValueError, match=r"parameters \['ln_f.weight', 'ln_f.bias'\] are not covered .* sequence_par"):
        validate_plan(gpt(), plan, 2, True)


# ------------------------------------------------------------------------------------------------ sequence parallel
def test_sequence_parallel_needs_a_vocab_embedding():
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    plan = {"": "colwise_input", "0": "colwise", "1": "rowwise"}
    validate_plan(model, plan, 2, False)
    with pytest.raises(ValueError, match="sequence_parallel=True is not supported for this model.*'vocab_embedding'"):
        validate_plan(model, plan, 2, True)


def test_sequence_parallel_needs_every_norm_planned():
    plan = {**ToyLM.PLAN, "norm": "replicate"}
    validate_plan(ToyLM(), plan, 2, False)
    with pytest.raises(ValueError, match=r"norm 'norm' \(LayerNorm\) is planned as 'replicate'"):
        validate_plan(ToyLM(), plan, 2, True)


def test_sequence_parallel_needs_colwise_input():
    plan = {k: v for k, v in ToyLM.PLAN.items() if k != "ffn"}
    validate_plan(ToyLM(), plan, 2, False)
    with pytest.raises(ValueError, match=r"plan\['ffn.0'\]='colwise' has no 'colwise_input'"):
        validate_plan(ToyLM(), plan, 2, True)


# ------------------------------------------------------------------------------------------------ strategy
def connected(module: nn.Module, **kw) -> TensorParallelStrategy:
    strategy = TensorParallelStrategy(**kw)
    strategy.connect(module)
    return strategy


def test_strategy_validates_the_gpt_before_the_process_group():
    module = GPTLightningModule(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
    connected(module, tp_size=2).validate_model(ParallelDims(tp_size=2, world_size=2))
    with pytest.raises(ValueError, match=r"n_head=2 is not divisible by tp_size=4"):
        connected(module, tp_size=4).validate_model(ParallelDims(tp_size=4, world_size=4))


def test_strategy_needs_a_plan_for_other_models():
    with pytest.raises(ValueError, match=r"tensor parallelism needs a plan for ToyLM: pass plan="):
        connected(ToyLM(), tp_size=2).validate_model(ParallelDims(tp_size=2, world_size=2))
    connected(ToyLM(), tp_size=2, plan=ToyLM.PLAN).validate_model(ParallelDims(tp_size=2, world_size=2))


def test_strategy_rejects_sequence_parallel_for_unsupported_plan():
    plan = {**ToyLM.PLAN, "out_norm": "replicate"}
    strategy = connected(ToyLM(), tp_size=2, plan=plan, sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence_parallel=True is not supported"):
        strategy.validate_model(ParallelDims(tp_size=2, world_size=2))


def test_strategy_options():
    with pytest.raises(ValueError, match="sequence_parallel='yes' is not valid"):
        TensorParallelStrategy(tp_size=2, sequence_parallel="yes")
    with pytest.raises(ValueError, match="bucket_cap_mb=0 is not valid"):
        TensorParallelStrategy(tp_size=2, bucket_cap_mb=0)
    with pytest.raises(ValueError, match="tp_size=0 is not valid"):
        TensorParallelStrategy(tp_size=0)
    strategy = TensorParallelStrategy(tp_size=2, dp_size=2)
    assert strategy.resolve_parallel_dims(4).shape == (1, 1, 2, 1, 2)
    with pytest.raises(ValueError, match="does not equal world_size=6"):
        strategy.resolve_parallel_dims(6)


def test_registered_name():
    from lightning.pytorch.strategies import StrategyRegistry

    if TensorParallelStrategy.strategy_name not in StrategyRegistry:
        TensorParallelStrategy.register_strategies(StrategyRegistry)
    strategy = StrategyRegistry.get("tensor_parallel")
    assert isinstance(strategy, TensorParallelStrategy)


def test_plan_from_hydra_dictconfig():
    from omegaconf import OmegaConf

    plan = OmegaConf.create(dict(ToyLM.PLAN))
    strategy = connected(ToyLM(), tp_size=2, plan=plan)
    strategy.validate_model(ParallelDims(tp_size=2, world_size=2))


# ------------------------------------------------------------------------------------------------ vocab and theory
def test_padded_vocab_size():
    assert padded_vocab_size(256, 4) == 256
    assert padded_vocab_size(255, 4) == 256
    assert padded_vocab_size(50257, 8, multiple=128) == 51200  # Megatron: GPT-2 vocab, tp 8, divisible by 128
    assert padded_vocab_size(50257, 1, multiple=64) == 50304  # nanoGPT's padding
    assert padded_vocab_size(10, 4) == 12
    with pytest.raises(ValueError, match="tp_size=0 is not valid"):
        padded_vocab_size(10, 0)


def test_mask_padded_logits():
    logits = torch.zeros(2, 3)
    masked = mask_padded_logits(logits, first_column=3, vocab_size=5)  # columns 3, 4 real; 5 padded
    assert masked[:, :2].eq(0).all() and masked[:, 2].eq(torch.finfo(torch.float32).min).all()
    assert mask_padded_logits(logits, 0, 3) is logits
    full = torch.cat([torch.randn(4, 5), torch.full((4, 1), torch.finfo(torch.float32).min)], dim=1)
    target = torch.randint(0, 5, (4,))
    torch.testing.assert_close(
        torch.nn.functional.cross_entropy(full, target), torch.nn.functional.cross_entropy(full[:, :5], target)
    )


def test_strip_vocab_padding():
    model = nn.Sequential(nn.Embedding(6, 2))
    setattr(model[0], VOCAB_SIZE_ATTR, 5)
    state = {"0.weight": torch.arange(12.0).view(6, 2), "other": torch.zeros(6)}
    out = strip_vocab_padding(model, state)
    assert out["0.weight"].shape == (5, 2) and out["other"].shape == (6,)
    assert strip_vocab_padding(model, {"m.0.weight": torch.zeros(6, 2)}, prefix="m.")["m.0.weight"].shape == (5, 2)


def test_megatron_layer_bytes():
    # 8 b s h (t-1)/t elements of 4 bytes: b=2, s=8, h=32, t=4 -> 8*512*3/4*4 = 12288
    assert megatron_layer_comm_bytes(2, 8, 32, 4) == 12288
    assert megatron_layer_comm_bytes(2, 8, 32, 1) == 0


def test_style_names_documented():
    import lightning_par.tensor_parallel.plan as plan_module

    for name in STYLE_NAMES:
        assert f"``{name}``" in plan_module.__doc__
