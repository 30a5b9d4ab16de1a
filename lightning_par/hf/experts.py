"""Expert parallelism for Hugging Face mixture-of-experts architectures (qwen3_moe, qwen2_moe, olmoe, mixtral,
deepseek_v3, and any other whose experts are laid out and called alike).

``transformers`` 5.24 and 5.25 keep each MoE layer's experts as one module with the expert index on dim 0 of every parameter
(``Qwen3MoeExperts``: ``gate_up_proj`` ``(E, 2 * moe_intermediate_size, hidden)``, ``down_proj``
``(E, hidden, moe_intermediate_size)``), called by the layer's own ``forward`` as ``experts(hidden_states,
top_k_index, top_k_weights)`` after its router: routing and combination happen inside the experts call. The model
contract (:mod:`lightning_par.contract`) wants them outside: ``experts(x sorted by expert, counts)``, so that the ep
axis can exchange the sorted tokens around the call.

:func:`expert_modules` switches every experts module to a subclass (:class:`ContractExperts`; ``FSDP2`` swaps classes
the same way: same parameters, names and state dict) that takes both calls. The model's call
``experts(hidden_states (T, d), top_k_index (T, k), top_k_weights (T, k))`` sorts the token copies by expert, makes
the contract's call ``experts(x, counts)`` (through ``nn.Module.__call__``, so the ep axis's hooks exchange the tokens),
weights each output by its routing weight and sums each token's outputs. Everything else of the MoE layer stays the
model's own code: its router (Qwen's softmax top-k, DeepSeek-V3's sigmoid scores with ``e_score_correction_bias``,
grouped top-k and ``routed_scaling_factor``), shared experts and their gates (Qwen2-MoE's ``shared_expert`` with its
sigmoid ``shared_expert_gate``, DeepSeek-V3's ``shared_experts``), Mixtral's router jitter. The arithmetic per token
is the model's: each expert's ``down(_apply_gate(gate_up(x)))`` (``transformers``' gating function of the class),
times its weight, summed over the token's experts in expert order (``transformers``' loop over experts).

Which modules are experts, and whether this call computes what theirs does, is read from the model, not from a list of
architectures: an experts module is a child ``experts`` of an MoE layer whose class's ``forward`` takes
``(hidden_states, top_k_index, top_k_weights)``, with ``gate_up_proj``/``down_proj`` of 3 dims and no bias, not
transposed nor interleaved, no post-expert norm (the flags ``transformers``' ``use_experts_implementation`` sets);
and, on real (not ``meta``) weights, the class's own ``forward`` and the contract's path are compared on a probe of 8
tokens routed to every expert. Anything else is refused before start, naming the layer and what differs.

Auxiliary-loss-free balancing (:func:`balance_by_bias`, ``HFCausalLM(moe_balance="bias")``): a router that keeps a
per-expert selection bias ``e_score_correction_bias`` (DeepSeek-V3's, and the models built like it) sees it moved after
every optimizer step by DeepSeek-V3's rule (:mod:`lightning_par.expert_parallel.balance`), the load counted by the
experts module from the model's call (``top_k_index``) and summed over the dp x cp ranks. ``transformers`` keeps the
buffer (float32, persistent), so checkpoints hold it and a resumed run continues with it.

Router auxiliary losses: :class:`lightning_par.hf.HFCausalLM` calls the model without ``labels``, so ``transformers``
never adds ``router_aux_loss_coef * aux_loss`` to a loss (with ``output_router_logits`` it computes ``aux_loss``,
which is then not used): training is the same in one process and under ep.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_par.compat.transformers import experts_gate_function
from lightning_par.expert_parallel.balance import update_selection_biases
from lightning_par.expert_parallel.grouped import expert_ffn, sorted_counts

__all__ = ["BIAS_BUFFER", "ContractExperts", "balance_by_bias", "expert_modules", "selection_bias_entry",
           "update_hf_expert_bias"]

#: The per-expert selection bias a Hugging Face router may keep (DeepSeek-V3's ``DeepseekV3TopkRouter``).
BIAS_BUFFER = "e_score_correction_bias"

#: The arguments of ``transformers``' experts call, in order.
_MODEL_CALL = ("hidden_states", "top_k_index", "top_k_weights")
#: ``use_experts_implementation`` flags and the value the contract's call needs.
_LAYOUT_FLAGS = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
                 "has_post_expert_norm": False}


def _local(w: Tensor) -> Tensor:
    """This rank's experts of an expert weight (a ``Shard(0)`` DTensor under ep), differentiably."""
    return w.to_local() if isinstance(w, DTensor) else w


