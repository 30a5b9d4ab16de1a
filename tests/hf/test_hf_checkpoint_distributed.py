"""Checkpoints in and out of the Hugging Face format, and ``load_from_checkpoint`` on every strategy's checkpoint.

One launch of 4 ranks runs every fit: a tiny tied-embedding Llama written by ``save_pretrained`` is loaded with
``HFCausalLM(pretrained=DIR)`` under ``zero3`` (each rank reading its own quarter of the safetensors), trained and
saved; the reference GPT is trained and saved under ``ddp_overlap`` and ``parallel_3d`` (tp2·pp2). The parent then
exports the zero3 checkpoint with ``python -m lightning_par.hf export``, loads it with
``AutoModelForCausalLM.from_pretrained`` and compares logits with the trained weights, and calls
``load_from_checkpoint`` on each checkpoint directory.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_par.launcher import run_distributed
from tests.support.helpers import TIMEOUT_S, LossRecorder, TokenDataset, quiet_trainer

pytestmark = pytest.mark.distributed

VOCAB, SEQ, MICRO, STEPS = 128, 16, 4, 3
LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=True)


def save_tiny_llama(directory: str, tied: bool = True) -> None:
    """A tiny Llama with random weights, written by ``save_pretrained`` (safetensors; a tied lm_head left out)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(LlamaConfig(**{**LLAMA, "tie_word_embeddings": tied})).save_pretrained(directory)


def make_module(step: dict[str, Any]) -> Any:
    torch.manual_seed(0)  # a different init from the pretrained weights: loading them must change the model
    if step["model"] == "hf":
        from lightning_par.hf import HFCausalLM

        return HFCausalLM(pretrained=step["pretrained"], optimizer="sgd", learning_rate=0.05)
    from tests.support.p3d import make_gpt

    return make_gpt()


def _strategy(step: dict[str, Any]) -> Any:
    from lightning.pytorch.strategies import StrategyRegistry

    entry = StrategyRegistry[step["strategy"]]
    return entry["strategy"](**{**entry["init_params"], "timeout_s": 90, **step.get("options", {})})


def plan_worker(plan: list[dict[str, Any]], train: Dataset) -> list[dict[str, Any]]:
    """Every fit of ``plan`` on this rank, in one process group; each saves its checkpoint."""
    env = dict(os.environ)
    torch.set_num_threads(1)
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    results = []
    for step in plan:
        os.environ.clear()
        os.environ.update(env)  # Lightning's teardown removes WORLD_SIZE and friends after each fit
        strategy = _strategy(step)
        dims = strategy.resolve_parallel_dims(world)
        dp_rank = dims.coordinates(rank)["dp"]
        sampler = DistributedSampler(train, num_replicas=dims.dp_size, rank=dp_rank, shuffle=False)
        loader = DataLoader(train, batch_size=MICRO, sampler=sampler, drop_last=True)
        recorder = LossRecorder()
        trainer = quiet_trainer(strategy, world, max_steps=STEPS, limit_val_batches=0, callbacks=[recorder])
        module = make_module(step)
        trainer.fit(module, loader)
        trainer.save_checkpoint(step["save"])
        results.append({"name": step["name"], "dp_rank": dp_rank, "losses": recorder.losses,
                        "state": strategy.full_state_dict(), "read": getattr(module, "pretrained_bytes_read", None)})
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_ckpt")
    pretrained = str(root / "pretrained")
    save_tiny_llama(pretrained)
    train = TokenDataset(n=MICRO * 4 * STEPS, seq=SEQ, vocab=VOCAB)
    plan = [
        {"name": "zero3", "strategy": "zero3", "model": "hf", "pretrained": pretrained, "save": str(root / "z3.ckpt")},
        {"name": "ddp_overlap", "strategy": "ddp_overlap", "model": "gpt", "save": str(root / "ddp.ckpt")},
        {"name": "parallel_3d", "strategy": "parallel_3d", "model": "gpt", "options": {"tp_size": 2, "pp_size": 2},
         "save": str(root / "p3d.ckpt")},
    ]
    per_rank = run_distributed(plan_worker, 4, (plan, train), timeout_s=TIMEOUT_S)
    results = {step["name"]: [per_rank[r][i] for r in range(4)] for i, step in enumerate(plan)}
    return {"root": root, "pretrained": pretrained, "train": train, "plan": {s["name"]: s for s in plan},
            "results": results}


def _first_global_loss(results: list[dict[str, Any]]) -> float:
    by_dp = {r["dp_rank"]: r["losses"][0] for r in results}
    return sum(by_dp.values()) / len(by_dp)


