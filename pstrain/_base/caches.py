"""FifoCache: a dict bounded by its count and its bytes, the oldest entries going first.

Closure functions travel pickled once and are named by their digest afterwards: the
coordinator keeps each function's bytes, and each worker the functions it was sent. A
loop that schedules a new function every step (``lambda: step(batch)``, a
``functools.partial`` per step) would otherwise keep every one of them, on both sides,
with whatever each captured. The oldest go first rather than the least recently used: a
function dropped while still in use costs one more pickling or one more send, and
insertion order needs no bookkeeping on the hot path of a hit.

>>> cache = FifoCache(max_items=2, max_bytes=100)
>>> cache.put("a", 1, 10), cache.put("b", 2, 10), cache.put("c", 3, 10)
([], [], ['a'])
>>> "a" in cache.entries, cache.get("c"), len(cache), cache.bytes
(False, 3, 2, 20)
>>> cache.put("big", 4, 95)  # past max_bytes: the others go, the new entry stays
['b', 'c']
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["FifoCache"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class FifoCache(Generic[K, V]):
    """At most ``max_items`` entries and ``max_bytes`` of their declared sizes; past
    either, the oldest entries are dropped, except the one just put and those
    ``keep`` holds (a cache may then stay over its bounds until they are let go).

    ``entries`` is the dict itself, for the hot path's ``in`` and ``get``."""

    def __init__(self, max_items: int, max_bytes: int) -> None:
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.entries: dict[K, V] = {}
        self._sizes: dict[K, int] = {}
        self.bytes = 0

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: K) -> V | None:
        return self.entries.get(key)

    def put(self, key: K, value: V, size: int, keep: Callable[[K], bool] | None = None) -> list[K]:
        """Add ``key`` (the newest, even if it was there); returns the keys dropped."""
        self.discard(key)
        self.entries[key] = value
        self._sizes[key] = size
        self.bytes += size
        if len(self.entries) <= self.max_items and self.bytes <= self.max_bytes:
            return []
        dropped = []
        items, total = len(self.entries), self.bytes
        for old in self.entries:  # oldest first; only as far as the bounds need
            if items <= self.max_items and total <= self.max_bytes:
                break
            if old == key or (keep is not None and keep(old)):
                continue
            dropped.append(old)
            items -= 1
            total -= self._sizes[old]
        for old in dropped:
            self.discard(old)
        return dropped

    def touch(self, key: K) -> None:
        """``key``, if held, becomes the newest."""
        if key in self.entries:
            self.entries[key] = self.entries.pop(key)
            self._sizes[key] = self._sizes.pop(key)

    def discard(self, key: K) -> None:
        if key in self.entries:
            del self.entries[key]
            self.bytes -= self._sizes.pop(key)

    def clear(self) -> None:
        self.entries.clear()
        self._sizes.clear()
        self.bytes = 0