def _gate(experts: nn.Module, gate_up_out: Tensor) -> Tensor:
    """``act(gate) * up`` as the experts class computes it (``_apply_gate`` where ``transformers`` defines it)."""
    apply = experts_gate_function(experts)
    if apply is not None:
        return apply(gate_up_out)
    gate, up = gate_up_out.chunk(2, dim=-1)
    return experts.act_fn(gate) * up


class ContractExperts(nn.Module):
    """Mixin over an HF experts class: the model's call and the contract's (see the module docstring).

    ``experts(hidden_states, top_k_index, top_k_weights)`` (``(T, d)``, ``(T, k)`` int64, ``(T, k)``) returns
    ``(T, d)`` as the class's own ``forward``; ``experts(x, counts)`` (``x`` ``(tokens, d)`` sorted by expert,
    ``counts`` ``(experts held,)`` int64) returns ``(tokens, d)`` in the order of ``x``: each expert's
    ``down(_apply_gate(gate_up(x)))`` from its rows of ``gate_up_proj`` and ``down_proj``, read through ``to_local()``
    under ep, in the form :func:`~lightning_par.expert_parallel.grouped.expert_ffn` chooses (grouped matmul, padded
    ``bmm``, or the per-expert loop as a fallback).
    """

    #: the ep dispatch may hand :meth:`forward` the counts already read to the host (``host_counts``).
    accepts_host_counts = True
    #: the experts' form (:data:`~lightning_par.expert_parallel.grouped.FORMS`; ``None``: chosen per call).
    form: str | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        if len(args) + len(kwargs) == 3 and "host_counts" not in kwargs:  # the model's call, made by its MoE layer's own forward
            bound = dict(zip(_MODEL_CALL, args), **kwargs)
            return self._route(bound["hidden_states"], bound["top_k_index"], bound["top_k_weights"])
        return super().__call__(*args, **kwargs)

    def _route(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        top_k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)  # (T * k,)
        order = torch.argsort(flat, stable=True)
        counts = sorted_counts(flat[order], self.gate_up_proj.shape[0])  # no host read (bincount's on CUDA)
        load = getattr(self, "routed_load", None)
        if load is not None and self.training:  # this rank's routed copies, for the bias update (balance_by_bias)
            with torch.no_grad():
                load += counts.to(load.dtype)
        token = order // top_k
        # index_select: one gather whose backward is one index_add_ (indexing's goes through index_put_ with accumulate)
        # (T * k, d), sorted by expert; ep hooks here
        y = nn.Module.__call__(self, hidden_states.index_select(0, token), counts)
        y = y * top_k_weights.reshape(-1)[order, None]  # as transformers: the weight's dtype may promote
        return torch.zeros_like(hidden_states).index_add_(0, token, y.to(hidden_states.dtype))

    def forward(self, x: Tensor, counts: Tensor, host_counts: list[int] | None = None) -> Tensor:  # type: ignore[override]
        gate_up, down = _local(self.gate_up_proj), _local(self.down_proj)
        # F.linear(x, W[e]) is x @ W[e].T: the transposed views are the (E, in, out) weights expert_ffn takes
        return expert_ffn(x, counts, gate_up.transpose(1, 2), down.transpose(1, 2), lambda h: _gate(self, h),
                          form=self.form, host_counts=host_counts)

    def update_expert_bias(self, group: Any = None) -> None:
        """One step of DeepSeek-V3's auxiliary-loss-free balancing of this layer's router bias (a no-op unless
        :func:`balance_by_bias` enabled it): see :func:`update_hf_expert_bias`."""
        update_hf_expert_bias([self], group)


