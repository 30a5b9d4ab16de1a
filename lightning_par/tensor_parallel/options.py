"""Validated options of the tp axis."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_par.tensor_parallel.plan import check_plan_styles
from lightning_par.validation import check_bool

__all__ = ["TensorParallelOptions"]


@dataclass(frozen=True)
class TensorParallelOptions:
    """Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, §3) on the tp axis.

    Attributes:
        sequence_parallel: also shard norms, dropouts and the activations between sub-blocks over the sequence dim
            (Korthikanti et al. 2022, §4.2.2).
        plan: module path *relative to the network* (``*`` matches any child) -> style name or ``ParallelStyle``
            (see :mod:`lightning_par.tensor_parallel.plan`); ``None`` takes the model's own plan
            (:func:`lightning_par.contract.tp_plan`).

    Raises:
        ValueError: ``sequence_parallel`` not a bool, or a plan entry with an unknown style (named in the message).
    """

    sequence_parallel: bool = False
    # ``Mapping[str, str | ParallelStyle] | None``, typed Any: this class is also the Hydra schema of
    # ``strategy.tensor_parallel``, where a command-line dict (``plan={up:colwise}``) must pass; checked below.
    plan: Any = field(default=None, hash=False)

    def __post_init__(self) -> None:
        check_bool("sequence_parallel", self.sequence_parallel)
        if self.plan is not None:
            object.__setattr__(self, "plan", check_plan_styles(self.plan))
