"""Closure functions as they travel: pickled once, named by their digest afterwards.

The coordinator keeps the pickled bytes of the last ``FUNCTIONS_KEPT`` functions (and at
most ``FUNCTION_BYTES_KEPT`` of them), each worker's dispatcher the digests it sent that
worker, and the worker the functions themselves, twice as many: a loop that schedules a
new function every step (``lambda: step(batch)``) holds a bounded set, not every one of
them with what it captured. A function dropped and scheduled again is pickled again; a
digest dropped is sent again with its bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from .._base.caches import FifoCache
from .._base.errors import InvalidArgumentError
from .._formats.messages import pickling
from .._formats.messages.closures import FUNCTION_BYTES_KEPT, FUNCTIONS_KEPT

__all__ = ["FunctionCache"]


class FunctionCache:
    """``fn -> (digest, pickled)``: a function is pickled on its first schedule; a worker
    is sent its bytes once and its digest afterwards."""

    def __init__(self, max_items: int = FUNCTIONS_KEPT, max_bytes: int = FUNCTION_BYTES_KEPT) -> None:
        self._fns: FifoCache[Any, tuple[bytes, bytes]] = FifoCache(max_items, max_bytes)

    def get(self, fn: Callable[..., Any]) -> tuple[bytes, bytes]:
        try:
            cached = self._fns.entries.get(fn)
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
                self._fns.put(fn, cached, len(pickled))
            except TypeError:
                pass
        return cached
