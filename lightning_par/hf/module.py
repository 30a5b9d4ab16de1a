"""A LightningModule for any Hugging Face causal language model (``transformers``' ``AutoModelForCausalLM``).

The network is ``self.model`` (a ``PreTrainedModel``), so the strategies find it under the default
``module_attr="model"`` and checkpoints hold its parameters under ``model.<HF name>``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lightning_par.checkpoint.loading import ShardedCheckpointLoading
from lightning_par.hf.load import fill_from_safetensors, load_hf_weights, tied_aliases, trust_remote_code
from lightning_par.models.next_token import NextTokenSteps
from lightning_par.optim.registry import BaseHParams, optimizer_entry, optimizer_keywords
from lightning_par.tensor_parallel.styles import mask_padded_vocab
from lightning_par.tensor_parallel.vocab import VOCAB_SIZE_ATTR

__all__ = ["HFCausalLM", "recipe_model"]

#: The optimizers this module builds itself; the others come from :mod:`lightning_par.optim.registry`.
OPTIMIZERS = ("adamw", "sgd")


def _known_model_type(model_type: object) -> bool:
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:  # pragma: no cover - reported when the model is built
        return True
    return isinstance(model_type, str) and model_type in CONFIG_MAPPING


def recipe_model(
    model_type: str | None = None,
    pretrained: str | None = None,
    config: Mapping[str, Any] | None = None,
    base_config: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> "HFCausalLM":
    """The recipe's ``model=hf`` entry: :class:`HFCausalLM` with ``config`` over ``base_config`` for a ``model_type``
    build (the tiny default of conf/model/hf.yaml), or ``config`` alone over a ``pretrained`` directory's.

    Raises:
        ValueError: as :class:`HFCausalLM` (neither or both of ``model_type`` and ``pretrained``, an unknown
            ``model_type``...), naming the argument.
    """
    merged = dict(config or {}) if pretrained is not None else {**dict(base_config or {}), **dict(config or {})}
    return HFCausalLM(model_type=model_type, config=merged, pretrained=pretrained, **kwargs)


def _attention_backend(hf_config: Any) -> str:
    """The attention implementation to build with: the user's (``config.attn_implementation``, or the pretrained
    directory's) when set, else ``"sdpa"`` where the architecture supports it and ``"eager"`` where it does not
    (transformers refuses sdpa for attention it cannot express: Gemma2's logit soft-capping, gpt-oss's sinks).

    Under context parallelism every step runs attention through the context-parallel path whatever is chosen here
    (:mod:`lightning_par.hf.context`), which refuses before start attention it cannot compute.
    """
    from lightning_par.compat.transformers import chosen_attention_implementation, model_class_for_config, supports_sdpa

    chosen = chosen_attention_implementation(hf_config)
    if isinstance(chosen, str) and chosen:
        return chosen
    return "sdpa" if supports_sdpa(model_class_for_config(hf_config)) else "eager"


def _check(name: str, value: object, ok: bool, valid: str) -> None:
    if not ok:
        raise ValueError(f"HFCausalLM {name}={value!r} is not valid: expected {valid}.")


#: ``from_pretrained`` options refused in ``config``: they load code or files, they describe no model.
LOADER_OPTIONS = frozenset({"trust_remote_code", "code_revision", "revision", "cache_dir", "token", "proxies"})

#: Set while :meth:`HFCausalLM.load_from_checkpoint` builds a module.
_FROM_CHECKPOINT: ContextVar[bool] = ContextVar("hf_from_checkpoint", default=False)


class HFCausalLM(NextTokenSteps, ShardedCheckpointLoading, L.LightningModule):
    """Next-token language modelling with a Hugging Face causal LM.

    Exactly one of ``model_type`` and ``pretrained`` names the model:

    Args:
        model_type: a ``transformers`` model type (``"llama"``, ``"qwen2"``, ``"qwen3"``, ``"mistral"``,
            ``"qwen3_moe"``...): the model is built with random weights by ``AutoModelForCausalLM.from_config`` from
            ``AutoConfig.for_model(model_type, **config)``.
        config: config fields (``hidden_size``, ``num_hidden_layers``...) overriding the model type's defaults, or
            the pretrained directory's ``config.json``.
        pretrained: a local directory written by ``save_pretrained`` (``config.json`` and safetensors); never
            downloads. Its weights are loaded at once in a single process, and after the strategy has parallelized
            the model under a launcher (``WORLD_SIZE`` > 1), each rank reading only what it holds
            (:meth:`load_pretrained_weights`).
        optimizer: ``"adamw"`` (default), ``"sgd"`` (with ``momentum``), or an entry of
            :mod:`lightning_par.optim.registry` by name or import path: ``"muon"`` is
            :class:`~lightning_par.optim.MuonAdamW`, Muon at ``muon_lr`` on the hidden matrices, AdamW at
            ``learning_rate`` on the embeddings, head, norms, biases and routers (docs/muon.md).
        learning_rate: the optimizer's learning rate (AdamW's under ``"muon"``).
        **optimizer_options: the registered optimizers' own keywords, ``<name>_<field>`` (``muon_lr``,
            ``muon_ns_precision``, ...: :class:`~lightning_par.optim.muon.MuonOptions`).
        weight_decay: AdamW's decoupled weight decay (matrices and embeddings only); SGD's L2 term.
        momentum: SGD's momentum.
        adam_eps: AdamW's ``eps``.
        lora: LoRA fine-tuning (Hu et al. 2021): ``{"r": 16, "target_modules": ["q_proj", "v_proj"], "alpha": ...,
            "dropout": ..., "adapter_only_checkpoint": True}`` (:data:`lightning_par.hf.lora.LORA_DEFAULTS`; ``r=0`` or
            ``None``: off). The model becomes ``peft.get_peft_model(model, LoraConfig(...))``: the base frozen, only
            the adapters train and reach the optimizer; every layout reads the base model's plans through the wrapper
            (:mod:`lightning_par.hf.lora`). ``pretrained`` weights are read into the base before it is wrapped, by
            every process; checkpoints hold the adapters only unless ``adapter_only_checkpoint=False``
            (docs/lora.md). Needs ``pip install 'lightning-par[lora]'``.
        moe_balance: ``None`` (the routers as ``transformers`` trains them) or ``"bias"``: DeepSeek-V3's
            auxiliary-loss-free balancing of every router that keeps a per-expert ``e_score_correction_bias``
            (deepseek_v3 and models built like it; :func:`lightning_par.hf.experts.balance_by_bias`), moved after
            every optimizer step by ``moe_bias_update_rate * sign(mean load - load)``, the load summed over the dp x cp
            ranks; saved in checkpoints with the model.
        moe_bias_update_rate: that update's speed (> 0; DeepSeek-V3 used 0.001).

    Raises:
        ValueError: neither or both of ``model_type`` and ``pretrained``; an unknown ``model_type``; ``pretrained``
            not a directory with a ``config.json``, or (when the weights load) without safetensors weights or with
            weights that do not fit the config; an unknown optimizer; a non-positive learning rate; ``moe_balance``
            not ``None`` or ``"bias"``, or ``"bias"`` for a model without a router bias; a non-positive
            ``moe_bias_update_rate``. The message names the argument, the value and what is valid; invalid ``lora``
            fields (:func:`lightning_par.hf.lora.lora_options`), or a registered optimizer (``"muon"``: it orthogonalises
            whole matrices) with LoRA.
        ImportError: ``transformers`` is not installed (``pip install 'lightning-par[hf]'``), or ``peft`` with LoRA.
    """

    def __init__(
        self,
        model_type: str | None = None,
        config: Mapping[str, Any] | None = None,
        pretrained: str | None = None,
        optimizer: str = "adamw",
        learning_rate: float = 1e-3,
        weight_decay: float = 0.0,
        momentum: float = 0.9,
        adam_eps: float = 1e-8,
        lora: Mapping[str, Any] | None = None,
        moe_balance: str | None = None,
        moe_bias_update_rate: float = 1e-3,
        **optimizer_options: Any,
    ) -> None:
        super().__init__()
        from lightning_par.hf.lora import lora_options

        lora = lora_options(lora)
        _check("optimizer", optimizer, lora is None or optimizer in OPTIMIZERS,
               "'adamw' or 'sgd' with LoRA (a registered optimizer may work on whole hidden matrices, not on "
               "rank-r adapters)")
        _check("model_type", model_type, (model_type is None) != (pretrained is None),
               "exactly one of model_type and pretrained (a local save_pretrained directory)")
        optimizer_options = optimizer_keywords("HFCausalLM", optimizer, optimizer_options, OPTIMIZERS)
        _check("learning_rate", learning_rate, learning_rate > 0, "a positive float")
        _check("moe_balance", moe_balance, moe_balance in (None, "bias"), "None or 'bias'")
        _check("moe_bias_update_rate", moe_bias_update_rate,
               isinstance(moe_bias_update_rate, (int, float)) and 0 < moe_bias_update_rate < float("inf"),
               "a finite number > 0")
        if model_type is not None:
            _check("model_type", model_type, _known_model_type(model_type),
                   "a transformers model type such as 'llama', 'qwen2', 'qwen3', 'mistral', 'qwen3_moe', 'mixtral'")
        config = dict(config or {})
        # Loader options, not config fields: trust_remote_code would import Python files named by a config.json (a
        # checkpoint's hyper-parameters reach here through load_from_checkpoint: a checkpoint never runs code).
        _check("config", config, not set(config) & LOADER_OPTIONS,
               f"config fields only, without the loader options {sorted(LOADER_OPTIONS)}")
        self.save_hyperparameters(
            {"model_type": model_type, "config": config, "pretrained": pretrained, "optimizer": optimizer,
             "learning_rate": learning_rate, "weight_decay": weight_decay, "momentum": momentum, "adam_eps": adam_eps,
             "lora": lora, "moe_balance": moe_balance, "moe_bias_update_rate": moe_bias_update_rate,
             **optimizer_options}
        )
        try:
            from transformers import AutoConfig, AutoModelForCausalLM
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise ImportError("lightning_par.hf needs transformers: pip install 'lightning-par[hf]'") from err
        if pretrained is not None:
            _check("pretrained", pretrained, (Path(pretrained).expanduser() / "config.json").is_file(),
                   "a local directory written by save_pretrained (config.json and model.safetensors or its index); "
                   "nothing is downloaded")
            hf_config = AutoConfig.from_pretrained(pretrained, local_files_only=True,
                                                   trust_remote_code=trust_remote_code(), **config)
        else:
            hf_config = AutoConfig.for_model(model_type, **config)
        self.model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=_attention_backend(hf_config),
                                                      trust_remote_code=trust_remote_code())
        # Built by load_from_checkpoint: the checkpoint's weights replace the pretrained ones, which are not read.
        self._pretrained_pending = pretrained is not None and not _FROM_CHECKPOINT.get()
        self._tied = tied_aliases(self.model)
        if moe_balance == "bias":
            from lightning_par.hf.experts import balance_by_bias

            balance_by_bias(self.model, moe_bias_update_rate)
        if lora is not None:
            # The base's weights before the wrapper renames its layers (q_proj -> q_proj.base_layer), in every process
            # (also when built from a checkpoint: an adapter-only checkpoint holds no base).
            self._pretrained_pending = pretrained is not None
            if pretrained is not None:
                self.load_pretrained_weights()
            from lightning_par.hf.lora import apply_lora, quantize_base_nf4

            if lora["quantize_base"] == "nf4":
                quantize_base_nf4(self.model)
            self.model = apply_lora(self.model, lora)
            self.adapter_only_checkpoint = bool(lora["adapter_only_checkpoint"])
        elif pretrained is not None and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            self.load_pretrained_weights()  # one process: it holds every weight

    def setup(self, stage: str) -> None:
        """Under LoRA and Lightning's ``"bf16-mixed"``, the frozen base's linear weights stored in bf16 (the adapters
        stay fp32 masters; :func:`lightning_par.hf.lora.cast_frozen_base`): run before the strategy parallelizes the
        model, so every layout holds, shards and gathers them in bf16."""
        trainer = self._trainer
        lora = self.hparams.get("lora")
        if lora and trainer is not None and str(getattr(trainer, "precision", "")) == "bf16-mixed":
            from lightning_par.hf.lora import cast_frozen_base

            cast_frozen_base(self.model, torch.bfloat16)

    def load_pretrained_weights(self, parallel: Any = None) -> int:
        """Read ``pretrained``'s safetensors weights into the model (done once; a no-op without ``pretrained``; on the
        ``meta`` device only a check of the files' names and shapes). Under a lightning_par strategy, each rank reads only the blocks it holds
        (:func:`lightning_par.hf.load.load_hf_weights`). Called by ``__init__`` in a single process, else at the start of
        ``fit``/``validate``/``test``/``predict``, after the strategy has parallelized the model (skipped when the run
        restores a ``ckpt_path``).

        Args:
            parallel: the strategy's parallel model (``trainer.strategy.parallel``), or ``None`` for this module.

        Returns:
            The bytes read by this process.

        Raises:
            ValueError: the directory has no safetensors weights, or they do not fit the model (names, shapes).
        """
        pretrained = self.hparams.pretrained
        if not self._pretrained_pending or pretrained is None:
            return 0
        if any(p.is_meta for p in self.model.parameters()):  # built to be checked before start: names and shapes
            fill_from_safetensors(self.state_dict(), pretrained, "model.", self._tied, check_only=True)
            return 0
        read = load_hf_weights(pretrained, self, parallel=parallel, aliases=self._tied)
        self._pretrained_pending = False
        self.pretrained_bytes_read = read
        return read

    def _load_pending(self) -> None:
        """Load ``pretrained``'s weights into this rank's part of the parallelized model if ``__init__`` has not,
        unless the run restores a checkpoint (``ckpt_path``), whose weights win."""
        if not self._pretrained_pending:
            return
        if self.trainer.ckpt_path is not None:
            self._pretrained_pending = False
            return
        self.load_pretrained_weights(getattr(self.trainer.strategy, "parallel", None))

    def on_fit_start(self) -> None:
        """See :meth:`load_pretrained_weights` (runs after the strategy's setup, before a checkpoint is restored)."""
        self._load_pending()

    def on_validation_start(self) -> None:
        """See :meth:`load_pretrained_weights` (for ``Trainer.validate``; a no-op once loaded)."""
        self._load_pending()

    def on_test_start(self) -> None:
        """See :meth:`load_pretrained_weights` (for ``Trainer.test``)."""
        self._load_pending()

    def on_predict_start(self) -> None:
        """See :meth:`load_pretrained_weights` (for ``Trainer.predict``)."""
        self._load_pending()

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning's ``load_from_checkpoint``, also for lightning_par checkpoint directories
        (:class:`~lightning_par.checkpoint.ShardedCheckpointLoading`); the ``pretrained`` directory's ``config.json``
        is read, its weights are not (the checkpoint's replace them).

        Raises:
            FileNotFoundError, ValueError: a missing, torn or damaged checkpoint directory; what Lightning raises.
        """
        token = _FROM_CHECKPOINT.set(True)
        try:
            return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)
        finally:
            _FROM_CHECKPOINT.reset(token)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep the model's whole config (and generation config) in the checkpoint, for
        ``python -m lightning_par.hf export`` without the pretrained directory."""
        checkpoint["hf_config"] = self.model.config.to_dict()
        generation = getattr(self.model, "generation_config", None)
        if generation is not None:
            checkpoint["hf_generation_config"] = generation.to_dict()

    @property
    def block_size(self) -> int:
        """The longest sequence the model takes (``config.max_position_embeddings``), in tokens: what the recipe's data
        uses when ``data.block_size`` is null."""
        return int(self.model.config.max_position_embeddings)

    @property
    def hf_config(self) -> Any:
        """The model's ``transformers.PretrainedConfig``."""
        return self.model.config

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``(batch, seq, vocab_size)`` of token ids ``idx`` ``(batch, seq)``."""
        if position_ids is not None and position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0).expand(idx.shape[0], -1)
        logits = self.model(input_ids=idx, position_ids=position_ids, use_cache=False).logits
        try:
            head = self.model.get_output_embeddings()
        except AttributeError:  # a last pipeline stage's skeleton: no input embedding for transformers' check
            head = getattr(self.model, "lm_head", None)
        vocab = getattr(head, VOCAB_SIZE_ATTR, None) if head is not None else None
        if vocab is not None:  # a padded vocab-parallel head: the model's own arithmetic after it (final soft-capping)
            logits = mask_padded_vocab(logits, vocab)  # may have moved the masked logits back into reach
        return logits

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW (weight decay on tensors of 2 or more dims), SGD with momentum, or Muon + AdamW."""
        hp = self.hparams
        params = [p for p in self.parameters() if p.requires_grad]
        if hp.optimizer == "sgd":
            return torch.optim.SGD(params, lr=hp.learning_rate, momentum=hp.momentum, weight_decay=hp.weight_decay)
        if hp.optimizer not in OPTIMIZERS:  # a registered optimizer (lightning_par.optim.registry), e.g. Muon
            base = BaseHParams(hp.learning_rate, hp.weight_decay, eps=hp.adam_eps)
            return optimizer_entry(hp.optimizer).create(self, hp, base)
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": hp.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=hp.learning_rate, eps=hp.adam_eps)
