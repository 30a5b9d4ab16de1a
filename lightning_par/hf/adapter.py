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

    # -- pipeline, context and expert parallelism (lightning_par/hf/pipeline.py, lightning_par/hf/experts.py) --


def _is_pretrained(network: nn.Module) -> bool:
    from transformers import PreTrainedModel

    return isinstance(network, PreTrainedModel)


register_adapter(_is_pretrained, HFAdapter())
