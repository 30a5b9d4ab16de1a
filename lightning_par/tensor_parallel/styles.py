"""The parallel styles torch does not ship: plain replicated modules, vocab-parallel embedding and LM head.

Column- and row-parallel layers and the one-collective input of a group of column-parallel layers are torch's own
styles (``ColwiseParallel``, ``RowwiseParallel``, ``PrepareModuleInput``); :mod:`lightning_par.tensor_parallel.plan`
maps the plan's style names onto them. This file adds what they lack:

* :class:`ReplicateParallel`: a module that runs on replicated activations keeps *plain* parameters and runs on
  plain tensors: no DTensor where a replicated tensor serves (norms, their biases, a position table, dropouts).
  torch's alternative (``Replicate`` DTensor parameters) sends every operator of the module and every optimizer update
  of its parameters through DTensor's dispatch: measured here, AdamW on a replicated DTensor is about 6x slower per
  tensor than on a plain one, which made our plan 1.06x torch's stock plan in CPU time per step at tp 2 (small GPT).
  With ``output_shard_dim`` the replicated output is cut to this rank's sequence shard (a learned position table
  under sequence parallelism).
* :class:`PlainSequenceParallel`: a per-token module on the residual stream (LayerNorm, RMSNorm, Dropout, a model
  library's own norm class, a token-wise mixture of experts) under sequence parallelism (Korthikanti et al. 2022,
  §4.2.2) runs on this rank's sequence shard, with plain parameters.
* :class:`ColwiseInput`: the one collective in front of a group of column-parallel layers (Megatron's ``f``, or ``g``
  under sequence parallelism) on the module's *first input*, passed by position or by keyword (Hugging Face layers
  call ``self_attn(hidden_states=...)``; torch's ``PrepareModuleInput`` needs the layouts of each calling
  convention spelled out).
* Parameters that see only this rank's positions (those two cases) get a gradient that is this rank's *partial sum*:
  the style records them on their module (:data:`PARTIAL_GRAD_ATTR`) and :func:`sync_partial_grads` sums them over
  the tp ranks in one all-reduce, once per optimizer step, after the data-parallel reduction and before clipping (the
  reductions are sums, so their order does not matter): Megatron-LM's all-reduce of the sequence-parallel layer-norm
  gradients (its ``finalize_model_grads``). torch's ``SequenceParallel`` gives the same parameters ``Partial`` DTensor
  gradients that DTensor reduces lazily, once per optimizer operator that reads them, or (``reduce_partial_grads_
  eagerly``) one all-reduce per parameter.
* :class:`VocabParallelEmbedding` / :class:`VocabParallelHead`: the token embedding and LM head split over the
  vocabulary (Megatron-LM, Shoeybi et al. 2019, §3), padded to a multiple of ``tp_size`` as Megatron does, with the
  padded logits masked so they never change the loss (see :mod:`lightning_par.tensor_parallel.vocab`). The
  embedding runs Megatron's masked local lookup itself: torch's ``RowwiseParallel`` on an ``nn.Embedding`` gives
  every rank a full, replicated ``(vocab, n_embd)`` weight gradient (DTensor has no row-sharded strategy for
  ``embedding_dense_backward``). Its collectives are still DTensor redistributions; no hand-written autograd
  communication op is needed anywhere (the Megatron ``f``/``g`` operators are the ``colwise_input`` style).

Every style here returns local (plain) tensors, except the LM head, whose logits stay a DTensor sharded on the
vocabulary so that the loss can run vocab-parallel.

Dropout on replicated activations (``ReplicateParallel``) draws its mask from each rank's own generator: the tp ranks
agree only if they are seeded alike (``seed_everything`` seeds every rank with the same seed), as in Megatron-LM.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.distributed.tensor.placement_types import Placement

from lightning_par.compat import foreach_copy_, local_tensor, parallel_style_hooks
from lightning_par.tensor_parallel.vocab import VOCAB_SIZE_ATTR, mask_padded_logits, pad_rows, padded_vocab_size

__all__ = [
    "PARTIAL_GRAD_ATTR",
    "Colwise",
    "ColwiseInput",
    "PlainSequenceParallel",
    "ReplicateParallel",
    "Rowwise",
    "SequenceGather",
    "SequenceScatter",
    "VocabParallelEmbedding",
    "VocabParallelHead",
    "check_sequence_divisible",
    "mask_padded_vocab",
    "partial_grad_names",
    "sync_partial_grads",
    "sync_tp_partial_grads",
    "transposed_linear_features",
]

#: Attribute a style sets on a module: the names of the module's own (plain) parameters whose gradients are partial
#: sums over the tp ranks, to be summed by :func:`sync_partial_grads`. Kept on the module, not the parameter, so it
#: survives what replaces parameter objects (FSDP2's ``fully_shard``).
PARTIAL_GRAD_ATTR = "_lp_tp_partial_grad_params"


def check_sequence_divisible(seq: int, tp_size: int) -> None:
    """Sequence parallelism gives each rank ``seq / tp_size`` positions: ``seq`` must divide evenly.

    Raises:
        ValueError: ``seq % tp_size != 0``.
    """
    if seq % tp_size != 0:
        raise ValueError(
            f"sequence length seq={seq} is not valid with sequence_parallel=True and tp_size={tp_size}: expected a "
            f"multiple of {tp_size} (each rank holds seq / tp_size positions)."
        )


def _mark_partial_grads(module: nn.Module) -> None:
    """Record every trainable parameter of ``module``'s subtree as a partial-gradient one (on its own module)."""
    for sub in module.modules():
        names = {n for n, p in sub.named_parameters(recurse=False) if p.requires_grad}
        if names:
            setattr(sub, PARTIAL_GRAD_ATTR, frozenset(names) | getattr(sub, PARTIAL_GRAD_ATTR, frozenset()))


