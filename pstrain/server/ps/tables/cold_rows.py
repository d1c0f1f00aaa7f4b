"""The cold tier of a dynamic table's shard: rows on local disk, an index of them in RAM.

A tiered shard (a ps started with ``--table-dir`` and ``--memory-budget``) keeps its hot
rows in RAM, as every table does, and the rest here. Rows come here when the hot set is
full (the least recently, or least often, looked up: the table's own LRU/LFU statistics)
and go back when a request names them; a row here is never changed in place.

On disk: append-only *segments* of records (``cold_segments.py``: their files, written,
linked, read and deleted there); a record is a row whole (its id, epoch, ages, values and
each slot's, packed: ``cold_records.py``), so reading a batch of rows is a read per run of
neighbouring records, and a save reads each record once for every array it writes
(:meth:`ColdRows.fill_many`). A record taken back (or evicted) is only counted dead; a
segment whose records are all dead is deleted (never while a save or a read may need it,
which this module knows). A restore links the files of the checkpoint it restores in as
segments too (``SegmentFiles.link``), rather than writing their rows out again.

In RAM, per cold row: its id in a :class:`PartitionedIndex` (id -> cold slot), its place
(segment and record, held in 32 bits: :class:`Places`), the epoch it last changed in (so
a delta finds it without reading the disk) and its eviction key (last lookup or lookup
count). These, not the record's own bookkeeping, say what the row's are: a record a move
brought keeps its source's.

A save (or a move's copy) sees the tier as it was when it began: it marks the records of
the rows here then (:class:`SavedPlaces`, a byte per record), and no segment is deleted
or compacted until it ends (:meth:`begin_save`, :meth:`end_save`); the records there
never change. Records a move wrote ahead of its switch (:attr:`ColdRows.pending`) keep
segments from being compacted too.

Reads (:meth:`read`) run on a thread, or on the serving loop where they take only what the
page cache holds (``missed``: a read that cannot wait for the disk, the rest left to a
thread); writes (:meth:`put`) append a batch of records in one write. A disk that fills raises
:class:`~pstrain.errors.ResourceExhaustedError` with nothing changed here.
"""

from __future__ import annotations

import asyncio
from types import ModuleType
from typing import Any

import numpy as np

from ...._base.errors import InvalidArgumentError, ResourceExhaustedError
from ...._kernels import KERNELS
from ...._kernels.id_index import PartitionedIndex
from .cold_places import PLACE_BITS, MaskedPlaces, Places, SavedPlaces, place_blocks
from .cold_records import META, copy_field, field_cells, pack_records, scatter_cells
from .cold_segments import Segment, SegmentFiles, remove_soon

__all__ = ["ColdRows", "resize_rows"]

#: How full the index of the rows here may be before it grows (the index of rows in RAM:
#: half). Each row here costs RAM for nothing but its index entry and bookkeeping, so
#: the index is kept fuller: 16 to 20 bytes a row (12 a slot, and it grows by
#: ``INDEX_GROWTH``) rather than 32 to 64, for probes of about 2.5 slots for an id here and
#: 8.5 for one not here.
INDEX_FILL = 0.75
#: How much the index of the rows here grows at a time: by a quarter (it is most of the RAM
#: such a row costs; a doubling would leave up to half of it unused), its ids put back
#: each time (four times each, over a growth from nothing).
INDEX_GROWTH = 1.25
#: Cold slots a shard may have (numbered in 32 bits: 4 billion rows on disk would take
#: some 200 GB of RAM to index).
MAX_SLOTS = (1 << 32) - 1
#: Cold slots not in use are taken again once they are 1 in ``REUSE`` of the slots (a
#: scan for them then crosses about ``REUSE`` slots for each: they may take that share of
#: the slots' RAM meanwhile).
REUSE = 16
#: Slots a scan for slots not in use reads at least at a time.
SCAN_SLOTS = 1 << 14
#: Slots given up lately that a tier keeps a list of, at most (4 bytes each, and at most one
#: for ``REUSE`` of its slots: 1 MB for millions), so that the rows moved out take the slots
#: that rows put back in RAM gave up without a scan: in a tier that trains, slots are given
#: up and taken again a request at a time, a few thousand among millions, which a scan
#: finds only by crossing most of the slots.
FREED_KEPT = 1 << 18


