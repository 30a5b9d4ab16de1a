"""Context parallelism: each sequence split over the ``cp`` ranks (causal load balancing), with ring or
all-to-all (Ulysses) attention in :mod:`~lightning_par.context_parallel.attention`; the batch split in
:mod:`~lightning_par.context_parallel.batch`; the registry entry in :mod:`~lightning_par.context_parallel.axis`."""

from lightning_par.context_parallel.attention import (
    CP_ATTENTION_METHODS,
    CPAttentionMode,
    check_ulysses_heads,
    gather_sequence,
    load_balanced_positions,
    ring_attention,
    split_sequence,
    ulysses_attention,
)

__all__ = [
    "CP_ATTENTION_METHODS",
    "CPAttentionMode",
    "check_ulysses_heads",
    "gather_sequence",
    "load_balanced_positions",
    "ring_attention",
    "split_sequence",
    "ulysses_attention",
]
