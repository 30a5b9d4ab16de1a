"""Helpers of the LoRA tests: a user's LightningModule around ``peft.get_peft_model`` (a tiny Llama, random weights)
and a worker that fits several layouts in one launch, against the same module in one process.

The module is written as a user would: ``self.model = get_peft_model(LlamaForCausalLM(config), LoraConfig(...))``,
its own cross-entropy loss (also as ``loss_fn`` for pipelining), an optimizer over the trainable parameters only.
"""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, Subset

from tests.support.device_rule import rule_report
from tests.support.helpers import LossRecorder, TokenDataset, quiet_trainer

STEPS, GLOBAL_BATCH, SEQ = 3, 8, 16
#: The tiny Llama of tests/hf/test_hf_models.py.
BASE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64, "tie_word_embeddings": False}
TARGETS = ("q_proj", "v_proj", "down_proj")
#: QLoRA's tiny Llama: width 64, so that every linear weight splits into NF4 blocks of 64 on each of 2 ranks.
QLORA_BASE = {**BASE, "hidden_size": 64, "intermediate_size": 128}
#: The tiny qwen3_moe of tests/support/p3d.py (4 experts, top 2) over BASE.
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 8}


class PeftLlama(L.LightningModule):
    """A user's LoRA fine-tuning module: a PEFT-wrapped tiny Llama at ``.model``.

    Args:
        optimizer: ``"sgd"`` (momentum 0.9, lr 0.1) or ``"adamw"`` (lr 3e-3, eps 1e-6: see
            :func:`tests.support.helpers.assert_params_close`).
        lora: extra ``LoraConfig`` fields (``use_dora=True``...).
    """

    def __init__(self, optimizer: str = "adamw", lora: dict[str, Any] | None = None, arch: str = "llama",
                 config: dict[str, Any] | None = None) -> None:
        super().__init__()
        from peft import LoraConfig, get_peft_model
        from transformers import AutoConfig, AutoModelForCausalLM

        self.optimizer_name = optimizer
        torch.manual_seed(0)
        hf_config = AutoConfig.for_model(arch, **{**BASE, **(config or {})})
        base = AutoModelForCausalLM.from_config(hf_config, attn_implementation="sdpa")
        # lora_B starts at zero (PEFT's default): the first step's loss is the base model's; "gaussian" keeps that.
        options = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": list(TARGETS), **(lora or {})}
        self.model = get_peft_model(base, LoraConfig(**options))
        # lora_B as a resumed adapter's (PEFT starts it at zero, which gives lora_A no gradient in the first step and
        # hides an error in it behind a tiny update): small seeded values, the same on every rank
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.05 * torch.randn(p.shape, generator=generator))

    @staticmethod
    def loss_fn(logits: Any, targets: torch.Tensor) -> torch.Tensor:
        logits = getattr(logits, "logits", logits)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is not None and position_ids.dim() == 1:  # context parallelism: this rank's global positions
            position_ids = position_ids.unsqueeze(0).expand(x.shape[0], -1)
        return self.model(input_ids=x, position_ids=position_ids, use_cache=False).logits

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, *positions = batch
        loss = self.loss_fn(self(x, *positions), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)
        return torch.optim.AdamW(params, lr=3e-3, eps=1e-6)


def _float64_causal_lm() -> type:
    from lightning_par.hf import HFCausalLM

    class Float64CausalLM(HFCausalLM):
        """``HFCausalLM`` whose loss keeps float64 logits in float64 (the package's loss computes in float32)."""

        @staticmethod
        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return Float64CausalLM


