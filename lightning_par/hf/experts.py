"""Expert parallelism for Hugging Face mixture-of-experts architectures: ``qwen3_moe`` (and ``mixtral``).

``transformers`` 5.24 keeps each MoE layer's experts as one module with the expert index on dim 0 of every parameter
(``Qwen3MoeExperts``: ``gate_up_proj`` ``(E, 2 * moe_intermediate_size, hidden)``, ``down_proj``
``(E, hidden, moe_intermediate_size)``), called by the sparse block as ``experts(hidden_states, top_k_index,
top_k_weights)``: routing and combination happen inside the experts call. The model contract
(:mod:`lightning_par.contract`) wants them outside: ``experts(x sorted by expert, counts)``, so that the ep axis can
exchange the sorted tokens around the call.

:func:`expert_modules` switches every supported sparse block and its experts to that convention by changing their
classes to subclasses (:class:`ContractSparseBlock`, :class:`ContractExperts`; ``FSDP2`` swaps classes the same way):
same parameters, same names, same state dict, the same arithmetic per token; only the order in which each token's
expert outputs are summed is the sorted order (expert-major, as ``transformers``' loop over experts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

__all__ = ["SUPPORTED_BLOCKS", "ContractExperts", "ContractSparseBlock", "expert_modules"]

#: Sparse-block classes whose experts can be split over the ep ranks (by class name: ``transformers`` is optional).
SUPPORTED_BLOCKS = ("Qwen3MoeSparseMoeBlock", "MixtralSparseMoeBlock")


def _local(w: Tensor) -> Tensor:
    """This rank's experts of an expert weight (a ``Shard(0)`` DTensor under ep), differentiably."""
    return w.to_local() if isinstance(w, DTensor) else w


class ContractExperts(nn.Module):
    """Mixin over an HF experts class: ``forward(x, counts)`` per the contract.

    ``x`` ``(tokens, hidden)`` sorted by expert, ``counts`` ``(experts held,)`` int64; returns ``(tokens, hidden)`` in
    the order of ``x``: each expert's ``down(act(gate(x)) * up(x))`` from its rows of ``gate_up_proj`` (gate first,
    then up, concatenated) and ``down_proj``, read through ``to_local()`` under ep.
    """

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:  # type: ignore[override]
        gate_up, down = _local(self.gate_up_proj), _local(self.down_proj)
        out = []
        for e, chunk in enumerate(x.split(counts.tolist())):
            gate, up = F.linear(chunk, gate_up[e]).chunk(2, dim=-1)
            out.append(F.linear(self.act_fn(gate) * up, down[e]))
        return torch.cat(out) if out else x[:0]


class ContractSparseBlock(nn.Module):
    """Mixin over an HF sparse MoE block: route, sort the token copies by expert, call the experts per the contract,
    weight and sum each token's expert outputs. ``(batch, seq, hidden) -> (batch, seq, hidden)``."""

    def forward(self, hidden_states: Tensor) -> Tensor:  # type: ignore[override]
        batch, seq, dim = hidden_states.shape
        x = hidden_states.reshape(-1, dim)  # (tokens, hidden)
        _, weights, chosen = self.gate(x)  # (tokens, top_k) each
        top_k = chosen.shape[-1]
        flat = chosen.reshape(-1)  # (tokens * top_k,)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.experts.gate_up_proj.shape[0])
        token = order // top_k
        y = self.experts(x[token], counts)  # (tokens * top_k, hidden), sorted by expert
        y = y * weights.reshape(-1)[order, None].to(y.dtype)
        out = torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))
        return out.reshape(batch, seq, dim)


_CLASSES: dict[tuple[type, type], type] = {}


def _switch(module: nn.Module, mixin: type) -> None:
    cls = type(module)
    if issubclass(cls, mixin):
        return
    new = _CLASSES.get((cls, mixin))
    if new is None:
        new = _CLASSES[(cls, mixin)] = type(cls.__name__, (mixin, cls), {"__module__": cls.__module__})
    module.__class__ = new


def _experts_shapes_ok(experts: nn.Module) -> bool:
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    return (
        isinstance(gate_up, Tensor) and isinstance(down, Tensor) and gate_up.dim() == 3 and down.dim() == 3
        and gate_up.shape[0] == down.shape[0] and callable(getattr(experts, "act_fn", None))
    )


def expert_modules(network: nn.Module) -> list[str]:
    """Paths of the experts modules of ``network``'s supported sparse blocks (``model.layers.1.mlp.experts``), each
    block and its experts switched to the contract's call (see the module docstring). Idempotent.

    Raises:
        ValueError: a sparse block of an architecture not in :data:`SUPPORTED_BLOCKS` (any module with ``experts``
            and ``gate`` children), or one whose experts are not laid out as ``gate_up_proj``/``down_proj``
            ``(E, ...)``; a router with jitter noise (``router_jitter_noise > 0``).
    """
    paths = []
    for name, module in network.named_modules():
        experts, gate = getattr(module, "experts", None), getattr(module, "gate", None)
        if not (isinstance(experts, nn.Module) and isinstance(gate, nn.Module)):
            continue
        base = [c.__name__ for c in type(module).__mro__]
        if not any(b in SUPPORTED_BLOCKS for b in base):
            raise ValueError(
                f"expert parallelism (ep_size > 1) is not valid for {type(network).__name__}: its mixture-of-experts "
                f"layer {name!r} ({type(module).__name__}) is not supported; supported: {list(SUPPORTED_BLOCKS)} "
                f"(model_type 'qwen3_moe', 'mixtral'). Use ep_size=1 (zero3 shards the experts with the rest)."
            )
        if getattr(module, "jitter_noise", 0):
            raise ValueError(
                f"expert parallelism is not valid for {type(network).__name__} with router_jitter_noise="
                f"{module.jitter_noise}: the contract's experts call routes the tokens as given; expected "
                f"router_jitter_noise=0."
            )
        if not _experts_shapes_ok(experts):
            raise ValueError(
                f"experts {name}.experts of {type(network).__name__} are not valid for expert parallelism: expected "
                f"gate_up_proj (E, 2 * intermediate, hidden) and down_proj (E, hidden, intermediate) parameters."
            )
        _switch(experts, ContractExperts)
        _switch(module, ContractSparseBlock)
        paths.append(f"{name}.experts" if name else "experts")
    return paths
