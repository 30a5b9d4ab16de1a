"""``GradientReducer`` on its own, at world size 2: what the strategy-level parity tests cannot reach."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.distributed


class _TwoBranches(nn.Module):
    """``a(x) + b(x)``, with the branch that runs first chosen by ``first``: autograd runs the branch created last
    first, so the order in which the gradients arrive differs between two ranks that choose differently."""

    def __init__(self, first: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.b = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        self.first = first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first == "a":
            ya = self.a(x)
            return ya + self.b(x)
        yb = self.b(x)
        return self.a(x) + yb


def _rebuild_worker() -> dict:
    import torch.distributed as dist

    from lightning_par.data_parallel.reducer import GradientReducer
    from lightning_par.launcher import init_process_group_from_env

    init_process_group_from_env(timeout_s=60)
    rank = dist.get_rank()
    model = _TwoBranches("b" if rank == 0 else "a")  # rank 0: not the registration order
    plain = _TwoBranches("a")  # the same weights, for the local gradients without any reducer
    # Buckets of about one tensor each, rebuilt after the first step in the order the gradients arrived.
    reducer = GradientReducer(list(model.parameters()), dist.group.WORLD, bucket_cap_mb=1e-4, static_graph=True)

    def bucket_order() -> list[list[int]]:
        return [[i for i, q in enumerate(model.parameters()) for p in b.params if p is q] for b in reducer.buckets]

    orders, errors = [bucket_order()], []
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        reducer.start_backward()
        model(x).pow(2).sum().backward()
        reducer.finish()
        plain(x).pow(2).sum().backward()
        for p, q in zip(model.parameters(), plain.parameters()):
            mean = q.grad.clone()
            dist.all_reduce(mean)
            errors.append((p.grad - mean / 2).abs().max().item())
            q.grad = None
            p.grad = None
        orders.append(bucket_order())
    dist.destroy_process_group()
    return {"max_error": max(errors), "orders": orders}


def test_static_graph_rebuild_keeps_the_buckets_the_same_on_every_rank():
    """Rebuilt from the arrival order, the buckets are rank 0's on every rank even where gradients arrive in another
    order on another rank (torch DDP also broadcasts rank 0's assignment): otherwise bucket i would hold different
    parameters on different ranks and the all-reduce would add unrelated gradients."""
    from lightning_par.launcher import run_distributed

    results = run_distributed(_rebuild_worker, 2, timeout_s=120)
    assert results[0]["orders"][-1] == results[1]["orders"][-1]
    assert results[0]["orders"][0] != results[0]["orders"][-1]  # the rebuild did reorder the buckets (after step 1)
    for r in results:
        assert r["max_error"] <= 1e-6
