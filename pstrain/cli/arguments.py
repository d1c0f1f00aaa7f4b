"""Argument types of the ``pstrain`` subcommands: a value out of range is argparse's one-line
error naming the flag (exit status 2), before anything starts.

>>> positive_int("3"), index_number("0"), seconds("2.5"), port_number("8888")
(3, 0, 2.5, 8888)
>>> positive_int("0")
Traceback (most recent call last):
argparse.ArgumentTypeError: it must be a whole number of 1 or more, got 0
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from .._base.checks import byte_size, number, whole
from .._base.cluster import parse_address
from .._base.errors import InvalidArgumentError
from .memory import keep_freed_size
from .threads import cpu_list

__all__ = [
    "LOG_LEVELS",
    "address",
    "bytes_flag",
    "cpus_flag",
    "directory",
    "index_number",
    "keep_freed_flag",
    "level_name",
    "log_level",
    "port_number",
    "positive_int",
    "seconds",
]

#: What ``--log-level`` takes (in any case).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _flag_value(convert: Callable[[str], Any], check: Callable[[Any], Any]) -> Callable[[str], Any]:
    """An argparse type: ``check(convert(text))``, whose refusal is argparse's error."""

    def parse(text: str) -> Any:
        try:
            return check(convert(text))
        except ValueError as exc:  # not a number (from convert), or out of range (from check)
            raise argparse.ArgumentTypeError(
                str(exc) if isinstance(exc, InvalidArgumentError) else f"{text!r} is not a number"
            ) from None

    return parse


positive_int = _flag_value(int, lambda v: whole(v, "it", 1))
index_number = _flag_value(int, lambda v: whole(v, "it", 0))
port_number = _flag_value(int, lambda v: whole(v, "a port", 0, 65535))
seconds = _flag_value(float, lambda v: number(v, "a duration", unit=" of seconds"))
#: A size in bytes, with a unit or not (``512MiB``, ``2GiB``, ``1000000``).
bytes_flag = _flag_value(str, lambda text: byte_size(text, "it"))
#: ``--keep-freed``: a size, or 0.
keep_freed_flag = _flag_value(str, keep_freed_size)


def cpus_flag(text: str) -> str:
    """A list of cores this process may run on (``0-3,6``), as given; argparse's error
    naming the flag otherwise."""
    try:
        cpu_list(text)
    except InvalidArgumentError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def level_name(value: Any) -> str:
    """A logging level's name (in any case) in upper case, or InvalidArgumentError."""
    if not isinstance(value, str) or value.upper() not in LOG_LEVELS:
        raise InvalidArgumentError(f"{value!r} is not a log level ({', '.join(LOG_LEVELS)})")
    return value.upper()


#: ``host:port``, as a task's address in a cluster.
address = _flag_value(str, lambda text: parse_address(text) and text)
#: A logging level's name, in any case (``--log-level``).
log_level = _flag_value(str, level_name)


def directory_path(text: str) -> str:
    """``text`` if it is a directory, or a path one can be made at (its nearest existing
    parent is a directory); nothing is made here."""
    path = os.path.abspath(text)
    if os.path.exists(path) and not os.path.isdir(path):
        raise InvalidArgumentError(f"{text!r} is not a directory")
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise InvalidArgumentError(f"{text!r} cannot be a directory: {parent} is a file")
    return text


#: A directory, existing or to be made (``--checkpoint-root``).
directory = _flag_value(str, directory_path)
