"""A set of distinct int64 ids in the id index's compiled hash table, which grows as ids
are added: what a restore asks of a chain of deltas (which ids a later delta touched) and
of a base (which of its ids the deltas replaced), in one pass an id where sorted arrays
cost a sort of every id seen so far for each delta.

>>> import numpy as np
>>> s = IdSet()
>>> s.add(np.array([5, -1, 9]))
>>> s.has(np.array([9, 4, -1])), len(s)
(array([ True, False,  True]), 3)
"""

from __future__ import annotations

import numpy as np

from . import KERNELS

__all__ = ["IdSet"]

#: Ids looked up at a time: a base's ids are tens of millions, and the slots each lookup
#: returns are a temporary array as large as the ids it is given.
LOOKUP_BLOCK = 1 << 20


class IdSet:
    """Distinct int64 ids (any value, -1 included), at most half of its slots taken: 32
    to 64 bytes an id. :meth:`add` takes ids that are distinct and not in the set yet (the
    caller knows; the index's kernels do not check)."""

    def __init__(self, expect: int = 0) -> None:
        self._size = _slots_for(expect)
        self._slots = np.full((self._size, 2), -1, np.int64)
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        return self._slots.nbytes

    def has(self, ids: np.ndarray) -> np.ndarray:
        """Whether each of ``ids`` is in the set."""
        ids = np.ascontiguousarray(ids, np.int64)
        found = np.zeros(ids.size, bool)
        if not self._count:
            return found
        out = np.empty(min(ids.size, LOOKUP_BLOCK), np.int64)
        for lo in range(0, ids.size, LOOKUP_BLOCK):
            block = ids[lo : lo + LOOKUP_BLOCK]
            KERNELS.index_get(self._slots, self._size, block, out[: block.size])
            np.greater_equal(out[: block.size], 0, out=found[lo : lo + block.size])
        return found

    def add(self, ids: np.ndarray) -> None:
        """Put ``ids`` (distinct, none of them in the set) in, growing it first if they
        would take more than half of its slots."""
        ids = np.ascontiguousarray(ids, np.int64)
        if not ids.size:
            return
        if 2 * (self._count + ids.size) > self._size:
            self._grow(self._count + ids.size)
        KERNELS.index_insert(self._slots, self._size, ids, np.zeros(ids.size, np.int64))
        self._count += ids.size

    def ids(self) -> np.ndarray:
        """The ids in the set, in no order."""
        return self._slots[self._slots[:, 1] >= 0, 0]

    def _grow(self, count: int) -> None:
        held = self.ids()
        self._size = _slots_for(count)
        self._slots = np.full((self._size, 2), -1, np.int64)
        KERNELS.index_insert(self._slots, self._size, held, np.zeros(held.size, np.int64))


def _slots_for(count: int) -> int:
    """A power of two at least twice ``count`` (and at least 16)."""
    return 1 << max(4, int(2 * count).bit_length())
