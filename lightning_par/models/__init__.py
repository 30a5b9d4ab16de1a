"""Models trained by the recipes: a nanoGPT-sized GPT and its Lightning wrapper."""

from lightning_par.models.gpt import GPT, GPT_PRESETS, MLP, Block, CausalSelfAttention, GPTConfig
from lightning_par.models.lightning_module import GPTLightningModule, lr_lambda

__all__ = [
    "GPT",
    "GPT_PRESETS",
    "MLP",
    "Block",
    "CausalSelfAttention",
    "GPTConfig",
    "GPTLightningModule",
    "lr_lambda",
]
