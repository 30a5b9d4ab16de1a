"""Sharded, atomically committed checkpoints (``torch.distributed.checkpoint``) that every strategy writes and that
reshard across layouts, dp modes, strategies and one process."""

from lightning_par.checkpoint.sharded import (
    FORMAT_VERSION,
    METADATA_FILENAME,
    RECORD_FILENAME,
    consolidate_checkpoint,
    is_sharded_checkpoint,
    load_model_weights,
    load_sharded,
    read_record,
    save_sharded,
)

__all__ = [
    "FORMAT_VERSION",
    "METADATA_FILENAME",
    "RECORD_FILENAME",
    "consolidate_checkpoint",
    "is_sharded_checkpoint",
    "load_model_weights",
    "load_sharded",
    "read_record",
    "save_sharded",
]