def _to_local(x: Any, placement: Placement) -> Any:
    """A DTensor input as this rank's local tensor in ``placement``; anything else as is."""
    if isinstance(x, DTensor):
        if x.placements != (placement,):
            x = x.redistribute(placements=[placement])
        return x.to_local()
    return x


class ReplicateParallel(ParallelStyle):
    """Run a module on replicated activations with its parameters left plain (replicated over the tp ranks).

    Each tp rank computes the same output and the same full gradient, so no collective runs, forward or backward.
    DTensor inputs are made replicated and local first; the module and its parameters see only plain tensors.

    Args:
        output_shard_dim: if not None, cut the (replicated) output to this rank's shard of that dim (negative counts
            from the end; a view, no communication). A position table ``(seq, n_embd)`` under sequence parallelism
            uses ``-2``. Its parameters then get gradients from this rank's positions only: partial sums over the tp
            ranks, recorded for :func:`sync_partial_grads`.
        partial_grads: the module runs on this rank's *part* of a tensor that is split over the tp ranks elsewhere
            (a per-head norm on the local heads, Qwen3's ``q_norm``/``k_norm``): its parameters' gradients are partial
            sums over the tp ranks, recorded for :func:`sync_partial_grads`.

    Raises:
        ValueError: (in forward) the output's ``output_shard_dim`` is not divisible by ``tp_size``.
    """

    def __init__(self, *, output_shard_dim: int | None = None, partial_grads: bool = False) -> None:
        super().__init__()
        self.output_shard_dim = output_shard_dim
        self.partial_grads = partial_grads

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(_InputsToLocal(Replicate()))
        if self.output_shard_dim is not None:
            module.register_forward_hook(_ShardOutput(self.output_shard_dim, device_mesh))
        if self.output_shard_dim is not None or self.partial_grads:
            _mark_partial_grads(module)
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}(output_shard_dim={self.output_shard_dim}, partial_grads={self.partial_grads})"


