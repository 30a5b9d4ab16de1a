"""Megatron-style tensor parallelism (Shoeybi et al. 2019, §3) with sequence parallelism (Korthikanti et al. 2022).

Built on DTensor (``torch.distributed.tensor.parallel``) so that FSDP2 and ``torch.distributed.checkpoint`` compose:
a declarative plan (module path -> style name, :mod:`~lightning_par.tensor_parallel.plan`) is applied to a module on
the tp sub-mesh by :func:`apply_tensor_parallel`. The styles torch lacks (replicated modules, vocab-parallel
embedding and LM head with padding) are in :mod:`~lightning_par.tensor_parallel.styles`; the vocab-parallel loss and
padding helpers in :mod:`~lightning_par.tensor_parallel.vocab`; unpadded views of padded tables for checkpoints in
:mod:`~lightning_par.tensor_parallel.state_dict`; communication accounting in
:mod:`~lightning_par.tensor_parallel.comm_volume`. Nothing here holds a global: the tp sub-mesh is passed in.
"""

from lightning_par.tensor_parallel.apply import (
    apply_tensor_parallel,
    broadcast_from_tp_rank0,
    reduce_partial_grads,
    reduce_partial_grads_eagerly,
)
from lightning_par.tensor_parallel.comm_volume import CommVolume, megatron_layer_comm_bytes
from lightning_par.tensor_parallel.plan import (
    STYLE_NAMES,
    Plan,
    check_plan_styles,
    expand_plan,
    resolve_style,
    uses_vocab_parallel_loss,
    validate_plan,
)
from lightning_par.tensor_parallel.state_dict import padded_parameters, unpad_vocab_state
from lightning_par.tensor_parallel.styles import (
    PlainSequenceParallel,
    ReplicateParallel,
    VocabParallelEmbedding,
    VocabParallelHead,
    sync_tp_partial_grads,
)
from lightning_par.tensor_parallel.vocab import (
    VOCAB_SIZE_ATTR,
    padded_vocab_size,
    strip_vocab_padding,
    vocab_parallel_loss,
)

__all__ = [
    "PlainSequenceParallel",
    "sync_tp_partial_grads",
    "STYLE_NAMES",
    "VOCAB_SIZE_ATTR",
    "CommVolume",
    "Plan",
    "ReplicateParallel",
    "VocabParallelEmbedding",
    "VocabParallelHead",
    "apply_tensor_parallel",
    "broadcast_from_tp_rank0",
    "check_plan_styles",
    "expand_plan",
    "megatron_layer_comm_bytes",
    "padded_parameters",
    "padded_vocab_size",
    "reduce_partial_grads",
    "reduce_partial_grads_eagerly",
    "resolve_style",
    "strip_vocab_padding",
    "unpad_vocab_state",
    "uses_vocab_parallel_loss",
    "validate_plan",
    "vocab_parallel_loss",
]
