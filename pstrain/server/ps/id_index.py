"""A hash index from int64 ids to row numbers, vectorised with numpy.

Open addressing with linear probing over a power-of-two array of slots, each
``empty``, ``full`` or a tombstone (a deleted id; probes go past it). Every
operation takes a whole batch of ids and probes them together: one numpy pass
per probe step over the ids still looking, so a batch costs a few array passes,
not a Python loop per id. Ids cover the whole 64-bit space (the slot states
are kept apart from the keys, so no id value is reserved). The table grows
(doubling) past half full and is rebuilt when tombstones pile up.

>>> index = IdIndex()
>>> index.insert(np.array([5, -1, 2**62]), np.array([0, 1, 2]))
>>> index.get(np.array([2**62, 7, 5])).tolist()
[2, -1, 0]
>>> index.delete(np.array([5])).tolist(), len(index)
([0], 2)
>>> index.get(np.array([5, -1])).tolist()
[-1, 1]
"""

from __future__ import annotations

import numpy as np

from ..._formats.idhash import mix64

__all__ = ["IdIndex"]

_EMPTY, _FULL, _TOMB = 0, 1, 2
_LOAD = 2  # slots per id at least: at most half full, tombstones counted
_SCALAR = 48  # ids left probing below which a Python loop beats another numpy pass


class IdIndex:
    """int64 id -> int64 row; see the module docstring."""

    def __init__(self, capacity: int = 1024) -> None:
        size = 1 << max(4, int(capacity * _LOAD - 1).bit_length())
        self._alloc(size)
        self.count = 0
        self.tombs = 0

    def _alloc(self, size: int) -> None:
        self.mask = np.uint64(size - 1)
        self.keys = np.zeros(size, np.int64)
        self.vals = np.zeros(size, np.int64)
        self.state = np.zeros(size, np.uint8)

    def __len__(self) -> int:
        return self.count

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.vals.nbytes + self.state.nbytes

    def _home(self, ids: np.ndarray) -> np.ndarray:
        return mix64(ids.view(np.uint64)) & self.mask

    def _find(self, ids: np.ndarray) -> np.ndarray:
        """The slot holding each id, -1 where none does."""
        slots = np.full(ids.size, -1, np.int64)
        pos = self._home(ids)
        todo = np.arange(ids.size)
        keys, state, mask = self.keys, self.state, self.mask
        while todo.size > _SCALAR:
            p = pos[todo]
            st = state[p]
            hit = (st == _FULL) & (keys[p] == ids[todo])
            slots[todo[hit]] = p[hit]
            going = ~hit & (st != _EMPTY)  # past other ids and tombstones
            todo = todo[going]
            pos[todo] = (p[going] + np.uint64(1)) & mask
        if todo.size:  # the long probes' tail: a few ids, cheaper one at a time
            m = int(mask)
            for i in todo.tolist():
                key, q = int(ids[i]), int(pos[i])
                while True:
                    st_q = state[q]
                    if st_q == _FULL and keys[q] == key:
                        slots[i] = q
                        break
                    if st_q == _EMPTY:
                        break
                    q = (q + 1) & m
        return slots

    def get(self, ids: np.ndarray) -> np.ndarray:
        """The row of each id (int64 array), -1 where it has none."""
        ids = np.ascontiguousarray(ids, np.int64)
        slots = self._find(ids)
        out = np.full(ids.size, -1, np.int64)
        found = slots >= 0
        out[found] = self.vals[slots[found]]
        return out

    def insert(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Add ``ids`` (unique, none present yet) with their rows."""
        ids = np.ascontiguousarray(ids, np.int64)
        rows = np.ascontiguousarray(rows, np.int64)
        if not ids.size:
            return
        if (self.count + self.tombs + ids.size) * _LOAD > self.keys.size:
            self._rebuild(self.count + ids.size)
        pos = self._home(ids)
        todo = np.arange(ids.size)
        keys, vals, state, mask = self.keys, self.vals, self.state, self.mask
        while todo.size > _SCALAR:
            p = pos[todo]
            cand = np.flatnonzero(state[p] != _FULL)
            # Of the ids that reach the same free slot now, one takes it: each writes its
            # position into the free slot's (unused) value, and the one that reads it back won.
            pc = p[cand]
            vals[pc] = cand
            won = np.zeros(todo.size, bool)
            won[cand[vals[pc] == cand]] = True
            w = p[won]
            self.tombs -= int(np.count_nonzero(state[w] == _TOMB))
            keys[w] = ids[todo[won]]
            vals[w] = rows[todo[won]]
            state[w] = _FULL
            todo = todo[~won]
            pos[todo] = (p[~won] + np.uint64(1)) & mask
        m = int(mask)
        for i in todo.tolist():  # the long probes' tail, one at a time
            q = int(pos[i])
            while state[q] == _FULL:
                q = (q + 1) & m
            if state[q] == _TOMB:
                self.tombs -= 1
            keys[q], vals[q], state[q] = ids[i], rows[i], _FULL
        self.count += ids.size

    def delete(self, ids: np.ndarray) -> np.ndarray:
        """Remove ``ids`` (those present); returns the rows they had (-1 for absent ids)."""
        ids = np.ascontiguousarray(ids, np.int64)
        slots = self._find(ids)
        out = np.full(ids.size, -1, np.int64)
        found = slots >= 0
        s = slots[found]
        out[found] = self.vals[s]
        self.state[s] = _TOMB
        self.count -= s.size
        self.tombs += s.size
        return out

    def _rebuild(self, need: int) -> None:
        live = self.state == _FULL
        keys, vals = self.keys[live], self.vals[live]
        size = self.keys.size
        while need * _LOAD > size:
            size *= 2
        self._alloc(size)
        self.count = 0
        self.tombs = 0
        self.insert(keys, vals)

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """Every (id, row), in slot order."""
        live = self.state == _FULL
        return self.keys[live], self.vals[live]