class PlainSequenceParallel(ParallelStyle):
    """Run a per-token module (LayerNorm, RMSNorm, Dropout, any module whose output at a position depends only on its
    input at that position) on this rank's sequence shard with plain parameters.

    Sequence parallelism (Korthikanti et al. 2022, §4.2.2): the activations between the sub-blocks are split over the
    sequence (dim 1) across the tp ranks, so a norm computes ``seq / tp_size`` positions. Its weight and bias stay
    plain tensors; their gradients (those of its whole subtree) cover this rank's positions only (partial sums over
    the tp ranks), recorded for :func:`sync_partial_grads`. Input and output: local ``(batch, seq / tp_size, ...)``
    tensors (a DTensor input is made ``Shard(1)`` and local first).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(_InputsToLocal(Shard(1)))
        _mark_partial_grads(module)
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ColwiseInput(ParallelStyle):
    """Prepare the first input of a module whose sub-layers are column-parallel (attention, MLP): one collective.

    Megatron-LM's ``f`` (identity forward, all-reduce backward; Shoeybi et al. 2019, §3), or under sequence parallelism
    its ``g`` (all-gather over the sequence forward, reduce-scatter backward; Korthikanti et al. 2022, §4.2.2). The
    input ``(batch, seq, d)`` (``(batch, seq / tp, d)`` with sequence parallelism) becomes a replicated DTensor
    ``(batch, seq, d)``, which the column-parallel layers inside take as is. The first input is the module's first
    positional argument, or the keyword argument named like the first parameter of its ``forward`` (``hidden_states``
    for a Hugging Face attention called as ``self_attn(hidden_states=...)``); other arguments pass untouched. The same
    operations as torch's ``PrepareModuleInput(input_layouts=(layout,), desired_input_layouts=(Replicate(),),
    use_local_output=False)`` on a positional input.

    Args:
        sequence_parallel: the input is sharded on the sequence dim (1).

    Raises:
        ValueError: (when applied) ``forward`` has no parameter to take the input; (in forward) the module was called
            without its first input. The message names the module's class and the parameter.
    """

    def __init__(self, *, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        import inspect

        params = [p for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if not params:
            raise ValueError(
                f"style 'colwise_input' is not valid for a {type(module).__name__}: its forward takes no positional "
                f"parameter to receive the activations (batch, seq, d)."
            )
        layout = Shard(1) if self.sequence_parallel else Replicate()
        module.register_forward_pre_hook(_FirstInput(params[0].name, layout, device_mesh), with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sequence_parallel={self.sequence_parallel})"


class SequenceScatter(ParallelStyle):
    """Cut the first input of a module, the whole residual stream ``(batch, seq, d)`` (replicated over the tp ranks), to
    this rank's sequence shard ``(batch, seq / tp_size, d)`` under sequence parallelism (Korthikanti et al. 2022,
    §4.2.2); backward all-gathers the gradient over the sequence. Without sequence parallelism it does nothing.

    It moves the scatter of sequence parallelism from the token embedding to the first decoder layer, so that what a
    model computes between the two (a Hugging Face model's attention masks from the embeddings' length, its positions,
    any scaling) sees the whole sequence, as in one process. The input is the first positional argument or the keyword
    argument named like the first parameter of ``forward``. Holds no parameters.

    Args:
        enabled: sequence parallelism is on.

    Raises:
        ValueError: (in forward) ``seq`` is not a multiple of ``tp_size``, or the module was called without its first
            input.
    """

    covers_parameters = False

    def __init__(self, *, enabled: bool = True) -> None:
        super().__init__()
        self.enabled = enabled

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not self.enabled:
            return module
        import inspect

        params = [p for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        name = params[0].name if params else ""
        module.register_forward_pre_hook(_ScatterFirstInput(name, device_mesh), with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}(enabled={self.enabled})"


class SequenceGather(ParallelStyle):
    """The converse of :class:`SequenceScatter`, on the last module that runs on sequence shards (a model's last decoder
    layer): under sequence parallelism its output ``(batch, seq / tp_size, d)`` is all-gathered to the whole sequence
    ``(batch, seq, d)``, replicated over the tp ranks (backward keeps this rank's part of the gradient, which every rank
    computes alike). What the model does after its layers (a final norm, reshapes by the input's length such as GPT-2's
    ``view(-1, seq, d)``, the LM head) then sees the whole sequence. A tuple output has its first element gathered.
    Without sequence parallelism it does nothing. Holds no parameters.
    """

    covers_parameters = False

    def __init__(self, *, enabled: bool = True) -> None:
        super().__init__()
        self.enabled = enabled

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.enabled:
            module.register_forward_hook(_GatherOutput(device_mesh))
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}(enabled={self.enabled})"


class _GatherOutput:
    """Forward hook of :class:`SequenceGather`."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh

    def _gather(self, y: Any) -> Any:
        if not isinstance(y, Tensor):
            return y
        dt = y if isinstance(y, DTensor) else DTensor.from_local(y, self.mesh, [Shard(1)], run_check=False)
        return dt.redistribute(placements=[Replicate()]).to_local()

    def __call__(self, module: nn.Module, inputs: Any, output: Any) -> Any:
        if isinstance(output, tuple):
            return (self._gather(output[0]), *output[1:])
        return self._gather(output)


