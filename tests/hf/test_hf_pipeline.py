"""The HF adapter's pipeline stages, context-parallel attention and experts, in one process (no process group).

Stages chained give the plain model's logits and share its parameters under their names (a pipelined checkpoint
loads into the plain module), also where the model's own forward does arithmetic around its modules (cohere, granite),
has per-layer-type rotary embeddings and sliding windows (gemma3_text) or no pipeline plan (gpt2); a forward that
computes across its layers is refused by the probe; bad inputs are refused with a ValueError naming the model and what
would be valid; under cp positions, ``transformers`` builds a mask the cp attention refuses, and the adapter's context
removes it; the MoE families' experts switched to the contract's call give the same logits and gradients, and experts
the call cannot reproduce are refused."""

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


#: Config overrides per model type beyond TINY: the arithmetic each does around its modules made visible (Granite's
#: embedding and logit multipliers, Cohere's logit scale), sliding windows shorter than the 16-token sequences.
EXTRA: dict[str, dict[str, Any]] = {
    "qwen3_moe": MOE,
    "cohere": {"logit_scale": 0.5},
    "granite": {"embedding_multiplier": 3.0, "logits_scaling": 4.0, "residual_multiplier": 0.5},
    "gemma3_text": {"sliding_window": 8, "sliding_window_pattern": 2},
    "gpt2": {"n_embd": 32, "n_layer": 4, "n_head": 4},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": []},
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    "deepseek_v3": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 2,
                    "topk_group": 1, "first_k_dense_replace": 1, "n_shared_experts": 1, "q_lora_rank": None,
                    "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
                    "routed_scaling_factor": 2.5},
}


def _model(model_type: str, **overrides: Any) -> Any:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        model_type, **{**TINY, "pad_token_id": None, **EXTRA.get(model_type, {}), **overrides}
    )
    config._attn_implementation = "eager" if model_type == "gpt_oss" else "sdpa"  # attention sinks: no sdpa
    return transformers.AutoModelForCausalLM.from_config(config).eval()  # eval: GPT-2's dropout


IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "cohere", "granite",
                                        "gemma3_text", "gpt2"])
def test_stages_chained_give_the_model_logits_and_its_parameter_names(model_type: str) -> None:
    """Each stage runs the model's own forward: Cohere's logit scale, Granite's multipliers, Gemma-3's rotary
    embedding per layer type and its sliding-window mask (8 of 16 tokens), GPT-2's learned positions (no
    base_model_pp_plan: the plan is read from its module tree) come out as in one piece."""
    model = _model(model_type, **({"sliding_window": 8} if model_type == "mistral" else {}))
    ref = model(input_ids=IDS).logits
    layers = contract.pipeline_layers(model)
    prefix = "transformer.h" if model_type == "gpt2" else "model.layers"
    assert layers == [f"{prefix}.{i}" for i in range(4)]
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