def test_pretrained_loads_under_zero3_reading_only_local_shards(runs):
    """First-step loss under zero3 (dp4) from the HF directory = one process's from ``from_pretrained``; each rank
    read about a quarter of the weight bytes."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from lightning_par.hf import HFCausalLM
    from lightning_par.hf.load import weight_files

    reference = AutoModelForCausalLM.from_pretrained(runs["pretrained"], local_files_only=True)
    x, y = next(iter(DataLoader(runs["train"], batch_size=MICRO * 4)))
    with torch.no_grad():
        expected = float(HFCausalLM.loss_fn(reference(input_ids=x).logits, y))
    results = runs["results"]["zero3"]
    got = _first_global_loss(results)
    assert abs(got - expected) <= 1e-5 * abs(expected), (got, expected)
    total = 0
    for name, file in weight_files(runs["pretrained"]).items():
        with safe_open(str(file), framework="pt") as f:
            total += f.get_tensor(name).numel() * 4  # fp32
    # zero3 over 4 ranks shards every tensor's rows evenly (all divisible by 4), the tied lm_head is not read again
    assert [r["read"] for r in results] == [total // 4] * 4, ([r["read"] for r in results], total)


def test_export_round_trip_gives_trained_logits(runs, tmp_path):
    """``python -m lightning_par.hf export`` of the zero3 checkpoint: ``from_pretrained`` gives the trained logits."""
    import json

    from transformers import AutoModelForCausalLM

    from lightning_par.hf.__main__ import main

    out = tmp_path / "exported"
    main(["export", runs["plan"]["zero3"]["save"], str(out), "--max-shard-bytes", "40000"])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert "lm_head.weight" not in index["weight_map"]  # tied: written once, as save_pretrained does
    exported = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    trained = AutoModelForCausalLM.from_pretrained(runs["pretrained"], local_files_only=True).eval()
    state = runs["results"]["zero3"][0]["state"]
    trained.load_state_dict({k.removeprefix("model."): v for k, v in state.items()}, strict=False)
    before = AutoModelForCausalLM.from_pretrained(runs["pretrained"], local_files_only=True).eval()
    x = runs["train"].data[:4, :-1]
    with torch.no_grad():
        want, got, old = trained(input_ids=x).logits, exported(input_ids=x).logits, before(input_ids=x).logits
    assert (want - old).abs().max() > 1e-3  # training moved the model: the comparison below can fail
    assert (got - want).abs().max() <= 1e-5


@pytest.mark.parametrize("name", ["zero3", "ddp_overlap", "parallel_3d"])
def test_load_from_checkpoint_returns_trained_weights(runs, name):
    """``Model.load_from_checkpoint(dir)`` on each strategy's checkpoint directory gives the trained parameters."""
    from lightning_par.hf import HFCausalLM
    from lightning_par.models import GPTLightningModule

    cls = HFCausalLM if name == "zero3" else GPTLightningModule
    module = cls.load_from_checkpoint(runs["plan"][name]["save"])
    trained = runs["results"][name][0]["state"]
    params = dict(module.named_parameters())
    assert set(trained) <= set(module.state_dict())
    for key, value in trained.items():
        if key in params:
            torch.testing.assert_close(params[key].detach(), value, rtol=0, atol=0, msg=key)


def test_pretrained_into_dp2_tp2_pp2_and_export(tmp_path):
    """The HF directory loaded into dp2·tp2·pp2 (world 8) gives one process's first-step loss, each rank reading less
    than the whole; the 3D checkpoint exports to the trained logits."""
    from transformers import AutoModelForCausalLM

    from lightning_par.hf import HFCausalLM
    from lightning_par.hf.export import export_hf

    pretrained = str(tmp_path / "pretrained")
    save_tiny_llama(pretrained, tied=False)  # pipelining refuses an embedding tied across the first and last stage
    train = TokenDataset(n=MICRO * 2 * STEPS, seq=SEQ, vocab=VOCAB)
    plan = [{"name": "3d", "strategy": "parallel_3d", "model": "hf", "pretrained": pretrained,
             "options": {"dp_size": 2, "tp_size": 2, "pp_size": 2}, "save": str(tmp_path / "p3d.ckpt")}]
    results = [r[0] for r in run_distributed(plan_worker, 8, (plan, train), timeout_s=TIMEOUT_S)]
    reference = AutoModelForCausalLM.from_pretrained(pretrained, local_files_only=True).eval()
    x, y = next(iter(DataLoader(train, batch_size=MICRO * 2)))
    with torch.no_grad():
        expected = float(HFCausalLM.loss_fn(reference(input_ids=x).logits, y))
    last = [r for r in results if r["losses"]]  # the last stage's ranks report the loss
    got = sum({r["dp_rank"]: r["losses"][0] for r in last}.values()) / 2
    assert abs(got - expected) <= 1e-5 * abs(expected), (got, expected)
    total = sum(p.numel() * 4 for p in reference.parameters())  # fp32
    assert all(0 < r["read"] < total / 2 for r in results), [r["read"] for r in results]
    exported = AutoModelForCausalLM.from_pretrained(export_hf(plan[0]["save"], tmp_path / "hf"), local_files_only=True)
    trained = AutoModelForCausalLM.from_pretrained(pretrained, local_files_only=True).eval()
    trained.load_state_dict({k.removeprefix("model."): v for k, v in results[0]["state"].items()}, strict=False)
    xs = train.data[:4, :-1]
    with torch.no_grad():
        assert (exported.eval()(input_ids=xs).logits - trained(input_ids=xs).logits).abs().max() <= 1e-5