class _ScatterFirstInput:
    """Forward pre-hook of :class:`SequenceScatter`."""

    def __init__(self, name: str, mesh: DeviceMesh) -> None:
        self.name, self.mesh = name, mesh

    def _cut(self, x: Any) -> Any:
        if not isinstance(x, Tensor):
            return x
        if isinstance(x, DTensor):
            x = x.redistribute(placements=[Replicate()]).to_local()
        check_sequence_divisible(x.shape[1], self.mesh.size())
        dt = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False)
        return dt.redistribute(placements=[Shard(1)]).to_local()

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if args:
            return (self._cut(args[0]), *args[1:]), kwargs
        if self.name in kwargs:
            return args, {**kwargs, self.name: self._cut(kwargs[self.name])}
        raise ValueError(
            f"style 'sequence_scatter' on a {type(module).__name__}: it was called without its first input "
            f"{self.name!r}, so the sequence could not be split over the tp ranks."
        )


class _FirstInput:
    """Forward pre-hook of :class:`ColwiseInput`: the first input as a replicated DTensor."""

    def __init__(self, name: str, layout: Placement, mesh: DeviceMesh) -> None:
        self.name, self.layout, self.mesh = name, layout, mesh

    def _prepare(self, x: Any) -> Any:
        if not isinstance(x, Tensor):
            return x
        dt = x if isinstance(x, DTensor) else DTensor.from_local(x, self.mesh, (self.layout,), run_check=False)
        if self.layout != Replicate():
            dt = dt.redistribute(placements=(Replicate(),))
        return dt

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if args:
            return (self._prepare(args[0]), *args[1:]), kwargs
        if self.name in kwargs:
            return args, {**kwargs, self.name: self._prepare(kwargs[self.name])}
        raise ValueError(
            f"style 'colwise_input' on a {type(module).__name__}: it was called without its first input "
            f"{self.name!r} (neither positionally nor as {self.name}=...), so the column-parallel layers inside would "
            f"get activations no collective prepared."
        )


