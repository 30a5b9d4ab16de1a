"""Validated options of the cp axis."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_par.validation import check_choice

__all__ = ["CP_METHODS", "ContextParallelOptions"]

#: ``ring``: K/V blocks passed around the cp ring, partial attention merged by log-sum-exp (Liu et al. 2023);
#: ``all_to_all``: heads scattered and the sequence gathered around attention (DeepSpeed-Ulysses, Jacobs et al. 2023).
CP_METHODS: tuple[str, ...] = ("ring", "all_to_all")


@dataclass(frozen=True)
class ContextParallelOptions:
    """Context parallelism on the cp axis (``strategy.context_parallel``).

    Attributes:
        method: one of :data:`CP_METHODS`.

    Raises:
        ValueError: an unknown method, named with the valid ones.
    """

    method: str = "ring"

    def __post_init__(self) -> None:
        check_choice("method", self.method, CP_METHODS)
