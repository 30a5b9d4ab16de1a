"""Hugging Face architectures whose forward does more than a Llama's (issue 33), without processes: the attention
backend HFCausalLM builds with, the tensor-parallel plans of fused/gathered projections, the vocab-parallel embedding
around an ``nn.Embedding`` subclass's own forward (one-rank process group), and what is refused before start, read
from the model. Parity under every layout: ``tests/hf/test_hf_architectures_distributed.py``."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytest.importorskip("transformers")

from lightning.pytorch.strategies import StrategyRegistry  # noqa: E402

from lightning_par import contract  # noqa: E402
from lightning_par.hf import HFCausalLM  # noqa: E402
from lightning_par.hf.context import attention_windows  # noqa: E402
from lightning_par.parallel_dims import ParallelDims  # noqa: E402
from tests.hf.test_hf_architectures_distributed import ARCHS, BASE  # noqa: E402


def _hf(arch: str, **overrides) -> HFCausalLM:
    torch.manual_seed(0)
    return HFCausalLM(model_type=arch.split("-")[0], config={**BASE, **ARCHS[arch], **overrides})


def _validate(module: HFCausalLM, **options) -> None:
    """The strategy's checks before the process group starts (``validate_model``), at world 2."""
    entry = StrategyRegistry["parallel_3d"]
    strategy = entry["strategy"](**{**entry["init_params"], **options})
    strategy.connect(module)
    strategy.validate_model(ParallelDims(world_size=2, **{k: v for k, v in options.items() if k.endswith("_size")}))


# ------------------------------------------------------------------------------------------------ attention backend
def test_the_users_attention_implementation_is_kept_and_eager_chosen_where_sdpa_is_refused():
    assert _hf("gemma").model.config._attn_implementation == "sdpa"
    assert _hf("gemma2").model.config._attn_implementation == "eager"  # soft-capping: transformers refuses sdpa
    assert _hf("gpt_oss").model.config._attn_implementation == "eager"  # sinks
    assert _hf("gemma", attn_implementation="eager").model.config._attn_implementation == "eager"


