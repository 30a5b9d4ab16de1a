"""What context parallelism refuses before start because the model itself, outside the attention it replaces, would
see a split sequence (issue 33): positions the model derives on its own (RoBERTa's start at ``padding_idx + 1``),
layers that mix the sequence outside attention (Mamba, short convolutions, linear attention, a token shift added to a
Llama), a mask the model builds for its attention (Doge). Read from the built model by a probe
(:func:`lightning_par.hf.context.check_sequence_mixing`), through the strategy's checks before the process group
starts; the probe leaves the model, its buffers and the random state as it found them. The matrix's cp2 cells of these
architectures: ``tests/hf/test_hf_matrix_distributed.py`` (slow)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from lightning.pytorch.strategies import StrategyRegistry  # noqa: E402

from lightning_par.hf.context import attention_windows, check_sequence_mixing  # noqa: E402
from lightning_par.parallel_dims import ParallelDims  # noqa: E402
from tests.support import hf_matrix as M  # noqa: E402


def _tiny(model_type: str, **overrides):
    with M.quiet():
        return M.make_model(model_type, "sgd", {**M.tiny_config(model_type), **overrides} if overrides else None)


def _validate(module, cp_size: int = 2) -> None:
    """The strategy's checks before the process group starts (``validate_model``), at cp 2 over world 2."""
    entry = StrategyRegistry["parallel_3d"]
    strategy = entry["strategy"](**{**entry["init_params"], "cp_size": cp_size})
    strategy.connect(module)
    strategy.validate_model(ParallelDims(world_size=cp_size, cp_size=cp_size))


@pytest.mark.parametrize("model_type, message", [
    ("roberta", "RobertaForCausalLM: the model derives its own position ids when given none, and they are not "
                "0..seq-1 (roberta.embeddings (RobertaEmbeddings) differs given position_ids=0..seq-1)"),
    ("granitemoehybrid", "model.layers.0.mamba (GraniteMoeHybridMambaLayer) mixes the tokens of a sequence outside "
                         "attention"),
    ("lfm3", "model.layers.0.conv (Lfm3ShortConv) mixes the tokens of a sequence outside attention"),
    ("minimax", "model.layers.1.self_attn (MiniMaxLightningAttention) mixes the tokens of a sequence outside "
                "attention"),
    ("doge", "DogeAttention: the model passes its own attention mask of shape (1, 4, 11, 11)"),
])
def test_what_a_split_sequence_would_change_is_refused_before_start_naming_the_module(model_type, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _validate(_tiny(model_type))


class TokenShift(nn.Module):
    """A user's layer around a Llama MLP mixing each token with the one before (RWKV's token shift)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x + 0.5 * torch.nn.functional.pad(x, (0, 0, 1, 0))[:, :-1])


def test_a_layer_the_model_did_not_have_is_found_by_what_it_does_not_by_its_name():
    module = _tiny("llama")
    _validate(module)  # plain causal attention: accepted
    module.model.model.layers[1].mlp = TokenShift(module.model.model.layers[1].mlp)
    with pytest.raises(ValueError, match=re.escape("model.layers.1.mlp (TokenShift) mixes the tokens of a sequence")):
        _validate(module)


def test_the_probe_leaves_the_model_and_the_random_state_as_it_found_them():
    module = _tiny("granitemoehybrid")
    network = module.model
    network.train()
    network.model.layers[0].eval()  # a mixed state, restored as it was
    modes = {name: m.training for name, m in network.named_modules()}
    state = {k: v.clone() for k, v in network.state_dict().items()}
    rng = torch.get_rng_state()
    with pytest.raises(ValueError):
        check_sequence_mixing(network, "cp")
    assert torch.equal(torch.get_rng_state(), rng)
    assert {name: m.training for name, m in network.named_modules()} == modes
    assert all(torch.equal(v, state[k]) for k, v in network.state_dict().items())
    assert all(p.grad is None for p in network.parameters())


def test_a_model_on_the_meta_device_is_checked_later_on_its_weights():
    with torch.device("meta"):
        module = _tiny("roberta")
    check_sequence_mixing(module.model, "cp")  # nothing to run: each rank checks the built model before its step


def test_a_window_the_config_turns_off_or_longer_than_the_text_models_positions_is_accepted():
    # Qwen2-MoE without use_sliding_window keeps config.sliding_window=0 and no window on its attention modules
    assert attention_windows(_tiny("qwen2_moe").model) == {}
    _validate(_tiny("qwen2_moe"))
    windowed = _tiny("qwen2_moe", use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention"] * 4)
    with pytest.raises(ValueError, match=re.escape("model.layers.0.self_attn attends within a sliding window of 8")):
        _validate(windowed)
    _validate(_tiny("gemma3"))  # windows of 4096 over text_config.max_position_embeddings=64: never bind


def test_the_same_architecture_is_accepted_or_refused_by_the_layers_it_has():
    attention_only = ["full_attention"] * 4  # the matrix's tiny LFM2 (its first layers): plain attention
    _validate(_tiny("lfm2", layer_types=attention_only))
    with pytest.raises(ValueError, match=re.escape("model.layers.0.conv (Lfm2ShortConv) mixes the tokens")):
        _validate(_tiny("lfm2", layer_types=["conv", "full_attention", "conv", "full_attention"]))