def test_a_forward_that_computes_across_the_layers_is_refused() -> None:
    """A model whose forward mixes what a stage boundary cuts (here: the embeddings added to the last hidden states)
    is refused by the probe, whatever its name."""
    from transformers.modeling_outputs import BaseModelOutputWithPast
    from transformers.models.llama import modeling_llama

    class CrossModel(modeling_llama.LlamaModel):
        def forward(self, input_ids=None, inputs_embeds=None, position_ids=None, **kwargs):  # noqa: ANN001, ANN003
            embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            hidden = embeds
            if position_ids is None:
                position_ids = torch.arange(hidden.shape[1])[None]
            rotary = self.rotary_emb(hidden, position_ids=position_ids)
            for layer in self.layers:
                hidden = layer(hidden, attention_mask=None, position_ids=position_ids, position_embeddings=rotary)
            return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden + embeds))

    model = _model("llama")
    model.model.__class__ = CrossModel
    with pytest.raises(ValueError, match=r"LlamaForCausalLM \(model_type='llama'\): its forward run stage by stage "
                                         r"gives other logits than in one piece"):
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
    with pytest.raises(ValueError, match="expected contiguous layers"):
        contract.pipeline_stage(model, ["model.layers.0", "model.layers.2"], first=True, last=False)


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


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "deepseek_v3"])
def test_moe_experts_in_the_contract_call_match_transformers(model_type: str) -> None:
    """Only the experts call changes: the MoE layer's own forward (router, shared experts and their gate, DeepSeek's
    grouped top-k with its score correction bias and scaling factor) runs as in transformers."""
    extra = MIXTRAL if model_type == "mixtral" else {}
    plain, switched = _model(model_type, **extra), _model(model_type, **extra)
    paths = contract.expert_modules(switched)
    first = 1 if model_type == "deepseek_v3" else 0  # first_k_dense_replace=1: layer 0 is dense
    assert paths == [f"model.layers.{i}.mlp.experts" for i in range(first, 4)]
    assert contract.num_experts(switched, paths[0]) == 4
    assert contract.expert_modules(switched) == paths  # idempotent
    assert [n for n, _ in switched.named_parameters()] == [n for n, _ in plain.named_parameters()]
    for model in (plain, switched):
        model(input_ids=IDS).logits.square().mean().backward()
    torch.testing.assert_close(switched(input_ids=IDS).logits, plain(input_ids=IDS).logits, rtol=0, atol=1e-6)
    for (name, p), q in zip(plain.named_parameters(), switched.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)


def _double_experts(model: Any) -> None:
    """Layer 0's experts class becomes one whose own forward doubles its output."""
    experts = model.model.layers[0].mlp.experts

    class Doubled(type(experts)):
        def forward(self, hidden_states, top_k_index, top_k_weights):  # noqa: ANN001, ANN201
            return 2 * super().forward(hidden_states, top_k_index, top_k_weights)

    experts.__class__ = Doubled


def test_experts_the_contract_call_cannot_reproduce_are_refused_for_ep() -> None:
    """Read from the model: the experts call's arguments (gpt_oss), and a probe of the class's own forward against the
    sorted call (an experts class computing something else)."""
    oss = _model("gpt_oss", num_local_experts=4, num_experts_per_tok=2, head_dim=8)
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.experts' \(GptOssExperts\).*its forward takes "
                                         r"\['hidden_states', 'router_indices', 'routing_weights'\]"):
        contract.expert_modules(oss)
    model = _model("qwen3_moe")
    _double_experts(model)
    with pytest.raises(ValueError, match=r"its own forward and the sorted expert call differ by .* on a probe"):
        contract.expert_modules(model)


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
    with pytest.raises(ValueError, match="GPT2LMHeadModel with tie_word_embeddings=True"):
        validate(gpt2, ParallelDims(pp_size=2, world_size=2), ParallelOptions.build())
    tied = HFCausalLM(model_type="llama", config={**TINY, "tie_word_embeddings": True})
    with pytest.raises(ValueError, match="tie_word_embeddings=True"):
        validate(tied, ParallelDims(pp_size=2, world_size=2), ParallelOptions.build())
    doubled = HFCausalLM(model_type="qwen3_moe", config={**TINY, **MOE})
    _double_experts(doubled.model)
    with pytest.raises(ValueError, match=r"\(Doubled\).*cannot be split over ep ranks: its own forward"):
        validate(doubled, ParallelDims(ep_size=2, world_size=2), ParallelOptions.build())
    moe = HFCausalLM(model_type="qwen3_moe", config={**TINY, **MOE, "num_experts": 6})
    with pytest.raises(ValueError, match=r"ep_size=4 is not valid for model.layers.0.mlp.experts with num_experts=6"):
        validate(moe, ParallelDims(ep_size=4, world_size=4), ParallelOptions.build())
    validate(HFCausalLM(model_type="qwen3", config=TINY), ParallelDims(pp_size=2, cp_size=2, world_size=4),
             ParallelOptions.build())  # layouts it can run pass
    validate(HFCausalLM(model_type="olmoe", config={**TINY, **EXTRA["olmoe"], "pad_token_id": None}),
             ParallelDims(ep_size=2, world_size=2), ParallelOptions.build())
