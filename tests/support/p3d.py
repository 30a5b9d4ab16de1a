"""Helpers of the 3D-parallel tests: every fit, save, resume and validation of the 8-process test in one launch.

A *step* of the worker's plan is a picklable dict with ``"kind"``:

* every step may name ``"strategy"`` (a registry name, default ``parallel_3d``; ``"options"`` are its keyword
  arguments), ``"bytes": True`` (the rank's model-state bytes, the maximum over its optimizer steps) and ``"model"`` (``"gpt"``, the default, ``"gpt8"`` with 8 blocks, or a user's MLP: see :func:`make_model`);
* ``"fit"``: ``{"kind": "fit", "name", "options" (the strategy's kwargs), "steps", "micro_batch", "clip",
  "accumulate": int (``accumulate_grad_batches``, default 1), "precision": Lightning's (default ``"32-true"``),
  "resume": path | None, "save": path | None, "val": bool,
  "crash_save": path | None}`` — fit ``steps`` optimizer steps from scratch (or resume from ``resume``); with ``val``
  a validation runs at the end (``val_loss``); ``save`` writes a checkpoint after the fit; ``crash_save`` then starts
  another save to that path that fails after the shards are written but before the commit (a simulated crash);
* ``"validate"``: ``{"kind": "validate", "name", "options", "micro_batch", "ckpt"}`` — load ``ckpt`` into a fresh
  model under ``options`` and validate (``val_loss``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_par.launcher import run_distributed
from lightning_par.models import GPTConfig, GPTLightningModule
from tests.support.helpers import TIMEOUT_S, LossRecorder, TokenDataset, quiet_trainer

#: Buffers holding a MoE router's selection bias: the GPT's ``expert_bias``, Hugging Face's ``e_score_correction_bias``.
BIAS_BUFFERS = ("expert_bias", "e_score_correction_bias")
CONFIG = GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=16, vocab_size=256, dropout=0.0)


def make_gpt(n_layer: int = CONFIG.n_layer) -> GPTLightningModule:
    """The tiny GPT, seeded: every rank and the reference build the same initial model."""
    torch.manual_seed(0)
    config = CONFIG if n_layer == CONFIG.n_layer else GPTConfig(**{**CONFIG.__dict__, "n_layer": n_layer})
    return GPTLightningModule(config, learning_rate=3e-3, adam_eps=1e-6)


def _loader(dataset: Dataset, micro_batch: int, dp_size: int, dp_rank: int) -> DataLoader:
    sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=False)
    return DataLoader(dataset, batch_size=micro_batch, sampler=sampler, drop_last=True)


class SimulatedCrash(RuntimeError):
    """Raised by the crashing save of the tests."""


def _crashing_write(path: Any, checkpoint: dict[str, Any], record: dict[str, Any], is_rank0: bool) -> None:
    _ORIGINAL_WRITE(path, checkpoint, record, is_rank0)  # the shards are on disk (in the staging directory) ...
    raise SimulatedCrash("simulated crash during a checkpoint save")  # ... but the save never commits


def _original_write() -> Any:
    from lightning_par.checkpoint import sharded

    return sharded._write


_ORIGINAL_WRITE = _original_write()


def _strategy(step: dict[str, Any]) -> Any:
    """The step's strategy: a Lightning registry name (``"strategy"``, default ``parallel_3d``) with its preset and
    the step's ``options``."""
    from lightning.pytorch.strategies import StrategyRegistry

    entry = StrategyRegistry[step.get("strategy", "parallel_3d")]
    return entry["strategy"](**{**entry["init_params"], "timeout_s": 90, **step["options"]})