class _InputsToLocal:
    """Forward pre-hook: DTensor positional inputs as local tensors of ``placement`` (plain inputs untouched)."""

    def __init__(self, placement: Placement) -> None:
        self.placement = placement

    def __call__(self, module: nn.Module, inputs: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not any(isinstance(x, DTensor) for x in inputs):
            return None
        return tuple(_to_local(x, self.placement) for x in inputs)


class _ShardOutput:
    """Forward hook: this rank's shard of dim ``dim`` of a replicated output (a view)."""

    def __init__(self, dim: int, mesh: DeviceMesh) -> None:
        self.dim = dim
        self.mesh = mesh

    def __call__(self, module: nn.Module, inputs: Any, output: Any) -> Any:
        def cut(y: Any) -> Any:
            if not isinstance(y, Tensor):
                return y
            y = _to_local(y, Replicate())
            tp, dim = self.mesh.size(), self.dim % y.dim()
            check_sequence_divisible(y.shape[dim], tp)
            size = y.shape[dim] // tp
            return y.narrow(dim, self.mesh.get_local_rank() * size, size)

        return tuple(cut(y) for y in output) if isinstance(output, tuple) else cut(output)


def partial_grad_names(module: nn.Module) -> list[str]:
    """Names (relative to ``module``) of the parameters whose gradients are partial sums over the tp ranks, as the
    styles recorded them (:data:`PARTIAL_GRAD_ATTR`), in ``named_modules`` order."""
    names = []
    for prefix, sub in module.named_modules():
        for name in sorted(getattr(sub, PARTIAL_GRAD_ATTR, ())):
            if getattr(sub, name, None) is not None:
                names.append(f"{prefix}.{name}" if prefix else name)
    return names


@torch.no_grad()
def sync_partial_grads(grads: Iterable[Tensor | None], tp_group: dist.ProcessGroup) -> int:
    """Sum the given gradients over ``tp_group`` in place, in one all-reduce of their concatenation.

    Args:
        grads: gradients (plain or DTensor: their local tensors are summed; ``None`` entries are skipped), the same
            list in the same order on every rank of ``tp_group``.
        tp_group: the tensor-parallel process group.

    Returns:
        The number of elements summed (0 when there is nothing to do or ``tp_group`` has one rank).
    """
    tensors = [local_tensor(g) for g in grads if g is not None]
    if not tensors or dist.get_world_size(tp_group) == 1:
        return 0
    by_kind: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    total = 0
    for same in by_kind.values():  # one all-reduce per dtype (usually one)
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=tp_group)
        foreach_copy_(same, [c.view_as(t) for c, t in zip(flat.split([t.numel() for t in same]), same)])
        total += flat.numel()
    return total


def sync_tp_partial_grads(module: nn.Module, tp_group: dist.ProcessGroup, engine: Any = None) -> int:
    """:func:`sync_partial_grads` for every partial-gradient parameter of ``module`` (a tensor-parallel module).

    Call once per optimizer step, after backward and the data-parallel reduction, before clipping and the optimizer.

    Args:
        module: the module the tensor-parallel plan was applied to (parameter names are relative to it).
        tp_group: the tp process group.
        engine: a ZeRO-1/2 engine over ``module`` whose optimizer steps local shards (``engine.local_params`` by
            name): their gradients are summed instead of the module's.

    Returns:
        The number of elements summed.
    """
    names = partial_grad_names(module)
    if not names:
        return 0
    local = getattr(engine, "local_params", None) or {}
    grads = []
    for name in names:
        param = local[name] if name in local else module.get_parameter(name)
        grads.append(param.grad)
    return sync_partial_grads(grads, tp_group)


