"""Argument types of the ``pstrain`` subcommands: a value out of range is argparse's one-line
error naming the flag (exit status 2), before anything starts.

>>> positive_int("3"), index_number("0"), seconds("2.5"), port_number("8888")
(3, 0, 2.5, 8888)
>>> positive_int("0")
Traceback (most recent call last):
argparse.ArgumentTypeError: '0' is not a whole number of 1 or more
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

from .._base.cluster import parse_address
from .._base.errors import InvalidArgumentError, PstrainError

__all__ = ["LOG_LEVELS", "address", "index_number", "level_name", "log_level", "port_number",
           "positive_int", "seconds"]

#: What ``--log-level`` takes (in any case).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _whole(low: int, what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value
    return parse


positive_int = _whole(1, "a whole number of 1 or more")
index_number = _whole(0, "a whole number of 0 or more")


def port_number(text: str) -> int:
    """A TCP port, 0 to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port: ports are 0 to 65535")
    return port


def seconds(text: str) -> float:
    """A duration: a finite number of seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (0 or more)")
    return value


def address(text: str) -> str:
    """``host:port``, as a task's address in a cluster."""
    try:
        parse_address(text)
    except PstrainError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def level_name(value: Any) -> str:
    """A logging level's name (in any case) in upper case, or InvalidArgumentError."""
    if not isinstance(value, str) or value.upper() not in LOG_LEVELS:
        raise InvalidArgumentError(f"{value!r} is not a log level ({', '.join(LOG_LEVELS)})")
    return value.upper()


def log_level(text: str) -> str:
    """A logging level's name, in any case (``--log-level``)."""
    try:
        return level_name(text)
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
