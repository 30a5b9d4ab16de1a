"""Hugging Face causal language models under every lightning_par layout (extra ``lightning-par[hf]``).

Importing this package does not import ``transformers``; building a model does.
"""

from lightning_par.hf.module import HFCausalLM

__all__ = ["HFCausalLM"]