def make_module(model: str, pretrained: str | None = None) -> L.LightningModule:
    """``"peft-<optimizer>"``: :class:`PeftLlama`; ``"dora-<optimizer>"``: with ``use_dora=True``; ``"hflora-..."``:
    ``HFCausalLM(lora=...)`` (``"hflora64"``: in float64; ``"hflora-moe"``: a qwen3_moe); ``"hfqlora"``: QLoRA."""
    kind, optimizer = model.rsplit("-", 1)
    if kind == "hfqlora":  # QLoRA: the base's linear weights NF4 (bf16 compute), on a Llama of width 64
        from lightning_par.hf import HFCausalLM

        torch.manual_seed(0)
        lr = {"sgd": 0.1, "adamw": 3e-3}[optimizer]
        return HFCausalLM(model_type="llama", config=QLORA_BASE, optimizer=optimizer, learning_rate=lr, adam_eps=1e-6,
                          lora={"r": 8, "target_modules": list(TARGETS), "quantize_base": "nf4"})
    if kind == "hflora-moe":  # HFCausalLM(lora=...) on the tiny qwen3_moe, adapters on the attention
        from lightning_par.hf import HFCausalLM

        torch.manual_seed(0)
        lr = {"sgd": 0.1, "adamw": 3e-3}[optimizer]
        return HFCausalLM(model_type="qwen3_moe", config={**BASE, **MOE}, optimizer=optimizer, learning_rate=lr,
                          adam_eps=1e-6, lora={"r": 8, "target_modules": ["q_proj", "v_proj"]})
    if kind == "hflora64":  # HFCausalLM(lora=...) in float64, loss too: what fp32 rounding hides, to ~1e-15
        torch.manual_seed(0)
        lr = {"sgd": 0.1, "adamw": 3e-3}[optimizer]
        return _float64_causal_lm()(model_type="llama", config=BASE, optimizer=optimizer, learning_rate=lr,
                                    adam_eps=1e-6, lora={"r": 8, "target_modules": list(TARGETS)}).double()
    if kind.startswith("hflora"):  # HFCausalLM(lora=...) on the same tiny Llama ("hflora-full": whole checkpoints)
        from lightning_par.hf import HFCausalLM

        torch.manual_seed(0)
        lora = {"r": 8, "target_modules": list(TARGETS), "adapter_only_checkpoint": kind != "hflora-full"}
        lr = {"sgd": 0.1, "adamw": 3e-3}[optimizer]
        if pretrained is not None:  # the base from a save_pretrained directory (the export's test)
            return HFCausalLM(pretrained=pretrained, optimizer=optimizer, learning_rate=lr, adam_eps=1e-6, lora=lora)
        return HFCausalLM(model_type="llama", config=BASE, optimizer=optimizer, learning_rate=lr, adam_eps=1e-6,
                          lora=lora)
    if kind.startswith("moe"):  # a tiny qwen3_moe (4 experts, top 2): LoRA on attention, or ("moe-experts") experts too
        lora: dict[str, Any] = {"target_modules": ["q_proj", "v_proj"]}
        if kind == "moe-experts":
            lora["target_parameters"] = ["mlp.experts.gate_up_proj"]
        return PeftLlama(optimizer, lora=lora, arch="qwen3_moe", config=MOE)
    if kind == "peft":
        return PeftLlama(optimizer)
    if kind == "dora":
        return PeftLlama(optimizer, lora={"use_dora": True})
    raise ValueError(f"unknown model {model!r}")


def optimizer_numels(trainer: L.Trainer) -> dict[str, int]:
    """Elements of the parameters the optimizer holds and of its state tensors (this rank's: local shards)."""
    params = state = 0
    for opt in trainer.optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                local = p.to_local() if hasattr(p, "to_local") else p
                params += local.numel()
        for s in opt.state.values():
            for v in s.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    state += (v.to_local() if hasattr(v, "to_local") else v).numel()
    return {"param_numel": params, "state_numel": state}