def make_model(step: dict[str, Any]) -> Any:
    """The step's model: ``"gpt"`` (default, the tiny GPT), ``"mlp-sgd"`` or ``"mlp-adamw"`` (a user's
    ``nn.Sequential`` network with its own plan, :class:`tests.support.user_models.ResidualMLP`), ``"mlp-deep-..."`` (6 blocks,
    for 8 virtual stages)."""
    name = step.get("model", "gpt")
    if name.startswith("moegpt"):  # the MoE GPT: blocks 1 and 3 with 4 experts, top-2 ("-cap": capacity 1.0)
        torch.manual_seed(0)
        extra: dict[str, Any] = {"moe_capacity_factor": 1.0} if "-cap" in name else {}
        if "-bias" in name:  # DeepSeek-V3's auxiliary-loss-free bias, fast enough to change the routing in 3 steps
            extra |= {"moe_balance": "bias", "moe_bias_update_rate": 0.05}
        # the experts as the per-expert loop ("-loop": the reference of the grouped forms), the padded bmm ("-bmm":
        # what "auto" chooses on accelerators without grouped_mm), else torch._grouped_mm (what "auto" chooses on CPU,
        # with lightning_par's CPU backward), so that every ep cell compares a grouped form under ep with the loop in
        # one process
        form = "loop" if "-loop" in name else "bmm" if "-bmm" in name else "grouped_mm"
        extra |= {"moe_experts_form": form}
        config = GPTConfig(**{**CONFIG.__dict__, "num_experts": 4, "moe_every": 2, **extra})
        muon = {"optimizer": "muon", "muon_ns_precision": "fp32" if name.endswith("32") else "bf16"}
        return GPTLightningModule(config, learning_rate=3e-3, adam_eps=1e-6, **(muon if "-muon" in name else {}))
    if name in ("gpt-muon", "gpt-muon32"):  # the tiny GPT with Muon on its hidden matrices (bf16/fp32 iteration)
        torch.manual_seed(0)
        return GPTLightningModule(CONFIG, learning_rate=3e-3, adam_eps=1e-6, optimizer="muon",
                                  muon_ns_precision="fp32" if name.endswith("32") else "bf16")
    if name.startswith("moelm"):  # a user's MoE LM with its own router and experts (tests.support.user_models.MoELM)
        from tests.support.user_models import make_moe_lm

        return make_moe_lm(optimizer=name.split("-")[1])
    if name.startswith("hf-moe-"):  # a tiny Hugging Face MoE (qwen3_moe, deepseek_v3), 4 experts top-2, AdamW
        from lightning_par.hf import HFCausalLM

        torch.manual_seed(0)
        arch = name.removeprefix("hf-moe-").removesuffix("-bias")
        # "-bias": DeepSeek-V3's router bias balanced, fast enough to change the routing in 3 steps
        balance = {"moe_balance": "bias", "moe_bias_update_rate": 0.05} if name.endswith("-bias") else {}
        config = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, vocab_size=256, max_position_embeddings=64,
                      tie_word_embeddings=False, num_experts_per_tok=2, moe_intermediate_size=32)
        config |= {"qwen3_moe": {"num_experts": 4},
                   "deepseek_v3": {"n_routed_experts": 4, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                                   "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                                   "qk_nope_head_dim": 8, "v_head_dim": 16}}[arch]
        return HFCausalLM(model_type=arch, config=config, learning_rate=1e-3, adam_eps=1e-4, **balance)
    if name.startswith("hf-llama-muon"):  # a tiny Hugging Face Llama with Muon (``32``: the fp32 iteration)
        from lightning_par.hf import HFCausalLM

        torch.manual_seed(0)
        config = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False)
        return HFCausalLM(model_type="llama", config=config, optimizer="muon", learning_rate=1e-3, adam_eps=1e-5,
                          muon_ns_precision="fp32" if name.endswith("32") else "bf16")
    if name == "gpt-h4":  # 4 heads of width 8: all-to-all context parallelism splits them over cp x tp = 4
        torch.manual_seed(0)
        return GPTLightningModule(GPTConfig(**{**CONFIG.__dict__, "n_head": 4}), learning_rate=3e-3, adam_eps=1e-6)
    if name.startswith("gpt"):
        return make_gpt(int(name[3:] or CONFIG.n_layer))
    if name.startswith("attn"):  # a user's causal LM with its own plan and stages (tests.support.user_models.AttentionLM)
        from tests.support.user_models import make_attention_lm

        return make_attention_lm(optimizer=name.rsplit("-", 1)[1])
    from tests.support.user_models import make_mlp

    return make_mlp(optimizer=name.rsplit("-", 1)[1], depth=6 if "deep" in name else 3)


def _precision(precision: str) -> dict[str, Any]:
    """Trainer arguments for ``precision``. Lightning turns ``"16-mixed"`` on CPU into ``"bf16-mixed"``; tests of fp16
    loss scaling pass the plugin themselves (CPU autocast supports fp16, ``torch.amp.GradScaler("cpu")`` exists)."""
    if precision != "16-mixed":
        return {"precision": precision}
    from lightning.pytorch.plugins import MixedPrecision

    return {"plugins": [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))]}


