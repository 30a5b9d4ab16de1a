"""The HF adapter's pipeline stages, context-parallel attention and experts, in one process (no process group).

Stages chained give the plain model's logits and share its parameters under their names (a pipelined checkpoint
loads into the plain module); bad inputs are refused with a ValueError naming the model and what would be valid;
under cp positions, ``transformers`` builds a mask the cp attention refuses, and the adapter's context removes it;
the qwen3_moe blocks switched to the contract's experts call give the same logits and gradients.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lightning_par import contract
from lightning_par.context_parallel.contract import context_parallel_attention
from lightning_par.pipeline_parallel.split import cut_network

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[])


def _model(model_type: str, **overrides: Any) -> Any:
    torch.manual_seed(0)
    extra = MOE if model_type == "qwen3_moe" else {}
    config = transformers.AutoConfig.for_model(model_type, **{**TINY, **extra, **overrides})
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config)


IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe"])
def test_stages_chained_give_the_model_logits_and_its_parameter_names(model_type: str) -> None:
    model = _model(model_type)
    ref = model(input_ids=IDS).logits
    layers = contract.pipeline_layers(model)
    assert layers == [f"model.layers.{i}" for i in range(4)]
    stages = [contract.pipeline_stage(model, layers[:1], first=True, last=False),
              contract.pipeline_stage(model, layers[1:3], first=False, last=False),
              contract.pipeline_stage(model, layers[3:], first=False, last=True)]
    out = IDS
    for stage in stages:
        out = stage(out)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    # with global positions passed along (context parallelism under pipelining): the same logits
    out = (IDS, torch.arange(16).expand(2, -1).contiguous())
    for stage in stages:
        out = stage(*out) if isinstance(out, tuple) else stage(out)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    # every stage parameter is the model's own tensor under the model's name; together they cover the model
    own = dict(model.named_parameters())
    names = [n for s in stages for n, p in s.named_parameters() if own[n] is p]
    assert sorted(names) == sorted(own)


def test_a_pipelined_checkpoint_loads_into_the_plain_module() -> None:
    model = _model("qwen3")
    state: dict[str, torch.Tensor] = {}
    for stage in (0, 1):  # what each pp rank holds after the cut, under its names
        holder, _ = cut_network(model, [2, 2], [stage])
        state.update(holder.state_dict())
    fresh = _model("qwen3")
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh.load_state_dict(state, strict=True)
    torch.testing.assert_close(fresh(input_ids=IDS).logits, model(input_ids=IDS).logits, rtol=0, atol=0)


def test_an_architecture_without_a_pp_plan_is_refused() -> None:
    config = transformers.AutoConfig.for_model("gpt2", n_embd=32, n_layer=2, n_head=2, vocab_size=256)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel \(model_type='gpt2'\).*no base_model_pp_plan"):
        contract.pipeline_layers(model)


def test_tied_embeddings_are_refused() -> None:
    with pytest.raises(ValueError, match="tie_word_embeddings=True.*tie_word_embeddings=False"):
        contract.pipeline_layers(_model("llama", tie_word_embeddings=True))


def test_bad_stage_inputs_are_refused() -> None:
    model = _model("llama")
    with pytest.raises(ValueError, match=r"\['model.layers.9'\] are not valid for LlamaForCausalLM"):
        contract.pipeline_stage(model, ["model.layers.9"], first=True, last=False)
    stage = contract.pipeline_stage(model, ["model.layers.1"], first=False, last=False)
    with pytest.raises(ValueError, match=r"shape \(2, 16\) is not valid: expected hidden states"):
        stage(IDS)
    windowed = contract.pipeline_stage(_model("mistral", sliding_window=8), ["model.layers.0"], first=True,
                                       last=False)
    with pytest.raises(ValueError, match="sequence length 16 .* sliding_window=8"):
        windowed(IDS)


class _SDPARecorder(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict[str, Any]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.calls.append({"mask": kwargs.get("attn_mask"), "is_causal": kwargs.get("is_causal")})
        return func(*args, **kwargs)


def test_cp_positions_reach_sdpa_unmasked_under_the_adapter_context() -> None:
    model = _model("llama")
    positions = torch.tensor([[0, 1, 2, 3, 12, 13, 14, 15]])  # cp rank 0 of 2 on 16 tokens
    ids = IDS[:1, :8]
    with _SDPARecorder() as plain:  # transformers reads the jump as a second packed sequence: a mask
        model(input_ids=ids, position_ids=positions, use_cache=False)  # as in training (HFCausalLM)
    assert plain.calls and all(c["mask"] is not None for c in plain.calls)
    attention = context_parallel_attention(model)
    assert attention is not None
    with attention(), _SDPARecorder() as cp:
        model(input_ids=ids, position_ids=positions, use_cache=False)
    assert len(cp.calls) == 4 and all(c["mask"] is None and c["is_causal"] for c in cp.calls)
    assert model.config._attn_implementation == "sdpa"  # restored


MIXTRAL = dict(num_local_experts=4, num_experts_per_tok=2)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_moe_experts_in_the_contract_call_match_transformers(model_type: str) -> None:
    extra = MIXTRAL if model_type == "mixtral" else {}
    plain, switched = _model(model_type, **extra), _model(model_type, **extra)
    paths = contract.expert_modules(switched)
    assert paths == [f"model.layers.{i}.mlp.experts" for i in range(4)]
    assert contract.num_experts(switched, paths[0]) == 4
    assert contract.expert_modules(switched) == paths  # idempotent
    assert [n for n, _ in switched.named_parameters()] == [n for n, _ in plain.named_parameters()]
    for model in (plain, switched):
        model(input_ids=IDS).logits.square().mean().backward()
    torch.testing.assert_close(switched(input_ids=IDS).logits, plain(input_ids=IDS).logits, rtol=0, atol=1e-6)
    for (name, p), q in zip(plain.named_parameters(), switched.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_an_unsupported_moe_architecture_or_router_is_refused_for_ep() -> None:
    model = _model("qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[])
    with pytest.raises(ValueError, match=r"Qwen2MoeSparseMoeBlock\) is not supported; supported: \['Qwen3MoeSparse"):
        contract.expert_modules(model)
    with pytest.raises(ValueError, match="router_jitter_noise=0.01: .* expected router_jitter_noise=0"):
        contract.expert_modules(_model("mixtral", router_jitter_noise=0.01, **MIXTRAL))


def test_cp_refuses_a_sliding_window_shorter_than_the_sequence() -> None:
    from lightning_par.context_parallel import sequence

    model = _model("mistral", sliding_window=8)
    positions = torch.tensor([0, 1, 2, 3, 12, 13, 14, 15])
    sequence.push(sequence.SequenceShard(None, positions, 2))
    try:
        with context_parallel_attention(model)(), pytest.raises(
            ValueError, match=r"sliding_window=8 on sequences of 16 tokens"
        ):
            model(input_ids=IDS[:1, :8], position_ids=positions[None], use_cache=False)
    finally:
        sequence.pop()


def test_layouts_an_hf_model_cannot_run_are_refused_before_any_process_starts() -> None:
    """The checks the strategies make before the process group starts (``parallelize.validate``)."""
    from lightning_par.hf import HFCausalLM
    from lightning_par.parallel_dims import ParallelDims
    from lightning_par.parallelize import ParallelOptions, validate

    gpt2 = HFCausalLM(model_type="gpt2", config=dict(n_embd=32, n_layer=2, n_head=2, vocab_size=256))
    with pytest.raises(ValueError, match="no base_model_pp_plan"):
        validate(gpt2, ParallelDims(pp_size=2, world_size=2), ParallelOptions.build())
    tied = HFCausalLM(model_type="llama", config={**TINY, "tie_word_embeddings": True})
    with pytest.raises(ValueError, match="tie_word_embeddings=True"):
        validate(tied, ParallelDims(pp_size=2, world_size=2), ParallelOptions.build())
    shared = HFCausalLM(model_type="qwen2_moe", config={**TINY, "num_experts": 4, "moe_intermediate_size": 32,
                                                        "shared_expert_intermediate_size": 32})
    with pytest.raises(ValueError, match="Qwen2MoeSparseMoeBlock.*is not supported"):
        validate(shared, ParallelDims(ep_size=2, world_size=2), ParallelOptions.build())
    moe = HFCausalLM(model_type="qwen3_moe", config={**TINY, **MOE, "num_experts": 6})
    with pytest.raises(ValueError, match=r"ep_size=4 is not valid for model.layers.0.mlp.experts with num_experts=6"):
        validate(moe, ParallelDims(ep_size=4, world_size=4), ParallelOptions.build())
    validate(HFCausalLM(model_type="qwen3", config=TINY), ParallelDims(pp_size=2, cp_size=2, world_size=4),
             ParallelOptions.build())  # a layout it can run passes