# ------------------------------------------------------------------------------------------- what cp refuses, why
@pytest.mark.parametrize("arch, message", [
    ("gemma2", "model.layers.0.self_attn caps its attention logits (attn_logit_softcapping=50.0)"),
    ("gpt_oss", "model.layers.0.self_attn has attention sinks (model.layers.0.self_attn.sinks, shape (4,))"),
    ("gemma3_text", "model.layers.0.self_attn attends within a sliding window of 8 tokens (config.sliding_window), "
                    "shorter than the sequences the model takes (config.max_position_embeddings=64)"),
    ("mistral", "config.sliding_window attends within a sliding window of 8 tokens"),
])
def test_context_parallelism_refuses_attention_it_cannot_compute_before_start(arch, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _validate(_hf(arch), cp_size=2)


def test_context_parallelism_accepts_a_window_that_never_binds_and_plain_attention():
    for arch in ("gemma3_text-wide", "phi3", "olmo2", "glm4", "gemma"):
        _validate(_hf(arch), cp_size=2)
    assert attention_windows(_hf("gemma3_text").model) == {"model.layers.0.self_attn": 8}
    assert attention_windows(_hf("mistral", sliding_window=None).model) == {}


# --------------------------------------------------------------------------------------------------- tp plans
def test_gathered_and_fused_projections_translate_and_validate_with_sequence_parallelism():
    plans = {arch: contract.tp_plan(_hf(arch).model, _hf(arch).model, None) for arch in ("phi3", "olmo2", "glm4")}
    phi3 = plans["phi3"]
    assert phi3["model.layers.0.self_attn.qkv_proj"] == phi3["model.layers.0.mlp.gate_up_proj"] == "colwise_gather"
    assert phi3["model.layers.0.self_attn.o_proj"] == phi3["model.layers.0.mlp.down_proj"] == "rowwise_split"
    assert phi3["model.layers.0.self_attn"] == "colwise_input"
    olmo2 = plans["olmo2"]  # q/k norms over the whole hidden size run on the gathered q and k
    assert olmo2["model.layers.1.self_attn.q_norm"] == olmo2["model.layers.1.self_attn.k_norm"] == "replicate"
    assert plans["glm4"]["model.layers.0.mlp.gate_up_proj"] == "colwise_gather"
    for plan in plans.values():
        assert plan["lm_head"] == "vocab_head_full" and plan["model.embed_tokens"] == "vocab_embedding_full"
        assert plan["model.layers.0"] == "sequence_scatter" and plan["model.layers.1"] == "sequence_gather"
    for arch in ("phi3", "olmo2", "glm4", "gemma2", "gemma3_text", "olmoe"):
        _validate(_hf(arch), tp_size=2, sequence_parallel=True)


def test_what_tp_cannot_split_is_refused_before_start_naming_it():
    with pytest.raises(ValueError, match=re.escape("parameters ['model.layers.0.self_attn.sinks'")):
        _validate(_hf("gpt_oss"), tp_size=2, sequence_parallel=True)  # its plan leaves attention and experts whole
    with pytest.raises(ValueError, match=re.escape("'model.layers.0.self_attn.q_a_proj.weight'")):
        _validate(_hf("deepseek_v3"), tp_size=2, sequence_parallel=True)  # MLA: not in its plan
    with pytest.raises(ValueError, match=r"config.sliding_window attends within a sliding window of 8 tokens"):
        _validate(_hf("mistral"), cp_size=2, tp_size=1)


def test_gpt2_conv1d_layers_get_a_plan_split_on_their_transposed_weights():
    model = _hf("gpt2").model
    plan = contract.tp_plan(model, model, None)
    assert plan["transformer.h.0.attn.c_attn"] == "colwise_gather" and plan["transformer.h.0.mlp.c_fc"] == "colwise"
    assert plan["transformer.h.1.attn.c_proj"] == "rowwise_split" and plan["transformer.h.1.mlp.c_proj"] == "rowwise"
    assert plan["transformer.wpe"] == plan["transformer.ln_f"] == "replicate"
    _validate(_hf("gpt2"), tp_size=2, sequence_parallel=True)


# ------------------------------------------------------------------------ the vocab-parallel embedding's own forward
@pytest.fixture
def one_rank_mesh():
    """A one-rank gloo process group (in this process) and its 1-D tp mesh, destroyed afterwards."""
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group already exists")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def test_a_scaled_embedding_keeps_its_scale_and_a_forward_without_nn_embedding_is_refused(one_rank_mesh):
    from torch.distributed.tensor.parallel import parallelize_module

    from lightning_par.tensor_parallel.plan import resolve_style

    embedding = _hf("gemma").model.get_input_embeddings()
    ids = torch.randint(0, 256, (2, 5))
    expected = embedding(ids)
    assert not torch.allclose(expected, nn.functional.embedding(ids, embedding.weight))  # sqrt(hidden) scale
    for style in ("vocab_embedding", "vocab_embedding_full"):
        wrapped = parallelize_module(_hf("gemma").model.get_input_embeddings(), one_rank_mesh,
                                     resolve_style(style, True), src_data_rank=None)
        assert type(wrapped).__name__ == type(embedding).__name__
        torch.testing.assert_close(wrapped(ids), expected, rtol=0, atol=0)

    class OwnLookup(nn.Embedding):  # reads its weight itself: a vocabulary shard cannot serve it
        def forward(self, input):
            return self.weight[input] * 2.0

    message = r"cannot split .*OwnLookup over the vocabulary: its forward reached nn.Embedding.forward 0 times"
    with pytest.raises(ValueError, match=message):
        parallelize_module(OwnLookup(8, 4), one_rank_mesh, resolve_style("vocab_embedding", False),
                           src_data_rank=None)
