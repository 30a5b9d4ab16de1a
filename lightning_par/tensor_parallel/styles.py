"""The DTensor parallel styles torch does not ship: replicated modules, vocab-parallel embedding and LM head.

Column- and row-parallel layers, sequence-parallel norms and the one-collective input of a group of column-parallel
layers are torch's own styles (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``,
``PrepareModuleInput``); :mod:`lightning_par.tensor_parallel.plan` maps the plan's style names onto them. This file
adds what they lack:

* :class:`ReplicateParallel`: parameters become ``Replicate`` DTensors while the module runs on replicated
  activations, so that *every* parameter is a DTensor on the tp mesh (mixing plain tensors and DTensors breaks
  ``clip_grad_norm_`` and the foreach optimizers). With ``output_shard_dim`` the replicated output is then cut to this
  rank's sequence shard (a learned position table under sequence parallelism; its gradient is all-gathered back).
* :class:`VocabParallelEmbedding` / :class:`VocabParallelHead`: the token embedding and LM head split over the
  vocabulary (Megatron-LM, Shoeybi et al. 2019, §3), padded to a multiple of ``tp_size`` as Megatron does, with the
  padded logits masked so they never change the loss (see :mod:`lightning_par.tensor_parallel.vocab`). The
  embedding runs Megatron's masked local lookup itself: torch's ``RowwiseParallel`` on an ``nn.Embedding`` gives
  every rank a full, replicated ``(vocab, n_embd)`` weight gradient (DTensor has no row-sharded strategy for
  ``embedding_dense_backward``). Its collectives are still DTensor redistributions; no hand-written autograd
  communication op is needed anywhere (the Megatron ``f``/``g`` operators are the ``colwise_input`` style).

Every style here returns local (plain) tensors, except the LM head, whose logits stay a DTensor sharded on the
vocabulary so that the loss can run vocab-parallel.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle
from torch.distributed.tensor.placement_types import Placement

from lightning_par.tensor_parallel.vocab import VOCAB_SIZE_ATTR, mask_padded_logits, pad_rows, padded_vocab_size

__all__ = ["ReplicateParallel", "VocabParallelEmbedding", "VocabParallelHead", "check_sequence_divisible"]


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


class ReplicateParallel(ParallelStyle):
    """Run a module on replicated activations with its parameters held as ``Replicate`` DTensors.

    Each tp rank computes the same output and the same full gradient, so no collective runs, forward or backward,
    unless ``output_shard_dim`` is set.

    Args:
        output_shard_dim: if not None, cut the (replicated) output to this rank's shard of that dim (negative counts
            from the end) before returning it: no communication forward; the gradient is all-gathered in backward.
            A position table ``(seq, n_embd)`` under sequence parallelism uses ``-2``.
    """

    def __init__(self, *, output_shard_dim: int | None = None) -> None:
        super().__init__()
        self.output_shard_dim = output_shard_dim

    @staticmethod
    def _replicate_params(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        # Replicas are identical across the tp ranks (apply_tensor_parallel broadcasts first), so wrap locally.
        for pname, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                dparam = DTensor.from_local(param.detach(), mesh, [Replicate()], run_check=False)
                module.register_parameter(pname, nn.Parameter(dparam, requires_grad=param.requires_grad))

    @staticmethod
    def _prepare_input(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        out = []
        for x in inputs:
            if isinstance(x, DTensor):
                x = x if x.placements == (Replicate(),) else x.redistribute(placements=[Replicate()])
            elif isinstance(x, Tensor):
                x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            out.append(x)
        return tuple(out)

    def _prepare_output(self, module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
        def convert(y: Any) -> Any:
            if not isinstance(y, DTensor):
                return y
            if self.output_shard_dim is not None:
                y = y.redistribute(placements=[Shard(self.output_shard_dim % y.dim())])
            return y.to_local()

        return tuple(convert(y) for y in output) if isinstance(output, tuple) else convert(output)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._replicate_params, self._prepare_input, self._prepare_output)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(output_shard_dim={self.output_shard_dim})"


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
        module.forward = partial(_vocab_parallel_lookup, module, device_mesh, out_layout)  # type: ignore[method-assign]
        return module

    def __repr__(self) -> str:
        return f"{type(self).__name__}(sequence_parallel={self.sequence_parallel})"


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
