"""Sharded checkpoints (``torch.distributed.checkpoint``) that reshard across dp sizes, ZeRO stages and one process."""

from lightning_par.checkpoint.sharded import (
    METADATA_FILENAME,
    is_sharded_checkpoint,
    load_model_weights,
    load_sharded,
    save_sharded,
)

__all__ = ["METADATA_FILENAME", "is_sharded_checkpoint", "load_model_weights", "load_sharded", "save_sharded"]