class VocabParallelEmbedding(ParallelStyle):
    """Token embedding split over the vocabulary: each rank holds ``padded_vocab / tp_size`` rows (``Shard(0)``).

    Megatron-LM's vocab-parallel embedding (Shoeybi et al. 2019, §3): each rank looks up the ids in its row range,
    writes zeros for the others, and the partial results are summed — an all-reduce, or under sequence parallelism a
    reduce-scatter that leaves each rank its sequence shard (Korthikanti et al. 2022, §4.2.2). Backward needs no
    collective for the weight, whose gradient stays a ``(padded_vocab / tp, n_embd)`` shard. (DTensor's own
    row-wise embedding computes a *full* replicated ``(vocab, n_embd)`` weight gradient on every rank, as torch has
    no row-sharded strategy for ``embedding_dense_backward``; hence this style.) The table is padded with zero rows
    to a multiple of ``tp_size``; the real size is kept in the module attribute
    :data:`~lightning_par.tensor_parallel.vocab.VOCAB_SIZE_ATTR`.

    Input: token ids ``(batch, seq)``, the same on every tp rank. Output: local ``(batch, seq, n_embd)``, or
    ``(batch, seq / tp_size, n_embd)`` with sequence parallelism.

    Args:
        sequence_parallel: reduce-scatter over the sequence (dim 1) instead of all-reducing.

    Raises:
        ValueError: (when applied) the module is not an ``nn.Embedding`` or uses ``max_norm``; (in forward, with
            sequence parallelism) ``seq`` is not a multiple of ``tp_size``.
    """

    def __init__(self, *, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding) or module.max_norm is not None:
            raise ValueError(
                f"style 'vocab_embedding' needs an nn.Embedding without max_norm, got {type(module).__name__}."
            )
        tp = device_mesh.size()
        vocab = getattr(module, VOCAB_SIZE_ATTR, module.num_embeddings)
        padded = padded_vocab_size(vocab, tp)
        if padded != module.num_embeddings:
            module.weight = pad_rows(module.weight, padded)
            module.num_embeddings = padded
            setattr(module, VOCAB_SIZE_ATTR, vocab)
        weight = distribute_tensor(module.weight.detach(), device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
        module.weight = nn.Parameter(weight, requires_grad=module.weight.requires_grad)
        out_layout = Shard(1) if self.sequence_parallel else Replicate()
        _wrap_embedding(module, device_mesh, out_layout)
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sequence_parallel={self.sequence_parallel})"


class _VocabParallelLookup(nn.Embedding):
    """The ``nn.Embedding.forward`` of a :class:`VocabParallelEmbedding`: placed under the module's own class in its
    method resolution order, so that a subclass's ``forward`` (Gemma's ``...ScaledWordEmbedding`` multiplies
    ``super().forward(ids)`` by ``embed_scale``) runs as written, with the vocab-parallel lookup inside."""

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002 - nn.Embedding's parameter name
        spec = self.__dict__["_lp_vocab_parallel"]
        if spec is None:  # the probe of _wrap_embedding: record the call, no collective
            self.__dict__["_lp_vocab_probe_calls"] += 1
            return torch.zeros(*input.shape, self.embedding_dim, dtype=self.weight.dtype)
        return _vocab_parallel_lookup(self, *spec, input)


def _wrap_embedding(module: nn.Embedding, mesh: DeviceMesh, out_layout: Placement) -> None:
    """Give ``module`` a class whose ``nn.Embedding.forward`` is the vocab-parallel lookup; the module's own
    ``forward`` (an ``nn.Embedding`` subclass's) keeps its arithmetic around it.

    A subclass whose ``forward`` does not reach ``nn.Embedding.forward`` (it reads ``self.weight`` itself) cannot run
    on a vocabulary shard: a probe call on one token, before any step, checks that the lookup runs exactly once.

    Raises:
        ValueError: the module's ``forward`` does not call ``nn.Embedding.forward`` exactly once (naming the class).
    """
    cls = type(module)
    if not issubclass(cls, _VocabParallelLookup):
        bases = (_VocabParallelLookup,) if cls is nn.Embedding else (cls, _VocabParallelLookup)
        module.__class__ = type(cls.__name__, bases, {"__qualname__": cls.__qualname__, "__module__": cls.__module__})
    if cls.forward is not nn.Embedding.forward:
        module.__dict__["_lp_vocab_parallel"] = None
        module.__dict__["_lp_vocab_probe_calls"] = 0
        error = None
        try:
            with torch.no_grad():
                module(torch.zeros(1, 1, dtype=torch.long, device=module.weight.device))
        except Exception as err:  # noqa: BLE001 - reported below, with the class named
            error = err
        calls = module.__dict__.pop("_lp_vocab_probe_calls")
        if error is not None or calls != 1:
            raise ValueError(
                f"style 'vocab_embedding' cannot split {cls.__qualname__} over the vocabulary: its forward "
                f"{'raised ' + repr(error) if error is not None else f'reached nn.Embedding.forward {calls} times'}"
                f", expected exactly one call to nn.Embedding.forward (super().forward(ids)) with the arithmetic "
                f"around it. Plan this embedding 'replicate' or use tp_size=1."
            ) from error
    module.__dict__["_lp_vocab_parallel"] = (mesh, out_layout)


