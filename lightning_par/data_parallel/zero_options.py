"""Kept import path: the ZeRO options now live in :mod:`lightning_par.data_parallel.options` beside the reducer's."""

from lightning_par.data_parallel.options import (
    DTYPE_NAMES,
    ZERO_STAGES,
    ZeroOptions,
    parse_mixed_precision,
    resolve_zero_options,
)

__all__ = ["DTYPE_NAMES", "ZERO_STAGES", "ZeroOptions", "parse_mixed_precision", "resolve_zero_options"]
