"""One dp mode over parameters whose replicas live on different meshes: one engine per group, driven as one.

Expert parallelism splits each mixture-of-experts layer's experts over the ``ep`` ranks, so an expert's replicas are
the ``edp`` ranks (those holding the same experts), not all data-parallel ranks: its gradients are averaged over
``edp``, and ZeRO shards its state over ``edp_shard``. :class:`GroupedEngine` runs the same dp mode twice — over the
model's other parameters on the dp meshes and over the expert parameters on theirs — and answers the strategy as one
engine: hooks in both, one state dict, one optimizer (each ZeRO engine re-points its own parameters), one gradient
norm over every group.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_par.data_parallel.engine import DataParallelEngine
from lightning_par.data_parallel.reducer import CommStats

__all__ = ["GroupedEngine"]


class GroupedEngine(DataParallelEngine):
    """Several engines of one dp mode, each over its own parameters and meshes.

    Args:
        module: the model (state keys are relative to it).
        engines: the first over the parameters on the dp meshes, then one per group on other meshes.
        names: for each engine after the first, the names of its parameters.
    """

    def __init__(self, module: nn.Module, engines: Sequence[DataParallelEngine], names: Sequence[set[str]]) -> None:
        super().__init__(module, engines[0].dp_mesh)
        self.engines = list(engines)
        self.names = [set()] + [set(n) for n in names]
        for engine in self.engines:  # ZeRO-1/2 engines leave each other's optimizer entries alone
            if hasattr(engine, "others"):
                engine.others = [e for e in self.engines if e is not engine]

    @property
    def stage(self) -> int:  # type: ignore[override]
        return self.engines[0].stage

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        for engine in self.engines:
            engine.shard_optimizer(optimizer)

    @contextmanager
    def _all(self, method: str) -> Generator[None, None, None]:
        with ExitStack() as stack:
            for engine in self.engines:
                stack.enter_context(getattr(engine, method)())
            yield

    def no_sync(self) -> Any:
        return self._all("no_sync")

    def defer_sync(self) -> Any:
        return self._all("defer_sync")

    def pre_backward(self) -> None:
        for engine in self.engines:
            engine.pre_backward()

    def post_backward(self) -> CommStats | None:
        """Every engine's; the statistics of the first (the parameters on the dp meshes)."""
        stats = [engine.post_backward() for engine in self.engines]
        return stats[0]

    def reduce_now(self) -> CommStats | None:
        """Every engine's; the statistics of the first."""
        stats = [engine.reduce_now() for engine in self.engines]
        return stats[0]

    def reshard(self) -> None:
        for engine in self.engines:
            engine.reshard()

    @torch.no_grad()
    def clip_grad_norm_(
        self,
        params: Iterable[nn.Parameter],
        max_norm: float,
        norm_type: float = 2.0,
        groups: Sequence[dist.ProcessGroup | None] = (),
    ) -> Tensor:
        """The whole model's gradient norm: each ZeRO engine's part over its own groups, plus the parameters no engine
        shards (replicated over dp, DTensors counted over their meshes), then over ``groups`` (pp)."""
        from lightning_par.data_parallel.zero import clip_by_total_norm, combine_norm_parts
        from lightning_par.pipeline_parallel.clip import _powered_norm_sum

        zero = [e for e in self.engines if hasattr(e, "grad_norm_part")]
        if not zero:
            return super().clip_grad_norm_(params, max_norm, norm_type, groups)
        q = float(norm_type)
        params = [p for p in params if p.grad is not None]
        total = torch.zeros((), dtype=torch.float32, device=zero[0].dp_mesh.device_type)
        claimed: set[int] = set()
        for engine in zero:
            own = [p for p in params if id(p) in engine._shard_of]
            claimed.update(id(p) for p in own)
            total = combine_norm_parts(total, engine.grad_norm_part(own, q), q)
        rest = [p.grad for p in params if id(p) not in claimed]
        if rest:
            total = combine_norm_parts(total, _powered_norm_sum(rest, q), q)
        return clip_by_total_norm(params, total, max_norm, q, groups)

    # ------------------------------------------------------------------ state
    def _owner(self, name: str) -> int:
        return next((i for i, names in enumerate(self.names) if name in names), 0)

    def model_state_dict(self) -> dict[str, Any]:
        state = self.engines[0].model_state_dict()
        for i, engine in enumerate(self.engines[1:], 1):
            state.update({k: v for k, v in engine.model_state_dict().items() if k in self.names[i]})
        return state

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        for i, engine in enumerate(self.engines):
            engine.load_model_state_dict({k: v for k, v in state.items() if self._owner(k) == i})

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        out = self.engines[0].optimizer_state_dict(optimizer)
        if hasattr(self.engines[0], "others"):  # ZeRO-1/2: each engine gives its own parameters' state
            for engine in self.engines[1:]:
                out["state"].update(engine.optimizer_state_dict(optimizer)["state"])
        return out

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        self.engines[0].load_optimizer_state_dict(optimizer, state)

    def full_grads(self) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for i, engine in enumerate(self.engines):
            full = engine.full_grads()
            out.update({k: v for k, v in full.items() if self._owner(k) == i})
        return out

    def full_state_dict(self) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for i, engine in enumerate(self.engines):
            full = engine.full_state_dict()
            out.update({k: v for k, v in full.items() if self._owner(k) == i})
        return out

    def summary(self) -> dict[str, Any]:
        out = self.engines[0].summary()
        for engine in self.engines[1:]:
            out.update({f"expert_{k}": v for k, v in engine.summary().items()})
        return out

    def remove(self) -> None:
        for engine in self.engines:
            engine.remove()
