"""The model contract for Hugging Face ``transformers`` models, without methods on their classes.

:mod:`lightning_par.contract` imports this module the first time it meets a network whose class comes from
``transformers``; it registers :class:`HFAdapter` for every ``PreTrainedModel``. Each method takes the network
(the ``PreTrainedModel``) first and answers what the contract asks, from the model's own plans
(``config.base_model_tp_plan``, ``config.base_model_pp_plan``) and structure.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_par.contract import register_adapter

__all__ = ["HFAdapter"]


class HFAdapter:
    """Contract methods for a ``transformers.PreTrainedModel`` (see :mod:`lightning_par.contract`)."""

    # -- tensor parallelism and activation checkpointing (lightning_par/hf/tensor_parallel.py) --

    def tp_plan(self, network: nn.Module) -> dict[str, Any]:
        """The model's own plan (``network.tp_plan`` / ``config.base_model_tp_plan``) in our style names
        (:func:`lightning_par.hf.tensor_parallel.hf_tp_plan`)."""
        from lightning_par.hf.tensor_parallel import hf_tp_plan

        return hf_tp_plan(network)

    def check_tensor_parallel(self, network: nn.Module, tp_size: int, sequence_parallel: bool,
                              plan: dict[str, Any] | None = None) -> None:
        """Heads and key/value heads divisible by ``tp_size``, embeddings untied, and the plan's split regions right
        on a part (:func:`lightning_par.hf.tensor_parallel.check_hf_tensor_parallel`)."""
        from lightning_par.hf.tensor_parallel import check_hf_tensor_parallel

        check_hf_tensor_parallel(network, tp_size, sequence_parallel, plan=plan)

    def checkpoint_modules(self, network: nn.Module, mode: str) -> list[str]:
        """Decoder layers (``"full"``) or their attention (``"selective"``)
        (:func:`lightning_par.hf.tensor_parallel.hf_checkpoint_modules`)."""
        from lightning_par.hf.tensor_parallel import hf_checkpoint_modules

        return hf_checkpoint_modules(network, mode)

    # -- pipeline, context and expert parallelism (lightning_par/hf/pipeline.py, lightning_par/hf/experts.py) --

    @staticmethod
    def pipeline_layers(network: nn.Module) -> list[str]:
        """The decoder layers from ``config.base_model_pp_plan`` or, without one, the module tree
        (``["model.layers.0", ...]``), once stages of the model have been checked to compose to its own forward.

        Raises:
            ValueError: no single list of decoder layers, a module holding parameters that no stage would hold, tied
                input/output embeddings (:func:`lightning_par.hf.pipeline.read_plan`), or stages that do not compose
                to the model's forward (:func:`lightning_par.hf.pipeline.check_stages`).
        """
        from lightning_par.hf.pipeline import pipeline_layers

        return pipeline_layers(network)

    @staticmethod
    def pipeline_stage(network: nn.Module, layers: list[str], *, first: bool, last: bool) -> nn.Module:
        """A stage running the model's own forward over ``layers`` (plus the embedding if ``first``, the norm and head
        if ``last``), parameter names unchanged (:class:`lightning_par.hf.pipeline.HFPipelineStage`)."""
        from lightning_par.hf.pipeline import pipeline_stage

        return pipeline_stage(network, layers, first=first, last=last)

    @staticmethod
    def pipeline_output(network: nn.Module, outputs: Any) -> Any:
        """The last stage's logits as the network's own call returns them (a ``CausalLMOutputWithPast`` with only
        ``logits``), for the LightningModule's evaluation steps under pipelining."""
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(logits=outputs)

    @staticmethod
    def context_parallel_attention(network: nn.Module) -> Any:
        """The context a context-parallel step runs in: attention without a mask built from ``position_ids``
        (:func:`lightning_par.hf.context.mask_free_attention`)."""
        from lightning_par.hf.context import mask_free_attention

        return mask_free_attention(network)

    @staticmethod
    def check_context_parallel(network: nn.Module, cp_size: int) -> None:
        """Refuse attention the context-parallel path cannot compute (soft-capping, sinks, a binding sliding window)
        (:func:`lightning_par.hf.context.check_hf_context_parallel`)."""
        from lightning_par.hf.context import check_hf_context_parallel

        check_hf_context_parallel(network, cp_size)

    @staticmethod
    def attention_heads(network: nn.Module) -> int:
        """Query heads per layer (``config.num_attention_heads``), for all-to-all context parallelism."""
        return int(network.config.num_attention_heads)

    @staticmethod
    def expert_modules(network: nn.Module) -> list[str]:
        """Paths of the experts modules of the model's MoE layers (qwen3_moe, qwen2_moe, olmoe, mixtral, deepseek_v3,
        ...), switched to take the contract's ``experts(x sorted by expert, counts)`` call under the layers' own
        forward (:mod:`lightning_par.hf.experts`).

        Raises:
            ValueError: a mixture-of-experts layer whose experts the contract's call cannot reproduce.
        """
        from lightning_par.hf.experts import expert_modules

        return expert_modules(network)


def _is_pretrained(network: nn.Module) -> bool:
    from transformers import PreTrainedModel

    return isinstance(network, PreTrainedModel)


register_adapter(_is_pretrained, HFAdapter())