_CLASSES: dict[type, type] = {}


def _router_with_bias(layer: nn.Module, experts: nn.Module) -> nn.Module | None:
    """The module of ``layer`` (an MoE layer) keeping a ``(E,)`` :data:`BIAS_BUFFER`, or ``None``."""
    num = experts.gate_up_proj.shape[0]
    for module in layer.modules():
        bias = getattr(module, BIAS_BUFFER, None)
        if module is not experts and isinstance(bias, Tensor) and tuple(bias.shape) == (num,):
            return module
    return None


def balance_by_bias(network: nn.Module, rate: float) -> list[str]:
    """Enable DeepSeek-V3's auxiliary-loss-free balancing on every MoE layer of ``network`` whose router keeps a
    :data:`BIAS_BUFFER` (see the module docstring): its experts module (switched to :class:`ContractExperts`) counts
    the routed copies per expert in training (``routed_load``, ``(E,)`` float32, not saved) and
    :func:`update_hf_expert_bias` moves the router's bias by ``rate * sign(mean load - load)``.

    Args:
        network: the Hugging Face model (a ``PreTrainedModel``).
        rate: the update speed ``gamma`` (> 0; DeepSeek-V3 used 0.001).

    Returns:
        the paths of the experts modules whose router is balanced.

    Raises:
        ValueError: no MoE layer of ``network`` has a router with such a bias, or :func:`expert_modules`'s errors.
    """
    balanced = []
    for path in expert_modules(network):
        experts = network.get_submodule(path)
        layer = network.get_submodule(path.rpartition(".")[0])
        router = _router_with_bias(layer, experts)
        if router is None:
            continue
        bias = getattr(router, BIAS_BUFFER)
        experts.register_buffer("routed_load", torch.zeros(bias.shape, dtype=torch.float32, device=bias.device),
                                persistent=False)
        experts.bias_update_rate = float(rate)
        experts._lp_bias_router = [router]  # in a list: not a submodule of the experts
        balanced.append(path)
    if not balanced:
        raise ValueError(
            f"moe_balance='bias' is not valid for {type(network).__name__}: none of its mixture-of-experts layers has "
            f"a router with a per-expert {BIAS_BUFFER} to update (DeepSeek-V3's); use moe_balance=None."
        )
    return balanced


def update_hf_expert_bias(experts: list[nn.Module], group: Any = None) -> None:
    """DeepSeek-V3's bias update (:func:`~lightning_par.expert_parallel.balance.update_selection_biases`) of the
    routers of ``experts`` (experts modules; those :func:`balance_by_bias` did not enable are skipped), their loads
    summed over ``group`` with one all-reduce. Call it after every optimizer step on every rank of ``group`` (the
    ranks holding other tokens: dp x cp), each passing the same modules in the same order."""
    update_selection_biases([e for e in map(selection_bias_entry, experts) if e is not None], group)


def selection_bias_entry(experts: nn.Module) -> tuple[Tensor, Tensor, float] | None:
    """``(routed load (E,) float32, the router's e_score_correction_bias (E,), update rate)`` of an experts module
    :func:`balance_by_bias` enabled, read now (``.to()`` may have replaced the buffers); ``None`` for any other
    module."""
    router = getattr(experts, "_lp_bias_router", None)
    if getattr(experts, "routed_load", None) is None or not router:
        return None
    return experts.routed_load, getattr(router[0], BIAS_BUFFER), experts.bias_update_rate


def _switch(module: nn.Module) -> None:
    cls = type(module)
    if issubclass(cls, ContractExperts):
        return
    new = _CLASSES.get(cls)
    if new is None:
        new = _CLASSES[cls] = type(cls.__name__, (ContractExperts, cls), {"__module__": cls.__module__})
    module.__class__ = new


def _model_forward(cls: type) -> Any:
    """The experts class's own ``forward`` (below ``use_experts_implementation``'s dispatch wrapper)."""
    forward = cls.forward
    return getattr(forward, "__wrapped__", forward)


