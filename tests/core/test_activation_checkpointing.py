"""Activation checkpointing without processes: what the contract names, that the modules really recompute, that
names and values do not change, and that the bytes kept for backward fall."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from lightning_par import contract
from lightning_par.activation_checkpointing import apply_activation_checkpointing, checkpoint_module, is_checkpointed
from lightning_par.memory import StepMemoryTracker
from lightning_par.models import GPT, GPTConfig
from lightning_par.parallel_dims import ParallelDims
from lightning_par.parallelize import ParallelOptions, validate
from lightning_par.strategies import DDPOverlapStrategy
from tests.support.user_models import make_mlp

CONFIG = GPTConfig(n_layer=3, n_head=2, n_embd=32, block_size=16)


def _kept_bytes(fn) -> tuple[int, torch.Tensor]:
    """Bytes of the storages ``fn`` creates that are still alive when it returns (what the graph keeps for backward,
    checkpoint inputs included), and its result."""
    with StepMemoryTracker() as counter:
        out = fn()
    return counter.live.live, out


def test_the_gpt_names_its_blocks_and_their_attention():
    gpt = GPT(CONFIG)
    assert contract.checkpoint_modules(gpt, "full") == ["blocks.0", "blocks.1", "blocks.2"]
    assert contract.checkpoint_modules(gpt, "selective") == ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"]
    with pytest.raises(ValueError, match="mode='partial' is not valid"):
        gpt.checkpoint_modules("partial")


def test_a_users_sequential_checkpoints_its_children_and_cannot_guess_attention():
    mlp = make_mlp()
    assert contract.checkpoint_modules(mlp.model, "full") == ["0", "1", "2", "3", "4"]
    with pytest.raises(ValueError, match=re.escape("activation_checkpointing='selective' is not valid for a network "
                                                   "of type Sequential: it checkpoints the attention")):
        contract.checkpoint_modules(mlp.model, "selective")
    with pytest.raises(ValueError, match="checkpoints every block, and the network names none"):
        contract.checkpoint_modules(nn.Linear(2, 2), "full")


def test_options_and_paths_are_checked_before_any_process():
    with pytest.raises(ValueError, match=r"activation_checkpointing='some' is not valid: expected one of"):
        DDPOverlapStrategy(activation_checkpointing="some")

    class Named(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(2, 2)

        def checkpoint_modules(self, mode: str) -> list[str]:
            return ["body", "head"]

    holder = nn.Module()
    holder.model = Named()
    options = ParallelOptions.build("ddp", activation_checkpointing="full")
    with pytest.raises(ValueError, match="path 'head' names no module of Named"):
        validate(holder, ParallelDims(world_size=1), options)
    with pytest.raises(ValueError, match="selective"):
        validate(make_mlp(), ParallelDims(world_size=1), ParallelOptions.build("ddp", activation_checkpointing="selective"))


def test_checkpointed_modules_recompute_keep_names_and_match_exactly():
    torch.manual_seed(0)
    plain = GPT(CONFIG)
    torch.manual_seed(0)
    ckpt = GPT(CONFIG)
    assert apply_activation_checkpointing(ckpt, contract.checkpoint_modules(ckpt, "full")) == [
        "blocks.0", "blocks.1", "blocks.2"]
    assert apply_activation_checkpointing(ckpt, ["blocks.9"], skip_absent=True) == []
    calls = []
    ckpt.blocks["1"].register_forward_pre_hook(lambda *a: calls.append(1))  # module hooks run once (outside)
    inner = ckpt.blocks["1"].mlp.register_forward_pre_hook(lambda *a: calls.append(2))  # inside: recomputed
    assert [n for n, _ in ckpt.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert is_checkpointed(ckpt.blocks["0"]) and type(ckpt.blocks["0"]).__name__ == "CheckpointedBlock"
    assert checkpoint_module(ckpt.blocks["0"]) is ckpt.blocks["0"]  # idempotent
    x = torch.randint(0, 256, (4, 16))
    plain_bytes, out_plain = _kept_bytes(lambda: plain(x))
    ckpt_bytes, out_ckpt = _kept_bytes(lambda: ckpt(x))
    out_plain.square().mean().backward()
    out_ckpt.square().mean().backward()
    assert calls == [1, 2, 2]  # the block's inner forward ran twice (once more in backward), its own hook once
    inner.remove()
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=name)
    # kept: 3 block inputs (4 x 16 x 32 fp32 each) + the embeddings' and head's own activations and the logits, instead
    # of every block's activations
    assert ckpt_bytes < 0.5 * plain_bytes, (ckpt_bytes, plain_bytes)
    with torch.no_grad():  # evaluation: no checkpoint at all
        torch.testing.assert_close(ckpt(x), plain(x), rtol=0, atol=0)


def test_the_recipe_schema_takes_the_option():
    from hydra import compose, initialize_config_dir

    from lightning_par.config.build import build_strategy
    from lightning_par.config.schema import register_configs
    from tests.config.test_compose import CONF

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="config", overrides=["strategy=zero3", "strategy.activation_checkpointing=selective"])
    assert build_strategy(cfg).options.activation_checkpointing == "selective"