def run_step(step: dict[str, Any], train: Dataset, val: Dataset) -> dict[str, Any]:
    """Run one step of the plan on this rank (see the module docstring)."""
    from lightning_par.checkpoint import sharded

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if step.get("model", "gpt").startswith("mlp"):  # the user MLP learns a regression
        from tests.support.pipeline import RegressionDataset

        train, val = RegressionDataset(n=len(train)), RegressionDataset(n=len(val), seed=1)
    strategy = _strategy(step)
    dims = strategy.resolve_parallel_dims(world)
    dp_rank = dims.coordinates(rank)["dp"]
    micro = step["micro_batch"]
    recorder = LossRecorder()
    callbacks: list[Any] = [recorder]
    if step.get("bytes"):  # model-state bytes of this rank at every optimizer step (the maximum)
        from tests.support.zero import StateBytesProbe

        callbacks.append(StateBytesProbe())
    validate_only = step["kind"] == "validate"
    trainer = quiet_trainer(
        strategy,
        world,
        max_steps=step.get("steps", 1),
        limit_val_batches=None if (validate_only or step.get("val")) else 0,
        check_val_every_n_epoch=None,
        val_check_interval=step.get("val_every", step.get("steps", 1)),
        gradient_clip_val=step.get("clip"),
        accumulate_grad_batches=step.get("accumulate", 1),
        callbacks=callbacks,
        **_precision(step.get("precision", "32-true")),
    )
    module = make_model(step)
    out: dict[str, Any] = {"name": step["name"], "rank": rank, "dp_rank": dp_rank}
    val_loader = _loader(val, micro, dims.dp_size, dp_rank)
    if validate_only:
        metrics = trainer.validate(module, val_loader, ckpt_path=step["ckpt"], verbose=False)
        out["val_loss"] = float(metrics[0]["val_loss"])
        out["expert_bias"] = {n: b.detach().clone() for n, b in module.named_buffers() if n.endswith(BIAS_BUFFERS)}
        return out
    loader = _loader(train, micro, dims.dp_size, dp_rank)
    trainer.fit(module, loader, val_loader if step.get("val") else None, ckpt_path=step.get("resume"))
    out["losses"] = recorder.losses
    out["state"] = strategy.full_state_dict()
    out["extras"] = strategy.summary_extras()
    out["expert_bias"] = {n: b.detach().clone() for n, b in module.named_buffers() if n.endswith(BIAS_BUFFERS)}
    if step.get("bytes"):
        out["bytes"] = callbacks[-1].bytes
        out["trainable_numel"] = sum(p.numel() for p in make_model(step).parameters() if p.requires_grad)
    out["optimizer_state_dtypes"] = sorted({
        str(v.dtype) for o in trainer.optimizers for s in o.state.values() for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    })
    if step.get("val"):
        out["val_loss"] = float(trainer.callback_metrics["val_loss"])
    if step.get("save"):
        trainer.save_checkpoint(step["save"])
    if step.get("crash_save"):
        sharded._write = _crashing_write
        try:
            trainer.save_checkpoint(step["crash_save"])
        except SimulatedCrash:
            out["crashed"] = True
        finally:
            sharded._write = _ORIGINAL_WRITE
    return out


def plan_worker(plan: list[dict[str, Any]], train: Dataset, val: Dataset,
                wrap: Callable[[dict[str, Any], dict[str, Any]], AbstractContextManager[Any]] | None = None,
                ) -> list[dict[str, Any]]:
    """Body of one rank: every step of ``plan`` in order, in one process group.

    ``wrap(step, report)``, when given (a module-level function: it travels to the ranks by pickling), is the context
    each step runs in; the step's result is merged into ``report`` (``{"name": ...}`` at first), which is the step's
    entry in the returned list. A ``wrap`` that suppresses the step's exception (and writes it into ``report``) lets
    the plan go on to its next step (:func:`tests.support.device_rule.rule_report`)."""
    env = dict(os.environ)
    torch.set_num_threads(1)
    results = []
    for step in plan:
        os.environ.clear()
        os.environ.update(env)  # Lightning's teardown removes WORLD_SIZE and friends after each fit
        if wrap is None:
            results.append(run_step(step, train, val))
            continue
        report: dict[str, Any] = {"name": step["name"]}
        with wrap(step, report):
            report.update(run_step(step, train, val))
        results.append(report)
    return results


def run_plan(world_size: int, plan: list[dict[str, Any]], train: Dataset, val: Dataset,
             timeout_s: float = TIMEOUT_S) -> dict[str, list[dict[str, Any]]]:
    """Run ``plan`` on ``world_size`` ranks; returns ``{step name: [result of rank 0, rank 1, ...]}``."""
    per_rank = run_distributed(plan_worker, world_size, (plan, train, val), timeout_s=timeout_s)
    return {step["name"]: [per_rank[r][i] for r in range(world_size)] for i, step in enumerate(plan)}


def reference_val_loss(params: dict[str, torch.Tensor] | None, val: Dataset, path: str | None = None) -> float:
    """One process: the mean loss over every sample of ``val`` (equal-size batches, so the mean Lightning logs),
    with ``params`` loaded, or the model part of the sharded checkpoint at ``path``."""
    from lightning_par.checkpoint import load_model_weights

    module = make_gpt()
    if path is not None:
        load_model_weights(path, module)
    else:
        module.load_state_dict(params, strict=False)
    x = torch.stack([val[i][0] for i in range(len(val))])
    y = torch.stack([val[i][1] for i in range(len(val))])
    with torch.no_grad():
        return float(module.loss_fn(module.model(x), y))


def token_data(n: int, seed: int = 0) -> TokenDataset:
    return TokenDataset(n=n, seq=CONFIG.block_size, seed=seed)