def _vocab_parallel_lookup(module: nn.Embedding, mesh: DeviceMesh, out_layout: Placement, ids: Tensor) -> Tensor:
    """Forward of a :class:`VocabParallelEmbedding`: local masked lookup, then sum over the tp ranks."""
    if isinstance(ids, DTensor):
        ids = ids.full_tensor()
    if isinstance(out_layout, Shard):
        check_sequence_divisible(ids.shape[1], mesh.size())
    weight = module.weight.to_local()  # (padded_vocab / tp, n_embd); its gradient returns as a Shard(0) DTensor
    rows = weight.shape[0]
    first = mesh.get_local_rank() * rows
    outside = (ids < first) | (ids >= first + rows)
    local_ids = (ids - first).masked_fill(outside, 0)
    pad = module.padding_idx
    local_pad = pad - first if pad is not None and first <= pad < first + rows else None
    out = F.embedding(local_ids, weight, local_pad, None, 2.0, module.scale_grad_by_freq, module.sparse)
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # (batch, seq, n_embd), a partial sum over the tp ranks
    out = DTensor.from_local(out, mesh, [Partial()], run_check=False)
    return out.redistribute(placements=[out_layout]).to_local()


def transposed_linear_features(module: nn.Module) -> tuple[int, int] | None:
    """``(in_features, out_features)`` of a *transposed* linear layer, else ``None``: a module that is not an
    ``nn.Linear`` and computes ``x @ weight + bias`` with ``weight`` of shape ``(in, out)``, recognised by its ``nx``
    and ``nf`` attributes matching that shape (transformers' ``Conv1D`` of GPT-2)."""
    weight = getattr(module, "weight", None)
    if isinstance(module, nn.Linear) or not isinstance(weight, Tensor) or weight.dim() != 2:
        return None
    if getattr(module, "nx", None) == weight.shape[0] and getattr(module, "nf", None) == weight.shape[1]:
        return int(weight.shape[0]), int(weight.shape[1])
    return None


def _distribute_params(module: nn.Module, mesh: DeviceMesh, placements: dict[int, Placement], src: Any) -> None:
    """Each parameter of ``module`` (its own) as a DTensor with the placement of its number of dims."""
    for name, param in list(module.named_parameters(recurse=False)):
        dist_param = distribute_tensor(param.detach(), mesh, [placements[param.dim()]], src_data_rank=src)
        module.register_parameter(name, nn.Parameter(dist_param, requires_grad=param.requires_grad))


class Colwise(ColwiseParallel):
    """torch's ``ColwiseParallel``, also for a transposed linear layer (:func:`transposed_linear_features`: weight
    ``(in, out)`` split on dim 1, bias on dim 0). The layer's own ``forward`` runs on the DTensor parameters
    (``addmm`` of a replicated input and a column shard gives a column shard)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if transposed_linear_features(module) is None:
            return super()._apply(module, device_mesh)
        from torch.distributed.tensor import distribute_module

        return distribute_module(
            module, device_mesh,
            lambda name, mod, mesh: _distribute_params(mod, mesh, {2: Shard(1), 1: Shard(0)}, self.src_data_rank),
            *parallel_style_hooks(self),
        )


class Rowwise(RowwiseParallel):
    """torch's ``RowwiseParallel``, also for a transposed linear layer (weight ``(in, out)`` split on dim 0, bias
    replicated); see :class:`Colwise`."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if transposed_linear_features(module) is None:
            return super()._apply(module, device_mesh)
        from torch.distributed.tensor import distribute_module

        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh,
            lambda name, mod, mesh: _distribute_params(mod, mesh, {2: Shard(0), 1: Replicate()}, self.src_data_rank),
            *parallel_style_hooks(self),
        )


