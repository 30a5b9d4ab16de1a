"""Sharded, atomically committed checkpoints (``torch.distributed.checkpoint``) that every strategy writes and that
reshard across layouts, dp modes, strategies and one process."""

from lightning_par.checkpoint.loading import (
    ShardedCheckpointLoading,
    load_from_checkpoint,
    install_directory_loading,
    read_full_checkpoint,
)
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
    verify_checkpoint,
)
from lightning_par.checkpoint.verify import DamagedCheckpointError

__all__ = [
    "DamagedCheckpointError",
    "FORMAT_VERSION",
    "METADATA_FILENAME",
    "RECORD_FILENAME",
    "ShardedCheckpointLoading",
    "consolidate_checkpoint",
    "is_sharded_checkpoint",
    "load_from_checkpoint",
    "load_model_weights",
    "install_directory_loading",
    "load_sharded",
    "read_full_checkpoint",
    "read_record",
    "save_sharded",
    "verify_checkpoint",
]