def _why_not(experts: nn.Module) -> str | None:
    """What keeps ``experts`` from the contract's call, or ``None``."""
    cls = next(c for c in type(experts).__mro__ if not issubclass(c, ContractExperts))
    params = [p for p in inspect.signature(_model_forward(cls)).parameters if p != "self"]
    if tuple(params) != _MODEL_CALL:
        return f"its forward takes {params}, expected {list(_MODEL_CALL)}"
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, Tensor) and isinstance(down, Tensor) and gate_up.dim() == 3 and down.dim() == 3
            and gate_up.shape[0] == down.shape[0] and gate_up.shape[1] == 2 * down.shape[2]
            and gate_up.shape[2] == down.shape[1]):
        return ("expected gate_up_proj (E, 2 * intermediate, hidden) and down_proj (E, hidden, intermediate) "
                "parameters")
    others = sorted(n for n, _ in experts.named_parameters() if n not in ("gate_up_proj", "down_proj"))
    if others:
        return f"it has parameters {others} besides gate_up_proj and down_proj"
    for flag, want in _LAYOUT_FLAGS.items():
        if getattr(experts, flag, want) != want:
            return f"{flag}={getattr(experts, flag)!r}, expected {want!r}"
    if not callable(getattr(experts, "act_fn", None)) and experts_gate_function(experts) is None:
        return "it has no act_fn"
    return None


@torch.no_grad()
def _probe(experts: nn.Module) -> float:
    """Largest difference between the experts class's own ``forward`` and the contract's path on 8 tokens routed to
    every expert (2 per token, random weights), relative to the largest output; ``0.0`` on ``meta`` or already
    sharded weights (nothing to compare)."""
    if experts.gate_up_proj.is_meta or isinstance(experts.gate_up_proj, DTensor):
        return 0.0
    num, hidden = experts.gate_up_proj.shape[0], experts.gate_up_proj.shape[2]
    generator = torch.Generator().manual_seed(0)
    dtype, device = experts.gate_up_proj.dtype, experts.gate_up_proj.device
    x = torch.randn(8, hidden, generator=generator).to(device, dtype)
    index = torch.stack([torch.arange(8) % num, (torch.arange(8) + 1) % num], dim=1).to(device)
    if num == 1:
        index = index[:, :1]
    weights = torch.rand(index.shape, generator=generator).to(device, dtype)
    cls = next(c for c in type(experts).__mro__ if not issubclass(c, ContractExperts))
    mine = ContractExperts._route(experts, x, index, weights)
    theirs = _model_forward(cls)(experts, x, index, weights)
    return float((mine - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30))


def expert_modules(network: nn.Module) -> list[str]:
    """Paths of the experts modules of ``network``'s mixture-of-experts layers (``model.layers.1.mlp.experts``), each
    switched to the contract's call (see the module docstring). Idempotent.

    Raises:
        ValueError: an MoE layer (a module with an ``experts`` child) whose experts are not called or laid out as the
            contract's call needs (see the module docstring), or whose own ``forward`` and the contract's path differ
            on the probe by more than ``1e-5`` relative to the output.
    """
    paths = []
    for name, module in network.named_modules():
        experts = getattr(module, "experts", None)
        if not isinstance(experts, nn.Module) or isinstance(module, nn.ModuleList):
            continue
        path = f"{name}.experts" if name else "experts"
        why = _why_not(experts)
        if why is None:
            was = type(experts)
            _switch(experts)
            gap = _probe(experts)
            if gap > 1e-5:
                experts.__class__ = was
                why = f"its own forward and the sorted expert call differ by {gap:.3g} on a probe"
        if why is not None:
            raise ValueError(
                f"expert parallelism (ep_size > 1) is not valid for {type(network).__name__}: the experts "
                f"{path!r} ({type(experts).__name__}) of its mixture-of-experts layer {name!r} "
                f"({type(module).__name__}) cannot be split over ep ranks: {why}. Use ep_size=1 (zero3 shards the "
                f"experts with the rest)."
            )
        paths.append(path)
    return paths
