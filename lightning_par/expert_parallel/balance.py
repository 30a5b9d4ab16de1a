"""DeepSeek-V3's auxiliary-loss-free load balancing, one update for every router that keeps a selection bias (the
GPT's :class:`~lightning_par.models.moe.Router` ``expert_bias``, Hugging Face's ``e_score_correction_bias``).

After every optimizer step each router's bias moves by ``rate * sign(mean load - load)`` (DeepSeek-AI 2024,
"DeepSeek-V3 Technical Report", §2.1.2; torchtitan's ``_update_expert_bias``, Megatron-core's
``--moe-router-enable-expert-bias``), the load being the routed copies per expert since the last update, summed over
the ranks holding other tokens with one all-reduce, so that every replica keeps the same bias. The bias only picks the
experts; the gating weights stay the unbiased scores (the routers' business).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["update_selection_biases"]


@torch.no_grad()
def update_selection_biases(entries: Sequence[tuple[Tensor, Tensor, float]], group: Any = None) -> None:
    """One bias update for each ``(load, bias, rate)``: ``bias += rate * sign(mean(load) - load)`` with ``load``
    summed over ``group``, then ``load`` zeroed.

    Args:
        entries: per router, its ``load`` ``(E,)`` (routed copies since the last update, float32, on the bias's
            device), its ``bias`` ``(E,)`` (changed in place) and its ``rate`` (> 0).
        group: the process group to sum the loads over (one all-reduce of every load concatenated, on the loads'
            device), or ``None`` for this rank's alone. Every rank of ``group`` must pass the same routers in the same
            order.

    A router that routed nothing since the last call keeps its bias (``sign(0) = 0``).
    """
    if not entries:
        return
    loads = torch.cat([load.reshape(-1) for load, _, _ in entries])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(loads, group=group)
    start = 0
    for load, bias, rate in entries:
        row = loads[start:start + load.numel()]
        start += load.numel()
        load.zero_()
        bias += rate * torch.sign(row.mean() - row).to(bias.dtype)
