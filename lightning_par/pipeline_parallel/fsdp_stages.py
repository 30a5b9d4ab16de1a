"""FSDP2 (ZeRO-3) on pipeline stages: one FSDP root per stage chunk, one unit per block.

:class:`~lightning_par.data_parallel.fsdp.FSDPZero` shards a whole model whose ``forward`` (or LightningModule
step) runs: the root unit gathers the parameters outside the blocks in its pre-forward hook. A pipeline stage is run
through its *chunk* modules (views sharing the stage holder's sub-modules, see
:func:`~lightning_par.pipeline_parallel.split.cut_network`), not through the holder, so here each chunk is the FSDP2
root: its blocks become units (each gathered before its forward, with the next block prefetched, and
reduce-scattered after its backward) and the chunk itself owns the rest (embeddings on the first stage, final norm
and head on the last). Every micro-batch's backward reduce-scatters into the accumulated gradient shard, which sums
to the reduce-scatter of the step's gradient (FSDP2 with ``torch.distributed.pipelining`` does the same by default).
Afterwards :class:`~lightning_par.data_parallel.fsdp.FSDPZero` on the holder finds the units already in place and only
provides its state-dict methods.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_par.data_parallel.fsdp import find_shard_units
from lightning_par.data_parallel.zero_options import ZeroOptions

__all__ = ["fully_shard_chunks"]


def fully_shard_chunks(chunks: list[nn.Module], dp_mesh: DeviceMesh, options: ZeroOptions) -> None:
    """Apply FSDP2 to every pipeline chunk in place: its blocks as units, the chunk as the root.

    Args:
        chunks: this rank's stage chunks (disjoint parameters), e.g. ``PipelineRunner.chunks``.
        dp_mesh: the 1-D dp sub-mesh.
        options: ZeRO stage 3 options (``reshard_after_forward``, precision, offload).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kwargs = {
        "mesh": dp_mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=options.param_dtype, reduce_dtype=options.reduce_dtype),
        "offload_policy": CPUOffloadPolicy() if options.cpu_offload else OffloadPolicy(),
    }
    for chunk in chunks:
        units = find_shard_units(chunk)
        for unit in units:
            fully_shard(unit, reshard_after_forward=options.reshard_after_forward, **kwargs)
        for unit, nxt in zip(units, units[1:]):
            unit.set_modules_to_forward_prefetch([nxt])
        fully_shard(chunk, **kwargs)  # the root: the parameters outside the blocks