class VocabParallelHead(ColwiseParallel):
    """LM head split over the vocabulary; its logits stay a DTensor sharded on the last (vocabulary) dim.

    The weight ``(vocab, n_embd)`` is padded with zero rows to a multiple of ``tp_size`` and split by rows (output
    columns). Logits of padded entries are set to the dtype's most negative finite value, so a cross-entropy over the
    padded vocabulary equals the one over the real vocabulary, and the padded rows get a zero gradient. The input is
    replicated ``(batch, seq, n_embd)`` (backward all-reduces its gradient: Megatron's ``f``), or under sequence
    parallelism sequence-sharded ``(batch, seq / tp, n_embd)`` and all-gathered first.

    Output: a DTensor of global shape ``(batch, seq, padded_vocab)``, ``Shard(-1)``. Compute the loss under
    :func:`~lightning_par.tensor_parallel.vocab.vocab_parallel_loss`; ``.full_tensor()[..., :vocab]`` gives plain
    logits (generation, evaluation).

    Args:
        sequence_parallel: the input is sharded on the sequence dim (1).

    Raises:
        ValueError: (when applied) the module is not an ``nn.Linear``.
    """

    def __init__(self, *, sequence_parallel: bool = False) -> None:
        super().__init__(
            input_layouts=Shard(1) if sequence_parallel else Replicate(),
            output_layouts=Shard(-1),
            use_local_output=False,
        )
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise ValueError(f"style 'vocab_head' needs an nn.Linear, got {type(module).__name__}.")
        tp = device_mesh.size()
        vocab = getattr(module, VOCAB_SIZE_ATTR, module.out_features)
        padded = padded_vocab_size(vocab, tp)
        if padded != module.out_features:
            module.weight = pad_rows(module.weight, padded)
            if module.bias is not None:
                module.bias = pad_rows(module.bias, padded)
            module.out_features = padded
            setattr(module, VOCAB_SIZE_ATTR, vocab)
        super()._apply(module, device_mesh)
        if padded != vocab:
            module.register_forward_hook(_PaddingMask(vocab, device_mesh))
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sequence_parallel={self.sequence_parallel})"


class _PaddingMask:
    """Forward hook of a padded :class:`VocabParallelHead`: mask the padded logits on this rank's shard."""

    def __init__(self, vocab_size: int, mesh: DeviceMesh) -> None:
        self.vocab_size = vocab_size
        self.mesh = mesh

    def __call__(self, module: nn.Module, inputs: Any, output: DTensor) -> DTensor:
        local = output.to_local()  # (..., padded_vocab / tp)
        first = self.mesh.get_local_rank() * local.shape[-1]
        masked = mask_padded_logits(local, first, self.vocab_size)
        if masked is local:
            return output
        return DTensor.from_local(
            masked, self.mesh, output.placements, run_check=False, shape=output.shape, stride=output.stride()
        )


def mask_padded_vocab(logits: Any, vocab_size: int | None) -> Any:
    """Mask the padded vocabulary entries of vocab-sharded logits again (a no-op for anything else, or without padding).

    For arithmetic a model does on the logits after its :class:`VocabParallelHead` (Gemma2's final soft-capping
    ``tanh(logits / cap) * cap`` maps the masked value to ``-cap``, which a softmax does not ignore): call on the
    model's final logits, a ``(batch, seq, padded_vocab)`` DTensor sharded on the last dim.
    """
    if vocab_size is None or not isinstance(logits, DTensor) or logits.shape[-1] == vocab_size:
        return logits
    (placement,) = logits.placements
    if not (isinstance(placement, Shard) and placement.dim % logits.dim() == logits.dim() - 1):
        return logits
    return _PaddingMask(vocab_size, logits.device_mesh)(None, None, logits)