def lora_worker(cases: list[dict[str, Any]], data: TokenDataset) -> list[dict[str, Any]]:
    """Body of one rank: fit every case (``{"name", "strategy", "options", "model"}``) in one process group."""
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_par.memory import param_split_bytes

    env = dict(os.environ)
    torch.set_num_threads(1)
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    out = []
    for case in cases:
        os.environ.clear()
        os.environ.update(env)  # Lightning's teardown removes WORLD_SIZE and friends after each fit
        entry = StrategyRegistry[case["strategy"]]
        strategy = entry["strategy"](**{**entry["init_params"], "timeout_s": 90, **case["options"]})
        dims = strategy.resolve_parallel_dims(world)
        dp_rank = dims.coordinates(rank)["dp"]
        # "samples": the first n samples only (an epoch of n / GLOBAL_BATCH steps: a checkpoint at its end resumes on
        # the batch a continuous run takes next)
        dataset = Subset(data, range(case["samples"])) if case.get("samples") else data
        sampler = DistributedSampler(dataset, num_replicas=dims.dp_size, rank=dp_rank, shuffle=False)
        loader = DataLoader(dataset, batch_size=GLOBAL_BATCH // dims.dp_size, sampler=sampler, drop_last=True)
        recorder = LossRecorder()

        def fit() -> L.Trainer:
            precision = {"precision": case["precision"]} if case.get("precision") else {}
            trainer = quiet_trainer(strategy, world, max_steps=case.get("steps", STEPS), limit_val_batches=0,
                                    callbacks=[recorder], **precision)
            module = make_module(case["model"], case.get("pretrained"))
            trainer.fit(module, loader, ckpt_path=case.get("resume"))
            if case.get("save"):
                trainer.save_checkpoint(case["save"])
            return trainer

        if case.get("device_rule"):  # NCCL's rule on the CPU: no collective of the fit may get a host-built tensor
            report: dict[str, Any] = {"name": case["name"]}
            with rule_report(case, report):
                fit()
            out.append(report)
            continue
        try:
            trainer = fit()
        except Exception as err:  # noqa: BLE001 - returned by name: a refusal test reads it
            out.append({"name": case["name"], "error": f"{type(err).__name__}: {err}"})
            continue
        out.append({"name": case["name"], "rank": rank, "dp_rank": dp_rank, "losses": recorder.losses,
                    "state": strategy.full_state_dict(), "extras": strategy.summary_extras(),
                    **({"param_split": param_split_bytes(trainer.lightning_module)} if case.get("precision") else {}),
                    **optimizer_numels(trainer)})
    return out


_REFERENCES: dict[tuple[str, str | None], tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}


def _bf16_mixed_module(model: str) -> L.LightningModule:
    """``make_module(model)`` as ``HFCausalLM.setup`` leaves it under ``"bf16-mixed"``: the frozen linear weights
    bf16."""
    from lightning_par.hf.lora import cast_frozen_base

    module = make_module(model)
    assert cast_frozen_base(module.model, torch.bfloat16)
    return module


def reference(model: str, data: TokenDataset, precision: str | None = None
              ) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process on the global batch: losses, final parameters, and the initial parameters. ``precision``
    ``"bf16-mixed"``: the frozen linear weights bf16 and the steps under CPU autocast to bf16, as Lightning runs
    them."""
    from tests.support.helpers import reference_fit
    from tests.support.pipeline import one_thread

    if (model, precision) not in _REFERENCES:
        with one_thread():
            if precision == "bf16-mixed":
                initial = values(_bf16_mixed_module(model))
                losses, params = _plain_fit(_bf16_mixed_module(model), data, autocast=True)
            elif model.startswith("hfqlora"):  # NF4 weights: read as their bf16 values (NF4's clone re-quantizes)
                initial = values(make_module(model))
                losses, params = _plain_fit(make_module(model), data)
            else:
                initial = values(make_module(model))
                losses, params = reference_fit(lambda: make_module(model), data, GLOBAL_BATCH, STEPS)
        _REFERENCES[(model, precision)] = (losses, params, initial)
    return _REFERENCES[(model, precision)]


def values(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's values, an NF4 weight's as its bf16 values."""
    out = {}
    for name, p in module.named_parameters():
        dequantize = getattr(p, "get_original_weight", None)
        out[name] = dequantize().detach() if callable(dequantize) else p.detach().clone()
    return out


def _plain_fit(module: L.LightningModule, data: TokenDataset, autocast: bool = False
               ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """:func:`tests.support.helpers.reference_fit`'s loop (one process, global batches) with :func:`values`; ``autocast``:
    each training step under CPU autocast to bf16 (Lightning's ``"bf16-mixed"``), the backward outside it."""
    import contextlib

    torch.manual_seed(0)
    optimizer = module.configure_optimizers()
    losses = []
    for x, y in list(DataLoader(data, batch_size=GLOBAL_BATCH, shuffle=False, drop_last=True))[:STEPS]:
        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            loss = module.training_step((x, y), 0)
        losses.append(float(loss.detach()))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, values(module)


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max|a - e| / max|e|``: the relative error the issue's figures quote."""
    return float((actual.double() - expected.double()).abs().max() / expected.double().abs().max().clamp_min(1e-30))
