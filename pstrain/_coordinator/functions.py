"""Closure functions as they travel: pickled once, named by their digest afterwards."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from .._base.errors import InvalidArgumentError
from .._formats.messages import pickling

__all__ = ["FunctionCache"]


class FunctionCache:
    """``fn -> (digest, pickled)``: a function is pickled on its first schedule; a worker
    is sent its bytes once and its digest afterwards."""

    def __init__(self) -> None:
        self._fns: dict[Any, tuple[bytes, bytes]] = {}

    def get(self, fn: Callable[..., Any]) -> tuple[bytes, bytes]:
        try:
            cached = self._fns.get(fn)
        except TypeError:  # unhashable callable
            cached = None
        if cached is None:
            try:
                pickled = pickling.dumps(fn)
            except Exception as exc:
                raise InvalidArgumentError(
                    f"cannot send {fn!r} to the workers: it does not pickle ({exc}); closures "
                    "may capture variables, arrays and plain values, not open files or locks"
                ) from exc
            cached = (hashlib.blake2b(pickled, digest_size=16).digest(), pickled)
            try:
                self._fns[fn] = cached
            except TypeError:
                pass
        return cached
