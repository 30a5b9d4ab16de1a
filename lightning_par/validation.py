"""Checks of plain option values, shared by the option groups: each raises a ``ValueError`` that names the field, the
value and what would be valid (the project's one message shape for bad input)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

__all__ = ["MAX_TIMEOUT_S", "check_bool", "check_choice", "check_int", "check_number"]

#: The longest timeout accepted, in seconds (about 31 years): torch takes a ``datetime.timedelta`` (1e15 s overflows
#: it) and C++ ``std::chrono`` durations in int64 nanoseconds (at most 9.2e9 s); 1e9 s stays within both.
MAX_TIMEOUT_S: float = 1e9


def check_int(name: str, value: Any, minimum: int, allow_infer: bool = False) -> int:
    """``value`` if it is an integer ``>= minimum`` (or ``-1`` with ``allow_infer``).

    Raises:
        ValueError: anything else (a bool counts as anything else).
    """
    valid = f"an integer >= {minimum}" + (" or -1 (infer from world_size)" if allow_infer else "")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r} is not valid: expected {valid}.")
    if value < minimum and not (allow_infer and value == -1):
        raise ValueError(f"{name}={value} is not valid: expected {valid}.")
    return value


def check_number(name: str, value: Any, *, minimum: float = 0.0, inclusive: bool = False, unit: str = "",
                 maximum: float = math.inf) -> float:
    """``float(value)`` if it is a real number above ``minimum`` (at or above with ``inclusive``) and at most
    ``maximum`` (NaN is never valid).

    Raises:
        ValueError: a bool, a non-number, NaN, or a number out of range.
    """
    bound = f"{'>=' if inclusive else '>'} {minimum:g}" + (f" and <= {maximum:g}" if maximum < math.inf else "")
    bound += f" ({unit})" if unit else ""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not (value >= minimum if inclusive else value > minimum) or not value <= maximum:
        raise ValueError(f"{name}={value!r} is not valid: expected a number {bound}.")
    return float(value)


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is ``True`` or ``False``.

    Raises:
        ValueError: anything else (``1``, ``"true"``, ``None``).
    """
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is not valid: expected True or False.")
    return value


def check_choice(name: str, value: Any, choices: Iterable[Any], hint: str = "") -> Any:
    """``value`` if it is one of ``choices``.

    Raises:
        ValueError: naming the choices (and ``hint``, a sentence on what to use instead).
    """
    choices = list(choices)
    if isinstance(value, bool) or value not in choices:
        raise ValueError(f"{name}={value!r} is not valid: expected one of {choices}." + (f" {hint}" if hint else ""))
    return value