def _freed_kept(slots: int) -> int:
    """How many slots given up a tier of ``slots`` per-slot entries lists (:data:`FREED_KEPT`)."""
    return min(FREED_KEPT, slots // REUSE)


#: The largest eviction key held (past ``key_base``), and how far below the newest key
#: the base moves when one passes it (a row not looked up for a billion lookups orders
#: as that old: ``max_age`` evicts it long before).
KEY_TOP = (1 << 32) - 1
KEY_SPAN = 1 << 30
#: Rows a bulk load (:meth:`ColdRows.add_parts`) indexes at a time: its temporaries (the
#: ids split among the index's parts, their slots, their places encoded), some 40 bytes a
#: row, are a block's (a restore's tens of millions of rows: its largest transient).
LOAD_BLOCK = 1 << 14


_NONE = np.empty(0, np.uint8)  # (:meth:`ColdRows._mark_made`: no bit set)


def resize_rows(holder: dict[str, Any], key: str, rows: int) -> np.ndarray:
    """``holder[key]`` made ``rows`` rows long, the rows it keeps as they were and new ones
    0: in place where nothing else refers to it (realloc moves a large array's pages
    rather than copying them, and gives a shrunk one's tail back: never the array twice in
    RAM), else a copy. (Taken out of ``holder`` first: numpy refuses to resize an array
    that anything but its one holder refers to, and would count that holder too.)"""
    arr = holder.pop(key)
    try:
        arr.resize((rows,) + arr.shape[1:], refcheck=True)
    except ValueError:  # a view of it is out
        grown = np.zeros((rows,) + arr.shape[1:], arr.dtype)
        keep = min(rows, arr.shape[0])
        grown[:keep] = arr[:keep]
        arr = grown
    holder[key] = arr
    return arr


def _grown(size: int, need: int) -> int:
    """The size of a per-slot array grown to hold ``need``: by a quarter at least (each
    slot's bookkeeping is all the RAM a row here costs: doubling would leave up to half of
    it unused, and the budget reckons it whole)."""
    return max(need, size + size // 4, 1024)


class ColdRows:
    """One shard's cold rows; see the module docstring."""

    def __init__(
        self,
        directory: str,
        dim: int,
        dtype: np.dtype,
        *,
        segment_rows: int = 1 << 20,
        kernels: ModuleType | None = None,
    ) -> None:
        self.directory = directory
        self.dim = dim
        self.dtype = np.dtype(dtype)
        self.segment_rows = segment_rows
        self.kernels = kernels or KERNELS
        self.index = PartitionedIndex(self.kernels, INDEX_FILL, INDEX_GROWTH)  # id -> cold slot
        #: Cold slot -> place; a slot not in use holds ``FREE`` (so a slot is live where
        #: its place is at least 0). A place is never given twice (segments are numbered
        #: on, never again): a read of a row's record is still the row's while the row's
        #: slot holds the place read (compaction, which moves a record, fails that check,
        #: and the row is read again: never a stale one taken).
        self.places = Places(segment_rows)
        #: The segments' files (made anew: a tier lives as long as its ps, restores come from
        #: checkpoints).
        self.files = SegmentFiles(directory, dim, self.dtype, segment_rows, self.kernels, self.places)
        self.epochs = np.empty(0, np.uint32)
        #: Eviction key (last lookup, LRU, or lookup count, LFU), less ``key_base``, in 32
        #: bits (:meth:`keys_of`): clamped at 0 (a key further below the newest than
        #: ``KEY_SPAN`` orders as that far) and at its top.
        self.keys = np.empty(0, np.uint32)
        self.key_base = 0
        #: A bit a cold slot (:meth:`made_at`): set where the slot's record holds its row as
        #: the table made it (initial values and slots, a count of 0: what
        #: :meth:`TieredTable._write_out` checks), so that a promotion makes the row again
        #: rather than read it. Set or cleared with each place :meth:`add` gives, cleared with
        #: a bulk load's, kept with compaction's (which copies a record whole): a slot that
        #: still holds the place read with its bit (:meth:`current`) holds that record.
        self.as_made = np.zeros(0, np.uint8)
        #: Slots not in use below ``used``: the last ``nfreed`` given up, at most
        #: ``FREED_KEPT``, listed in ``freed`` and taken first (newest first); the others
        #: found by a scan from ``cursor`` once they are ``REUSE`` of the slots (a few
        #: slots apart; 4 bytes a slot to list them all). A scan runs only once ``freed``
        #: is empty, so every slot listed is not in use, and listed once.
        self.nfree = self.used = self.cursor = 0
        self.freed = np.empty(0, np.uint32)  # (grown with the per-slot arrays)
        self.nfreed = 0
        self.saves = 0  # saves reading now: no segment is deleted meanwhile
        self.reading = 0  # reads on threads now: no segment is deleted meanwhile
        self._read_waiters: list[asyncio.Future[None]] = []  # (reads_ended)
        #: Records written and not indexed yet (a move's, pulled ahead of its switch): no
        #: segment is compacted meanwhile
        self.pending = 0
        self.discarded = False  # the table is gone: the directory goes once no one reads it
        self.reads = self.rows_read = self.rows_written = 0

    def __len__(self) -> int:
        return len(self.index)

    @property
    def nbytes(self) -> int:
        """RAM this tier takes: its index and per-row arrays."""
        return int(
            self.index.nbytes
            + self.places.nbytes
            + self.epochs.nbytes
            + self.keys.nbytes
            + self.as_made.nbytes
            + self.freed.nbytes
        )

    #: Bytes per cold slot of the arrays besides the index: place (:class:`Places`), epoch,
    #: key (and a bit: :attr:`as_made`). (With its index entry, 16 to 20 bytes by the
    #: index's load, a cold row takes 28 to 32 bytes.)
    SLOT_BYTES = 4 + 4 + 4

    def nbytes_with(self, more: int, tight: bool = False) -> int:
        """:attr:`nbytes` once ``more`` rows more are here: the index and the per-slot
        arrays grown as :meth:`put` grows them (by a quarter: a step, not a row at a time;
        the index as full as it may be with ``tight``, as a put with ``tight`` leaves it)."""
        return int(self.index.nbytes_holding(len(self.index) + more, tight) + self._slots_bytes(more))

    def nbytes_after(self, added: np.ndarray, removed: np.ndarray) -> int:
        """At most :attr:`nbytes` while ids ``removed`` (here) are taken out and then ids
        ``added`` (not here) put in: a promotion's rows out, the rows it moves to disk in,
        which take the slots those give up. The index reckoned part by part (an id's part is
        known), so that as many in as out grows nothing."""
        return int(self.index.nbytes_after(added, removed) + self._slots_bytes(added.size, removed.size))

    def _slots_bytes(self, more: int, freed: int = 0) -> int:
        """The per-slot arrays' bytes once ``more`` rows more are here, grown as :meth:`put`
        grows them, ``freed`` slots given up first."""
        listed = min(self.nfreed + freed, self.freed.size)  # (as :meth:`remove` lists them)
        need = self.used + more - self._reused(more, self.nfree + freed, listed)
        size = self.places.size
        if need > size:
            size = _grown(size, need)
        segments = -(-more // self.segment_rows) + 1  # (each a handle, 16 bytes: Places)
        listing = 4 * _freed_kept(size)  # (:attr:`freed`, grown with the slots)
        return size * self.SLOT_BYTES + -(-size // 8) + self.places.handle_bytes(segments) + listing

    @property
    def segments(self) -> dict[int, Segment]:
        """The segments on disk, by number."""
        return self.files.segments

    def disk_bytes(self) -> int:
        return self.files.disk_bytes()

    def record(self, slots: tuple[str, ...]) -> np.dtype:
        """A record of a segment whose rows carry ``slots`` (:func:`record_dtype`)."""
        return self.files.record(slots)

    # -- finding --------------------------------------------------------------------------------
    def find(self, ids: np.ndarray) -> np.ndarray:
        """The cold slot of each id, -1 where it is not here."""
        return self.index.get(ids) if len(self.index) else np.full(len(ids), -1, np.int64)

    def ids_of(self, slots: np.ndarray) -> np.ndarray:
        """The ids of cold ``slots`` (from the index: no disk read; one pass over it, no
        sort, and an array of an id per slot only while this runs)."""
        return self.ids_by_slot()[slots]

    def ids_by_slot(self) -> np.ndarray:
        """The id of each cold slot in use (any value for a slot free now)."""
        keys, vals = self.index.items()
        by_slot = np.empty(self.used, np.int64)
        by_slot[vals] = keys
        return by_slot

    # -- writing --------------------------------------------------------------------------------
    def put(
        self,
        ids: np.ndarray,
        rows: np.ndarray,
        slots: dict[str, np.ndarray],
        meta: np.ndarray,
        keys: np.ndarray,
        *,
        tight: bool = False,
    ) -> None:
        """Add ``ids`` (none here yet) with their rows, slots and ``META`` records; on a full
        disk, ResourceExhaustedError and nothing changed. ``tight``: a bulk load (a
        restore), whose index is sized to hold them as full as it may be."""
        if not ids.size:
            return
        self.add(ids, self.write(ids, rows, slots, meta), meta["epoch"], keys, tight=tight)

    def add(
        self,
        ids: np.ndarray,
        places: np.ndarray,
        epochs: np.ndarray,
        keys: np.ndarray,
        *,
        tight: bool = False,
        as_made: np.ndarray | None = None,
    ) -> None:
        """Index ``ids`` (none here yet), whose records :meth:`write` put at ``places``: the
        second half of :meth:`put`, which a caller may do once it has freed RAM for them.
        ``as_made``: which of the records hold their rows as the table made them (checked
        by the caller; none if None)."""
        n = ids.size
        if not n:
            return
        if tight:
            self.index.reserve_for(ids)
        cold = self._take_slots(n)
        self.places[cold] = places
        self._mark_made(cold, as_made)
        self.epochs[cold] = epochs
        self._set_keys(cold, keys)
        self.index.insert(ids, cold)
        self.rows_written += n

    def add_parts(self, parts: list[tuple[np.ndarray, np.ndarray | MaskedPlaces]]) -> None:
        """:meth:`add` of every ``(ids, places)`` of ``parts`` with epoch and key 0 (places
        as an array, or made a block at a time: :class:`MaskedPlaces`): a restore's bulk
        load into a tier made anew (no slot given up yet), its slots a run taken at once and
        written as slices a block at a time, the index sized for them as full as it may be,
        and no array of them all joined (tens of millions of rows: each copy is hundreds of
        MB the ps has not touched yet, which costs more on first use than the copy)."""
        n = sum(ids.size for ids, _ in parts)
        if not n:
            return
        assert not self.nfree and not self.nfreed, "a bulk load into a tier with slots given up"
        self.index.reserve_for(*(ids for ids, _ in parts))
        first = at = self.used
        self._room_for(n)
        self.used += n
        for ids, places in parts:
            done = 0
            for block_places in place_blocks(places, LOAD_BLOCK):
                block = ids[done : done + block_places.size]
                if block.size != block_places.size:
                    raise InvalidArgumentError(f"a bulk load into {self.directory}: more places than ids")
                self.places[at : at + block.size] = block_places
                self.index.insert(block, np.arange(at, at + block.size, dtype=np.int64))
                at += block.size
                done += block.size
            if done != ids.size:
                raise InvalidArgumentError(
                    f"a bulk load into {self.directory}: {ids.size} ids, {done} placed"
                )
        self.epochs[first:at] = 0
        self.keys[first:at] = np.clip(-self.key_base, 0, KEY_TOP)
        self._clear_made(first, at)
        self.rows_written += n

    def write(
        self,
        ids: np.ndarray,
        rows: np.ndarray,
        slots: dict[str, np.ndarray],
        meta: np.ndarray,
        where: np.ndarray | None = None,
    ) -> np.ndarray:
        """Write records at the end of the open segment (opening new ones as they fill),
        ``WRITE_ROWS`` at a time; returns their places (the first half of :meth:`put`: the
        records are read only once :meth:`add` indexes them). ``where``: the records' rows
        and slots are ``rows[where]`` and each ``slots[k][where]`` (gathered a block at a
        time, not copied whole first). On a full disk, ResourceExhaustedError and every
        segment as it was (bytes written past a segment's count are never read, and cut
        before the next write there)."""
        key_names = tuple(sorted(slots))

        def pack(part: slice) -> np.ndarray:
            record, values = self.record(key_names), [slots[k] for k in key_names]
            if where is None:
                return pack_records(record, ids[part], meta[part], rows[part], [v[part] for v in values])
            return pack_records(record, ids[part], meta[part], rows, values, where[part])

        return self.files.append(ids.size, key_names, pack)

    def write_records(self, records: np.ndarray, slots: tuple[str, ...]) -> np.ndarray:
        """As :meth:`write`, of records already laid out as a segment's whose rows carry
        ``slots`` (sorted): written as they are (a move's rows on disk, as their source
        read them), ``WRITE_ROWS`` at a time."""
        return self.files.append(records.size, slots, lambda part: records[part])

    def _reused(self, n: int, nfree: int | None = None, nfreed: int | None = None) -> int:
        """How many of ``n`` slots a put takes from those not in use (``nfree`` of them,
        ``nfreed`` of those listed; :attr:`nfree` and :attr:`nfreed` if None): the listed
        ones, then, once those not listed are ``REUSE`` of the slots, as many of them (a
        scan finds them a few slots apart at most: one for a few slots among millions
        crossed most of them)."""
        nfree = self.nfree if nfree is None else nfree
        nfreed = self.nfreed if nfreed is None else nfreed
        listed, unlisted = min(n, nfreed), nfree - nfreed
        return listed + (min(n - listed, unlisted) if unlisted * REUSE >= self.used else 0)

    def _take_slots(self, n: int) -> np.ndarray:
        reuse = self._reused(n)
        fresh = n - reuse
        self._room_for(fresh)  # (may refuse: nothing taken yet)
        listed = min(reuse, self.nfreed)  # the newest given up first, then a scan for the rest
        self.nfreed -= listed
        kept = self.freed[self.nfreed : self.nfreed + listed].astype(np.int64)
        taken = np.concatenate([kept, self._free_slots(reuse - listed, kept)])
        self.nfree -= reuse
        out = np.concatenate([taken, np.arange(self.used, self.used + fresh, dtype=np.int64)])
        self.used += fresh
        return out

    def _room_for(self, fresh: int) -> None:
        """The per-slot arrays grown (:func:`_grown`) to hold ``fresh`` slots past ``used``."""
        if self.used + fresh > self.places.size:
            size = _grown(self.places.size, self.used + fresh)
            if size > MAX_SLOTS:
                raise ResourceExhaustedError(
                    f"the table directory {self.directory}: more than {MAX_SLOTS} rows on disk in one shard"
                )
            old = self.places.size
            resize_rows(self.places.__dict__, "codes", size)
            for name in ("epochs", "keys"):
                resize_rows(self.__dict__, name, size)
            resize_rows(self.__dict__, "as_made", -(-size // 8))  # (the new bits 0)
            resize_rows(self.__dict__, "freed", _freed_kept(size))  # (those listed kept)
            self.places.codes[old:] = Places.FREE

    def _free_slots(self, n: int, taken: np.ndarray | None = None) -> np.ndarray:
        """``n`` slots not in use (there are as many) besides ``taken`` (slots not in use
        already taken from :attr:`freed`), scanned for from ``cursor`` on, round."""
        if not n:
            return np.empty(0, np.int64)
        parts, found, at, scanned = [], 0, self.cursor, 0
        while found < n and scanned < self.used:
            if at >= self.used:
                at = 0
            hi = min(self.used, at + max(SCAN_SLOTS, 2 * REUSE * (n - found)))
            part = self.places.free_in(at, hi)
            if taken is not None and taken.size:  # (at most all of ``taken`` left out)
                part = part[: n - found + taken.size]
                part = part[~np.isin(part, taken)]
            part = part[: n - found]
            parts.append(part)
            found += part.size
            scanned += hi - at
            at = int(part[-1]) + 1 if found == n else hi
        self.cursor = at
        out = np.concatenate(parts)
        assert out.size == n, "cold slots not in use miscounted"
        return out

    def _set_keys(self, slots: np.ndarray, keys: np.ndarray) -> None:
        """Eviction keys ``keys`` (int64) for ``slots``, in 32 bits past ``key_base``, moved
        first if a key is past its top (the keys below the new base clamp at 0), or down
        if one is below it and the keys held still fit: a row moved in from another shard
        may have been looked up last before this shard's first lookup (a negative key), and
        its age carries on from there, as in RAM."""
        if not keys.size:
            return
        keys = np.asarray(keys, np.int64)
        base, top, low = self.key_base, int(keys.max()), int(keys.min())
        if low < base:
            kept = self.keys[: self.used]
            kept_top = base + int(kept.max()) if kept.size else top
            base = max(low, max(top, kept_top) - KEY_TOP)
        if top - base > KEY_TOP:
            base = top - KEY_SPAN
        if base != self.key_base:
            live = self.places.live(0, self.used)
            held = self.keys[: self.used].astype(np.int64) + (self.key_base - base)
            self.keys[: self.used] = np.where(live, np.clip(held, 0, KEY_TOP), 0).astype(np.uint32)
            self.key_base = base
        self.keys[slots] = np.clip(keys - self.key_base, 0, KEY_TOP).astype(np.uint32)

    def _mark_made(self, slots: np.ndarray, made: np.ndarray | None) -> None:
        """:attr:`as_made`'s bits of ``slots`` set where ``made``, cleared elsewhere."""
        if slots.size:
            on = _NONE if made is None else np.ascontiguousarray(made, bool).view(np.uint8)
            self.kernels.mark_bits(self.as_made, np.ascontiguousarray(slots, np.int64), on)

    def _clear_made(self, lo: int, hi: int) -> None:
        """:attr:`as_made`'s bits of slots ``lo`` to ``hi`` cleared: the whole bytes at once,
        the slots at either end one by one (a bulk load's tens of millions)."""
        whole_lo, whole_hi = -(-lo // 8), hi // 8
        if whole_lo >= whole_hi:
            self._mark_made(np.arange(lo, hi, dtype=np.int64), None)
            return
        self.as_made[whole_lo:whole_hi] = 0
        ends = np.concatenate([np.arange(lo, whole_lo * 8), np.arange(whole_hi * 8, hi)]).astype(np.int64)
        self._mark_made(ends, None)

    def made_at(self, slots: np.ndarray) -> np.ndarray:
        """Which of cold ``slots`` (in use) hold records of rows as the table made them
        (:attr:`as_made`): taken with the slots' places, before a read, they say which of
        the records read need not be."""
        slots = np.asarray(slots, np.int64)
        return ((self.as_made[slots >> 3] >> (slots & 7).astype(np.uint8)) & 1) != 0

    def keys_of(self, slots: np.ndarray) -> np.ndarray:
        """The eviction keys of cold ``slots`` (int64)."""
        return self.keys[slots].astype(np.int64) + self.key_base

    def live_slots(self) -> np.ndarray:
        """The cold slots in use, ascending."""
        return np.flatnonzero(self.places.live(0, self.used))

    def current(self, slots: np.ndarray, places: np.ndarray) -> np.ndarray:
        """Which of cold ``slots`` still hold the records at ``places`` (not taken back,
        nor moved by compaction, since: a place is never given twice). A slot past those
        in use holds none (the rows were forgotten since: :meth:`reset`)."""
        if slots.size and int(slots.max()) >= self.used:
            inside = slots < self.used
            out = np.zeros(slots.size, bool)
            out[inside] = self.places[slots[inside]] == places[inside]
            return out
        return self.places[slots] == places

    # -- taking out -------------------------------------------------------------------------------
    def remove(self, ids: np.ndarray) -> np.ndarray:
        """Take ``ids`` out (those here): promoted to RAM, or evicted. Returns their cold
        slots as they were (-1 for ids not here); their records become dead."""
        cold = self.index.delete(ids) if len(self.index) else np.full(len(ids), -1, np.int64)
        gone = cold[cold >= 0]
        if not gone.size:
            return cold
        places = self.places[gone]
        self.places.codes[gone] = Places.FREE
        self.nfree += gone.size
        listed = min(gone.size, self.freed.size - self.nfreed)  # (the others found by a scan)
        self.freed[self.nfreed : self.nfreed + listed] = gone[:listed]
        self.nfreed += listed
        self.files.died(places)
        self.collect()
        return cold

    def unwritten(self, places: np.ndarray) -> None:
        """Records written at ``places`` and never indexed (a put that failed part way after
        them) count dead: their segments go once the rest of theirs do."""
        if places.size:
            self.files.died(places)

    def collect(self) -> int:
        """Delete the segments whose every record is dead (none while a save or a read may
        need them; not the one being written). Returns how many."""
        if self.saves or self.reading:
            return 0
        return self.files.collect()

    # -- compaction ---------------------------------------------------------------------------
    def compactable(self) -> int | None:
        """A segment at least half dead (not the one being written), to copy its live
        records to the end and delete it; None if none, while a save reads, or while records
        written are still to be indexed (a move's, :attr:`pending`: a copy of the segment's
        live records would leave them behind)."""
        if self.saves or self.pending:
            return None
        return self.files.half_dead()

    def live_in(self, number: int) -> tuple[np.ndarray, np.ndarray]:
        """The cold slots of the rows in segment ``number``, and their places."""
        live = self.live_slots()
        live = live[self.places.in_segment(live, number)]
        return live, self.places[live]

    def rewrite(self, slots: np.ndarray, places: np.ndarray, records: dict[str, np.ndarray]) -> int:
        """Write the records read from ``places`` again at the end, for the cold ``slots``
        still there (a row taken back meanwhile is not); their old records die. Returns
        how many moved."""
        still = self.current(slots, places)
        if not still.any():
            return 0
        slots = slots[still]
        slot_values = {k[5:]: v[still] for k, v in records.items() if k.startswith("slot:")}
        new = self.write(records["ids"][still], records["rows"][still], slot_values, records["meta"][still])
        self.files.died(places[still])
        self.places[slots] = new  # (the records copied whole: their bits hold)
        self.collect()
        return int(slots.size)

    def victims(self, n: int) -> np.ndarray:
        """The ids of the ``n`` cold rows with the lowest eviction keys."""
        live = self.live_slots()
        if n >= live.size:
            picked = live
        else:
            picked = live[np.argpartition(self.keys[live], n)[:n]]
        return self.ids_of(picked)

    # -- reading ------------------------------------------------------------------------------------
    def records(self, n: int, slot_init: dict[str, float]) -> dict[str, np.ndarray]:
        """Room for ``n`` records as :meth:`read` gives them (not filled)."""
        return {
            "ids": np.empty(n, np.int64),
            "meta": np.empty(n, META),
            "rows": np.empty((n, self.dim), self.dtype),
            **{f"slot:{k}": np.empty((n, self.dim), self.dtype) for k in slot_init},
        }

    def read(
        self, places: np.ndarray, slot_init: dict[str, float], missed: np.ndarray | None = None
    ) -> dict[str, np.ndarray]:
        """The records at ``places`` (any order): ``ids``, ``meta``, ``rows`` and
        ``slot:<k>`` for each slot of ``slot_init`` (its initial value where a segment does
        not carry it). Safe on a thread while the loop appends: records are never changed,
        and no segment is deleted while ``reading``. With ``missed`` (a bool a place), only
        the records the page cache holds, never waiting for the disk (what the serving loop
        reads itself): the others are marked True there, and their entries are not to be used."""
        n = places.size
        out = self.records(n, slot_init)
        order = np.argsort(places, kind="stable")
        sorted_places = places[order]
        skipped = None if missed is None else np.zeros(n, np.uint8)  # (in ``sorted_places``' order)
        at = 0
        while at < n:  # a block per run of segments whose records carry the same slots
            got, slots = self._records_from(sorted_places[at:], None if skipped is None else skipped[at:])
            dest = order[at : at + got.size]
            at += got.size
            out["ids"][dest] = got["id"]  # (each record's fields moved as one block: as_cells)
            scatter_cells(out["meta"], dest, field_cells(got, "epoch", "freq"))
            scatter_cells(out["rows"], dest, field_cells(got, "row"))
            for k, init in slot_init.items():
                if k in slots:
                    scatter_cells(out[f"slot:{k}"], dest, field_cells(got, f"slot{slots.index(k)}"))
                else:
                    out[f"slot:{k}"][dest] = init
        if missed is not None and skipped is not None:  # (a read if the page cache held any)
            missed[order] = skipped.view(bool)
            n -= int(np.count_nonzero(skipped))
        if n or skipped is None:
            self.reads += 1
            self.rows_read += n
        return out

    def records_at(self, places: np.ndarray) -> tuple[np.ndarray, tuple[str, ...]] | None:
        """The records at ``places`` (ascending) as they lie on disk, and the slots they
        carry, if every one of them lies in a segment whose records carry the same slots
        (the usual case); else None."""
        if not places.size:
            return None
        records, slots = self.records_from(places)
        return (records, slots) if records.size == places.size else None

    def records_from(self, places: np.ndarray) -> tuple[np.ndarray, tuple[str, ...]]:
        """The records at the first of ``places`` (ascending) as they lie on disk, as many
        as lie in segments whose records carry the same slots as the first's, and those
        slots. Each run of a segment's records is read once, straight into its part of the
        array returned."""
        out, slots = self._records_from(places)
        if out.size:
            self.reads += 1
            self.rows_read += out.size
        return out, slots

    def _records_from(
        self, places: np.ndarray, missed: np.ndarray | None = None
    ) -> tuple[np.ndarray, tuple[str, ...]]:
        """:meth:`records_from`, not counted as a read (``missed``: only what the page cache
        holds, as :meth:`SegmentFiles.gather` reads it)."""
        if not places.size:
            return np.empty(0, self.record(())), ()
        numbers = places >> PLACE_BITS
        starts = [0, *(np.flatnonzero(numbers[1:] != numbers[:-1]) + 1).tolist(), places.size]
        slots = self.segments[int(numbers[0])].slots
        runs = 1
        while runs < len(starts) - 1 and self.segments[int(numbers[starts[runs]])].slots == slots:
            runs += 1
        out = np.empty(starts[runs], self.record(slots))
        for a, b in zip(starts[:runs], starts[1 : runs + 1]):
            self.files.gather(
                int(numbers[a]),
                places[a:b] & ((1 << PLACE_BITS) - 1),
                out.dtype,
                out[a:b],
                None if missed is None else missed[a:b],
            )
        return out, slots

    # -- saves ----------------------------------------------------------------------------------------
    def begin_save(self) -> None:
        """A save reads places taken now: no segment is deleted until :meth:`end_save`."""
        self.saves += 1

    def end_save(self) -> None:
        self.saves = max(0, self.saves - 1)
        self.collect()
        self._remove_if_unused()

    # -- reads on threads, and the end of the tier ---------------------------------------------------
    def begin_read(self) -> None:
        """A read on a thread of places taken now: no segment is deleted until :meth:`end_read`."""
        self.reading += 1

    def end_read(self) -> None:
        self.reading = max(0, self.reading - 1)
        if not self.reading:
            waiters, self._read_waiters = self._read_waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)
        self.collect()
        self._remove_if_unused()

    async def reads_ended(self) -> None:
        """Wait until no read on a thread is under way (on the loop that begins and ends
        them)."""
        while self.reading:
            waiter = asyncio.get_running_loop().create_future()
            self._read_waiters.append(waiter)
            await waiter

    def discard(self) -> None:
        """The table went (replaced by a restore, dropped by a move or a takeover): its
        directory goes now, or when the last save or read of it ends."""
        self.discarded = True
        self._remove_if_unused()

    def _remove_if_unused(self) -> None:
        if self.discarded and not self.saves and not self.reading:
            self.files.forget()
            remove_soon(self.directory)

    def places_now(self) -> np.ndarray:
        """The places of the rows here now, ascending (a whole export's)."""
        places = self.places[np.flatnonzero(self.places.live(0, self.used))]
        places.sort()
        return places

    def saved_places(
        self, since: int | None = None, moving: tuple[int, list[int]] | None = None
    ) -> SavedPlaces:
        """The places of the rows here now (changed after epoch ``since``, or in slices
        ``moving``, ``(slices, owned)``, if given): what a save, or a move's copy, taken now
        reads, while records there never change (:class:`SavedPlaces`)."""
        return SavedPlaces(self, since, moving)

    def fill(self, places: np.ndarray, key: str, slot_init: dict[str, float], out: np.ndarray) -> None:
        """Column ``key`` (``ids``, ``rows`` or ``slot:<k>``) of the records at ``places``
        (ascending) into ``out`` (see :meth:`fill_many`)."""
        self.fill_many(places, [key], slot_init, {key: out})

    def fill_many(
        self,
        places: np.ndarray,
        keys: list[str],
        slot_init: dict[str, float],
        outs: dict[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """Columns ``keys`` (``ids``, ``rows``, ``live``, ``slot:<k>`` or ``meta``: each
        record's ``META`` fields) of the records at ``places`` (ascending), into ``outs``
        (fresh arrays for those not given): what a save writes, or a move's copy. Each run
        of a segment's records is read once for every column, and only the fields wanted
        copied out of it (no scatter: the places are in order)."""
        n = places.size
        outs = dict(outs or {})
        for key in keys:
            if key not in outs:
                outs[key] = (
                    np.ones(n, bool)
                    if key == "live"
                    else np.empty(n, np.int64)
                    if key == "ids"
                    else np.empty(n, META)
                    if key == "meta"
                    else np.empty((n, self.dim), self.dtype)
                )
        read = [k for k in keys if k != "live"]
        if read:
            numbers = places >> PLACE_BITS
            starts = [0, *(np.flatnonzero(numbers[1:] != numbers[:-1]) + 1).tolist(), n]
            for a, b in zip(starts[:-1], starts[1:]):
                seg = self.segments[int(numbers[a])]
                got = None
                for key in read:
                    slot = key[5:] if key.startswith("slot:") else None
                    if slot is not None and slot not in seg.slots:
                        outs[key][a:b] = slot_init[slot]
                        continue
                    if got is None:
                        records = places[a:b] & ((1 << PLACE_BITS) - 1)
                        got = self.files.gather(seg.number, records, self.record(seg.slots))
                    if key == "meta":
                        copy_field(outs[key][a:b], got, "epoch", "freq")
                        continue
                    field = "row" if slot is None else f"slot{seg.slots.index(slot)}"
                    copy_field(outs[key][a:b], got, "id" if key == "ids" else field)
            self.reads += 1
            self.rows_read += n
        for key in keys:
            if key == "live":
                outs[key][:] = True
        return outs

    def reset(self) -> None:
        """Forget every row (a restore replaces them all)."""
        for seg in list(self.segments.values()):
            self.files.delete_files(seg)
        number = self.files.next_number  # (places of the rows forgotten are never given again)
        self.__init__(  # type: ignore[misc]
            self.directory, self.dim, self.dtype, segment_rows=self.segment_rows, kernels=self.kernels
        )
        self.files.next_number = number
