"""A hash index from int64 ids to row numbers, each batch probed in one compiled loop.

Open addressing with linear probing over an array of slots, each an (id, row) pair side
by side, so a probe reads one cache line: a row of -1 marks an empty slot. An id's first
slot is the high half of its hash times the number of slots, so that number need not be a
power of two. A deletion leaves no tombstone: the ids after it in its probe run move
back where their own probe passes the hole, so a table that evicts as much as it
admits keeps its probes short and is never rebuilt for it. Every operation takes a
whole batch of ids; the probing runs in :mod:`pstrain._kernels` (compiled, or the
numpy reference with ``PSTRAIN_KERNELS=numpy``). Ids cover the whole 64-bit space
(a slot's state is in its row, so no id value is reserved); rows are at least 0. The
table grows when ids fill half its slots (``fill``, by default), to a size that they fill at
most a quarter of (half ``fill``); with a ``growth`` below 2, to ``growth`` times the slots
they need at ``fill`` (an index that is most of what a row costs: the rows on disk's).

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

import math
from types import ModuleType

import numpy as np

from . import KERNELS

__all__ = ["CompactIdIndex", "IdIndex", "PartitionedIndex"]

_EMPTY = -1
#: A compact index's value where a slot holds no id.
_EMPTY32 = 0xFFFFFFFF
#: Slots whose ids a growth puts back at a time.
MOVE_SLOTS = 1 << 16
#: Ids a partitioned index's insert splits among its parts at a time.
SPLIT_BLOCK = 1 << 20
_LOAD = 2  # slots per id at least: at most half full (an index's default ``fill``)


class _Index:
    """int64 id -> int64 row; see the module docstring. ``kernels``: which implementation
    probes (:func:`pstrain._kernels.kernels`; default the process's). ``fill``: the share of
    its slots ids may fill before it grows (at most 7/8: a probe for an absent id crosses
    about ``(1 + 1 / (1 - fill) ** 2) / 2`` slots, 2.5 at a half, 8.5 at three quarters).
    ``growth``: 2, the slots double (a power of two) as ids come; below it, an index grows
    to that many times the slots its ids need, and one sized for a bulk load
    (:meth:`reserve`) has just the slots they need."""

    #: Bytes a slot takes.
    SLOT_BYTES = 16

    def __init__(
        self,
        capacity: int = 1024,
        kernels: ModuleType | None = None,
        fill: float = 1 / _LOAD,
        growth: float = 2.0,
    ) -> None:
        if not 0 < fill <= 0.875:
            raise ValueError(f"IdIndex: fill must be in (0, 0.875], got {fill}")
        if not 1 < growth <= 2:
            raise ValueError(f"IdIndex: growth must be in (1, 2], got {growth}")
        self.kernels = kernels or KERNELS
        self.fill = fill
        self.growth = growth
        size = 1 << max(4, int(capacity / fill - 1).bit_length())
        self._alloc(size)
        self.count = 0
        #: Ids ever inserted and removed: a row found earlier is still the id's while
        #: ``removed`` has not moved (and an id without one may have one once ``inserted`` has).
        self.inserted = self.removed = 0

    def _alloc(self, size: int) -> None:
        self.size = size
        self.slots = np.full((size, 2), _EMPTY, np.int64)  # (id, row) per slot; an id is
        # only read in a slot whose row says it holds one

    def __len__(self) -> int:
        return self.count

    @property
    def nbytes(self) -> int:
        return self.slots.nbytes

    def get(self, ids: np.ndarray) -> np.ndarray:
        """The row of each id (int64 array), -1 where it has none."""
        ids = np.ascontiguousarray(ids, np.int64)
        out = np.empty(ids.size, np.int64)
        self._probe(ids, out)
        return out

    def _probe(self, ids: np.ndarray, out: np.ndarray) -> None:
        """The compiled passes of :meth:`get`, :meth:`insert` and :meth:`delete` over this
        index's slots (a compact index's are two arrays)."""
        self.kernels.index_get(self.slots, self.size, ids, out)

    def _put(self, ids: np.ndarray, rows: np.ndarray) -> None:
        self.kernels.index_insert(self.slots, self.size, ids, rows)  # refuses a row below 0 first

    def _remove(self, ids: np.ndarray, out: np.ndarray) -> int:
        return int(self.kernels.index_delete(self.slots, self.size, ids, out))

    def insert(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Add ``ids`` (unique, none present yet) with their rows (each at least 0)."""
        ids = np.ascontiguousarray(ids, np.int64)
        rows = np.ascontiguousarray(rows, np.int64)
        if not ids.size:
            return
        if ids.shape != rows.shape:
            raise ValueError(f"IdIndex.insert: {ids.size} ids but {rows.size} rows")
        if self._over(self.count + ids.size, self.size):
            self._rebuild(self.count + ids.size)
        self._put(ids, rows)
        self.count += ids.size
        self.inserted += ids.size

    def delete(self, ids: np.ndarray) -> np.ndarray:
        """Remove ``ids`` (unique; those present); returns the rows they had (-1 for absent ids)."""
        ids = np.ascontiguousarray(ids, np.int64)
        out = np.empty(ids.size, np.int64)
        removed = self._remove(ids, out)
        self.count -= removed
        self.removed += removed
        return out

    def clear(self) -> None:
        """Remove every id, keeping the slots' memory."""
        self.slots[:, 1] = _EMPTY
        self.removed += self.count
        self.count = 0

    @classmethod
    def nbytes_new(cls, capacity: int, fill: float = 1 / _LOAD) -> int:
        """:attr:`nbytes` of ``IdIndex(capacity, fill=fill)``."""
        return (1 << max(4, int(capacity / fill - 1).bit_length())) * cls.SLOT_BYTES

    def nbytes_holding(self, count: int, tight: bool = False) -> int:
        """:attr:`nbytes` once ``count`` ids are in (grown as :meth:`insert` grows it, or
        with ``tight`` as :meth:`reserve` does)."""
        return (self._tight(count) if tight else self._grown(count)) * self.SLOT_BYTES

    def grow_for(self, count: int) -> None:
        """Grow as :meth:`insert` would to hold ``count`` ids (nothing if it holds them)."""
        if self._over(count, self.size):
            self._rebuild(count)

    def reserve(self, count: int) -> None:
        """Room for ``count`` ids, as full as the index may be (``fill``) rather than the
        half of that a growth leaves: what a bulk load (a restore) takes in at once costs the
        least memory, and no more than an index that grew to hold as many."""
        if self._over(count, self.size):
            self._move_to(self._tight(count))

    @property
    def holds(self) -> int:
        """How many ids the index holds without growing."""
        return math.floor(self.size * self.fill)

    def _over(self, count: int, size: int) -> bool:
        """Whether ``count`` ids fill more of ``size`` slots than ``fill``."""
        return count > size * self.fill

    def _tight(self, need: int) -> int:
        size = self.size
        if self.growth < 2:
            return size if not self._over(need, size) else self._fitting(need)
        while self._over(need, size):
            size *= 2
        return size

    def _fitting(self, need: int) -> int:
        """The fewest slots ``need`` ids fill at most ``fill`` of."""
        size = max(16, math.ceil(need / self.fill))
        while self._over(need, size):  # (rounding)
            size += 1
        return size

    def _grown(self, need: int) -> int:
        """The slots for ``need`` ids: as now while they fill at most ``fill`` of them, else
        a size they fill at most half that of (``growth`` below 2: ``fill / growth``)."""
        size = self.size
        if not self._over(need, size):
            return size
        if self.growth < 2:
            return max(size + 1, self._fitting(math.ceil(need * self.growth)))
        while self._over(2 * need, size):
            size *= 2
        return size

    def _rebuild(self, need: int) -> None:
        """Grow to hold ``need`` ids (:meth:`_grown`), and put the ids back."""
        self._move_to(self._grown(need))

    def _move_to(self, size: int) -> None:
        """New slots, ``size`` of them, and the ids put back in, a block of the old slots at
        a time: the old and the new slots are held at once, nothing else (not a copy of
        every id besides)."""
        old = self._arrays()
        self._alloc(size)
        count, self.count = self.count, 0
        for lo in range(0, old[0].shape[0], MOVE_SLOTS):
            keys, vals = self._entries(old, lo, lo + MOVE_SLOTS)
            self.insert(keys, vals)
        assert self.count == count, "an index lost ids as it grew"

    def _arrays(self) -> tuple[np.ndarray, ...]:
        return (self.slots,)

    @staticmethod
    def _entries(arrays: tuple[np.ndarray, ...], lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """The (ids, rows) held in slots ``lo`` to ``hi`` of ``arrays`` (:meth:`_arrays`)."""
        part = arrays[0][lo:hi]
        live = np.flatnonzero(part[:, 1] >= 0)  # (taken by position: a mask over the 2-D
        return part[:, 0].take(live), part[:, 1].take(live)  # slots is slower)

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """Every (id, row), in slot order."""
        return self._entries(self._arrays(), 0, self.size)


class IdIndex(_Index):
    """The index of a table's rows in RAM: as :class:`_Index`, with the probes a lookup and
    its update use (:meth:`refind`, :meth:`locate`) and the sightings of ids not admitted
    yet (:meth:`count_sightings`)."""

    def refind(self, ids: np.ndarray, pos: np.ndarray) -> None:
        """``pos`` (``get`` of ``ids`` earlier, int64) brought up to date where it is -1:
        the rows of ids inserted since, in one compiled pass (no id removed since)."""
        self.kernels.index_refind(self.slots, self.size, ids, pos)

    def locate(self, ids: np.ndarray, marks: np.ndarray) -> np.ndarray | None:
        """:meth:`get`, or None if an id occurs twice in ``ids``, in the same compiled pass:
        the slots found are checked distinct (marked where they lie, then restored; the numpy
        reference marks ``marks`` instead, a byte per row, all 0, left so), and the ids
        without a row through a hash set of just them."""
        ids = np.ascontiguousarray(ids, np.int64)
        out = np.empty(ids.size, np.int64)
        return out if self.kernels.index_locate(self.slots, self.size, ids, out, marks) else None

    def count_sightings(
        self,
        ids: np.ndarray,
        where: np.ndarray,
        counts: np.ndarray,
        owners: np.ndarray,
        admitted: np.ndarray,
        threshold: int,
        next_slot: int,
        room: int,
    ) -> tuple[int, int, int]:
        """This index as sightings (id -> slot of ``counts``, whose id ``owners`` holds):
        one more sighting of each of ``ids`` (unique), in one compiled pass. An id
        whose count reaches ``threshold`` is admitted: ``where[i]`` goes to the next place
        of ``admitted`` (it leaves the index, its count 0); an id not here yet is
        remembered at the next slot from ``next_slot`` with a count of 1, at most ``room``
        of them: the pass stops before the id that would be one more. Returns (ids done,
        ids remembered, ids admitted)."""
        ids = np.ascontiguousarray(ids, np.int64)
        room = min(room, ids.size)
        if self._over(self.count + room, self.size):
            self._rebuild(self.count + room)
        done, added, removed, admits = self.kernels.count_sightings(
            self.slots, self.size, counts, owners, ids, where, admitted, threshold, next_slot, room
        )
        self.count += added - removed
        self.inserted += added
        self.removed += removed
        return done, added, admits


class CompactIdIndex(_Index):
    """int64 id -> row below ``2**32 - 1``, in 12 bytes a slot rather than 16: the ids and
    the rows in two arrays (a probe reads the rows first, 16 slots a cache line, and an id
    only where a slot holds one). For an index that is most of what each of its rows costs
    in RAM (the rows on disk's); it gets, inserts and deletes (no :meth:`locate`,
    :meth:`refind` or :meth:`count_sightings`)."""

    SLOT_BYTES = 12

    def _alloc(self, size: int) -> None:
        self.size = size
        self.keys = np.zeros(size, np.int64)
        self.vals = np.full(size, _EMPTY32, np.uint32)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.vals.nbytes

    def _probe(self, ids: np.ndarray, out: np.ndarray) -> None:
        self.kernels.compact_get(self.keys, self.vals, self.size, ids, out)

    def _put(self, ids: np.ndarray, rows: np.ndarray) -> None:
        self.kernels.compact_insert(self.keys, self.vals, self.size, ids, rows)  # (rows checked first)

    def _remove(self, ids: np.ndarray, out: np.ndarray) -> int:
        return int(self.kernels.compact_delete(self.keys, self.vals, self.size, ids, out))

    def clear(self) -> None:
        self.vals[:] = _EMPTY32
        self.removed += self.count
        self.count = 0

    def _arrays(self) -> tuple[np.ndarray, ...]:
        return (self.keys, self.vals)

    @staticmethod
    def _entries(arrays: tuple[np.ndarray, ...], lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        keys, vals = arrays[0][lo:hi], arrays[1][lo:hi]
        live = np.flatnonzero(vals != _EMPTY32)
        return keys.take(live), vals.take(live).astype(np.int64)


class PartitionedIndex:
    """A :class:`CompactIdIndex` in ``PARTS`` parts, an id's part chosen by the low bits of
    its hash (its slot in the part, by the high ones), each part growing on its own: a
    growth holds the old and the new slots of one part at once, a sixteenth of the whole,
    not the whole index twice over (hundreds of MB for tens of millions of rows on disk,
    past what the budget allows). The same operations as one index, each a pass per part
    that a batch's ids fall in."""

    PARTS = 16
    SLOT_BYTES = CompactIdIndex.SLOT_BYTES

    def __init__(
        self, kernels: ModuleType | None = None, fill: float = 1 / _LOAD, growth: float = 2.0
    ) -> None:
        self.kernels = kernels or KERNELS
        self.fill = fill
        self.parts = [CompactIdIndex(16, self.kernels, fill, growth) for _ in range(self.PARTS)]

    def __len__(self) -> int:
        return sum(p.count for p in self.parts)

    @property
    def count(self) -> int:
        return len(self)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)

    def _split(self, ids: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """(part, positions in ``ids``) for each part some of ``ids`` fall in."""
        # mix64(id) % PARTS in one compiled pass; as bytes, numpy's stable sort is a radix sort
        which = self.kernels.shard_ids(ids, self.PARTS, 0).astype(np.uint8)
        order = np.argsort(which, kind="stable")
        bounds = np.searchsorted(which[order], np.arange(self.PARTS + 1))
        return [(k, order[bounds[k] : bounds[k + 1]]) for k in range(self.PARTS) if bounds[k + 1] > bounds[k]]

    def _each(self, op: str, ids: np.ndarray) -> np.ndarray:
        """Each part's ``op`` (``get`` or ``delete``) of its share of ``ids``, in their order."""
        ids = np.ascontiguousarray(ids, np.int64)
        out = np.empty(ids.size, np.int64)
        for k, at in self._split(ids):
            out[at] = getattr(self.parts[k], op)(ids[at])
        return out

    def get(self, ids: np.ndarray) -> np.ndarray:
        return self._each("get", ids)

    def _counts(self, ids: np.ndarray) -> np.ndarray:
        """How many of ``ids`` fall in each part (``SPLIT_BLOCK`` of them at a time)."""
        counts = np.zeros(self.PARTS, np.int64)
        for lo in range(0, ids.size, SPLIT_BLOCK):
            counts += np.bincount(
                self.kernels.shard_ids(ids[lo : lo + SPLIT_BLOCK], self.PARTS, 0), minlength=self.PARTS
            )
        return counts

    def insert(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Each part's share of ``ids`` in it, ``SPLIT_BLOCK`` ids at a time (a restore's
        millions: the split's temporaries stay a few MB, where whole they took hundreds of
        MB of memory the ps had not touched yet, which costs on first use more than the
        insert), each part grown first as one insert of its share would grow it."""
        ids = np.ascontiguousarray(ids, np.int64)
        rows = np.ascontiguousarray(rows, np.int64)
        if ids.shape != rows.shape:
            raise ValueError(f"PartitionedIndex.insert: {ids.size} ids but {rows.size} rows")
        if rows.size and (rows.min() < 0 or rows.max() >= _EMPTY32):
            raise ValueError(f"PartitionedIndex.insert: rows are 0 to {_EMPTY32 - 1}")  # (before any part)
        if ids.size > SPLIT_BLOCK:
            for part, n in zip(self.parts, self._counts(ids).tolist()):
                part.grow_for(part.count + n)
        for lo in range(0, ids.size, SPLIT_BLOCK):
            block, block_rows = ids[lo : lo + SPLIT_BLOCK], rows[lo : lo + SPLIT_BLOCK]
            for k, at in self._split(block):
                self.parts[k].insert(block[at], block_rows[at])

    def delete(self, ids: np.ndarray) -> np.ndarray:
        return self._each("delete", ids)

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        got = [p.items() for p in self.parts]
        return np.concatenate([g[0] for g in got]), np.concatenate([g[1] for g in got])

    def reserve_for(self, *ids: np.ndarray) -> None:
        """Room for all of ``ids`` more (a bulk load's), each part as full as it may be."""
        counts = sum(
            (self._counts(np.ascontiguousarray(i, np.int64)) for i in ids), np.zeros(self.PARTS, np.int64)
        )
        for part, n in zip(self.parts, counts.tolist()):
            if n:
                part.reserve(part.count + n)

    def parts_of(self, ids: np.ndarray) -> np.ndarray:
        """The part each of ``ids`` falls in."""
        return self.kernels.shard_ids(np.ascontiguousarray(ids, np.int64), self.PARTS, 0)

    def room_after(self, removed: np.ndarray) -> np.ndarray:
        """How many ids each part takes in without growing once ids ``removed`` (in the index)
        are deleted."""
        room = np.array([p.holds - p.count for p in self.parts], np.int64)
        return np.maximum(room, 0) + self._counts(np.ascontiguousarray(removed, np.int64))

    def nbytes_after(self, added: np.ndarray, removed: np.ndarray) -> int:
        """At most :attr:`nbytes` while ids ``removed`` (in the index) are deleted and then ids
        ``added`` (not in it) inserted: each part's count after them known, not reckoned
        (with the old slots of the largest part that grows, as :meth:`nbytes_holding`)."""
        net = self._counts(np.ascontiguousarray(added, np.int64)) - self._counts(
            np.ascontiguousarray(removed, np.int64)
        )
        total = moving = 0
        for part, k in zip(self.parts, net.tolist()):
            after = part.nbytes_holding(part.count + max(0, k))
            total += after
            if after != part.nbytes:
                moving = max(moving, part.nbytes)
        return total + moving

    def nbytes_holding(self, count: int, tight: bool = False) -> int:
        """At most :attr:`nbytes` while ``count`` ids in all come in (their parts unknown:
        each part reckoned to take its share of the new ones and some more, as a binomial
        draw of them would at most but for one in tens of thousands), with the old slots of
        the largest part that grows (held with its new ones while it grows)."""
        more = max(0, count - len(self))
        share = more / self.PARTS
        most = min(more, math.ceil(share + 4 * math.sqrt(share) + 8)) if more else 0
        total = moving = 0
        for part in self.parts:
            after = part.nbytes_holding(part.count + most, tight)
            total += after
            if after != part.nbytes:
                moving = max(moving, part.nbytes)
        return total + moving
