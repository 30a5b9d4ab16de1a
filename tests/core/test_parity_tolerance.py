"""Why the parity tests compare parameters with an ``atol``: AdamW amplifies fp32 rounding, even in one process.

Four AdamW steps on the tiny GPT, once with the gradient of the whole global batch and once with the mean of the two
half-batch gradients (what two data-parallel replicas all-reduce): the gradients agree to rounding, yet the parameters
drift apart where a gradient entry is near zero, because Adam divides by ``sqrt(v) + eps``. This pins the figures
quoted in ``tests/helpers.assert_params_close``.
"""

from __future__ import annotations

import torch

from lightning_par.models import GPTConfig, GPTLightningModule
from tests.support.helpers import TokenDataset

CONFIG = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=256, dropout=0.0)


def _train(split: bool, eps: float) -> dict[str, torch.Tensor]:
    data = TokenDataset(n=32, seq=16)
    torch.manual_seed(0)
    module = GPTLightningModule(GPTConfig(**CONFIG), learning_rate=3e-3, adam_eps=eps)
    opt = module.configure_optimizers()["optimizer"]
    for step in range(4):
        x, y = data.data[step * 8 : (step + 1) * 8, :-1], data.data[step * 8 : (step + 1) * 8, 1:]
        halves = ([0, 2, 4, 6], [1, 3, 5, 7]) if split else (list(range(8)),)
        grads: dict[str, torch.Tensor] = {}
        for idx in halves:
            module.zero_grad()
            GPTLightningModule.loss_fn(module(x[idx]), y[idx]).backward()
            for n, p in module.named_parameters():
                grads[n] = grads.get(n, 0) + p.grad / len(halves)
        for n, p in module.named_parameters():
            p.grad = grads[n]
        opt.step()
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _max_diff(eps: float) -> float:
    a, b = _train(False, eps), _train(True, eps)
    return max((a[n] - b[n]).abs().max().item() for n in a)


def test_adam_amplifies_rounding_and_eps_1e6_bounds_it():
    torch.set_num_threads(1)
    at_1e8, at_1e6 = _max_diff(1e-8), _max_diff(1e-6)
    print(f"max |param diff| after 4 steps: eps=1e-8 {at_1e8:.2e}, eps=1e-6 {at_1e6:.2e}")
    assert at_1e8 > 1e-5  # the default eps: rounding alone exceeds a 1e-5 tolerance
    assert at_1e6 < 1e-5  # the parity runs' eps: within assert_params_close's atol
    assert at_1e6 < at_1e8
