"""Checks of the values users give options, in one place: each returns the value or raises
InvalidArgumentError naming the option, its range and what it got.

>>> whole(3, "max_batch", 1), number(0.5, "epsilon")
(3, 0.5)
>>> whole(True, "batch_size", 1)
Traceback (most recent call last):
pstrain.errors.InvalidArgumentError: batch_size must be a whole number of 1 or more, got True
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import InvalidArgumentError

__all__ = ["byte_size", "check_options", "number", "shape", "variable_name", "whole"]


def whole(value: Any, what: str, low: int | None = None, high: int | None = None) -> int:
    """``value`` if it is a whole number (a Python or numpy integer, not a bool) from ``low``
    (when given) up to ``high`` (when given)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or (low is not None and int(value) < low)
        or (high is not None and int(value) > high)
    ):
        bound = ("" if low is None else f" of {low} or more") if high is None else f" from {low} to {high}"
        raise InvalidArgumentError(f"{what} must be a whole number{bound}, got {value!r}")
    return int(value)


def number(value: Any, what: str, low: float | None = 0.0, *, above: bool = False, unit: str = "") -> float:
    """``value`` if it is a finite number (not a bool) of ``low`` or more, or above ``low``
    (``low`` None: any finite number); ``unit`` (" of seconds") goes into the message."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or (low is not None and (value < low or (above and value == low)))
    ):
        bound = "" if low is None else f" above {low:g}" if above else f" of {low:g} or more"
        raise InvalidArgumentError(f"{what} must be a finite number{unit}{bound}, got {value!r}")
    return float(value)


def one_of(value: Any, choices: Sequence[str], what: str, *, aliases: Mapping[str, str] | None = None) -> str:
    """``value`` (a string, any case) as it stands in ``choices``, or one of ``aliases``'
    names for one of them; else an error naming ``what`` and the choices."""
    key = value.lower() if isinstance(value, str) else None
    folded = {c.lower(): c for c in choices}
    for alias, meant in (aliases or {}).items():
        folded.setdefault(alias.lower(), meant)
    if key not in folded:
        names = list(choices) + list(aliases or {})
        raise InvalidArgumentError(f"{what} must be one of {names}, got {value!r}")
    return folded[key]


_UNITS = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 1 << 10,
    "mi": 1 << 20,
    "gi": 1 << 30,
    "ti": 1 << 40,
}


def byte_size(value: Any, what: str) -> int:
    """``value`` as a positive number of bytes: an integer, or a string with a unit
    (``"512MiB"``, ``"2GiB"``, ``"1.5G"``, ``"4096"``; ``B`` optional, any case).

    >>> byte_size("512MiB", "--memory-budget"), byte_size("1.5k", "x"), byte_size(4096, "x")
    (536870912, 1500, 4096)
    >>> byte_size("lots", "the budget")
    Traceback (most recent call last):
    pstrain.errors.InvalidArgumentError: the budget must be a size in bytes such as 512MiB, got 'lots'
    """
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?)?b?\s*", value.lower())
        if match is None:
            raise InvalidArgumentError(f"{what} must be a size in bytes such as 512MiB, got {value!r}")
        value = int(float(match.group(1)) * _UNITS[match.group(2) or ""])
    return whole(value, what, 1)


def shape(value: Any, what: str = "a variable's shape") -> tuple[int, ...]:
    """``value`` as a shape: a sequence (tuple, list, array) of whole numbers of 0 or more."""
    try:
        dims = None if isinstance(value, (str, bytes)) else tuple(value)
    except TypeError:
        dims = None
    if dims is None or any(isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 0 for d in dims):
        raise InvalidArgumentError(f"{what} must be a tuple of whole numbers of 0 or more, got {value!r}")
    return tuple(int(d) for d in dims)


def variable_name(name: Any) -> str | None:
    """``name`` if it can name a variable: a string, or None (the default name)."""
    if name is not None and not isinstance(name, str):
        raise InvalidArgumentError(f"a variable's name must be a string, got {name!r}")
    return name


def check_options(owner: str, counts: dict[str, int], seconds: dict[str, float | None]) -> None:
    """``owner``'s options: each of ``counts`` a whole number of 1 or more; each of
    ``seconds`` a finite duration, above 0 for a timeout or a period (``*timeout_s``,
    ``heartbeat_s``), else 0 or more; None is let through (for the options that take it)."""
    for name, count in counts.items():
        whole(count, f"{owner}: {name}", 1)
    for name, value in seconds.items():
        if value is not None:
            number(
                value,
                f"{owner}: {name}",
                above=name.endswith("timeout_s") or name == "heartbeat_s",
                unit=" of seconds",
            )
