"""Adapter-only checkpoints: a fine-tuning run with a frozen base (LoRA) saves and restores its trainable parameters
only.

A LoRA run's base is frozen: it never changes, and it comes back from where it came (a ``pretrained`` directory, or
the seeded build), so a checkpoint need not hold it. On the tiny Llama of the tests an adapter-only checkpoint is a few
percent of a full one (docs/lora.md gives the measured sizes). The rule, one place for saving and loading:

* a LightningModule's ``adapter_only_checkpoint`` attribute decides when it has one (``HFCausalLM(lora=...)`` sets it
  from ``lora.adapter_only_checkpoint``, default ``True``);
* else a module holding a ``peft.PeftModel`` (a user's module around ``get_peft_model``) saves adapter-only;
* in either case only when some parameter is frozen (``requires_grad=False``): those are left out, buffers kept.

Resuming loads the trainable parameters and the optimizer state and leaves the frozen weights as built, which is exact
because they are bitwise what they were (the tests check it after every layout).
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["adapter_only", "frozen_parameter_names"]


def adapter_only(module: nn.Module | None) -> bool:
    """Whether checkpoints of ``module`` hold its trainable parameters only (see the module docstring)."""
    if module is None:
        return False
    flag = getattr(module, "adapter_only_checkpoint", None)
    if flag is None:
        from lightning_par.hf.lora import is_peft_network

        flag = is_peft_network(module)
    return bool(flag) and any(not p.requires_grad for p in module.parameters())


def frozen_parameter_names(module: nn.Module | None) -> set[str]:
    """Names (as in ``module.state_dict()``) of the frozen parameters an adapter-only checkpoint leaves out; empty when
    checkpoints of ``module`` are whole."""
    if not adapter_only(module):
        return set()
    assert module is not None
    return {name for name, p in module.named_parameters() if not p.requires_grad}


def drop(state: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """``state`` without ``names`` (in place; also returned)."""
    for name in names:
        state.pop(name, None)
    return state
