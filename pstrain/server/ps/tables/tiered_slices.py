"""What a tiered table does when slices of its hash space move to another ps, or a lost
ps's rows arrive (mixed into :class:`~pstrain.server.ps.tables.tiered_table.TieredTable`).

A move's copy holds both tiers: the rows in RAM as arrays, copied on the serving loop, and
the records of those on disk, read on a thread after the copy's mark and shipped as they
lie there (``moved_records.py``); the patch then gives what changed since. Rows merged into
a tiered shard (a move's, or a lost ps's in its replacement) go to its disk, read back as
they are looked up: a records' copy written as it came, arrays written as a save writes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from ...._base.errors import InvalidArgumentError, ResourceExhaustedError
from ...._formats.numerics.idhash import in_slices
from .cold_rows import META, ColdRows, copy_field
from .id_index import IdIndex
from .moved_records import kept_records, records_of
from .table_slices import SlicedRows, checked_array

if TYPE_CHECKING:
    from ...._formats.messages.placement_map import SliceSet, TableCopy, TablePatch

__all__ = ["TieredSlices"]


def _owned(arr: Any, dtype: np.dtype) -> np.ndarray:
    """``arr`` as a C-contiguous array of ``dtype`` this table may write: itself if it is
    one (a message's array, decoded into a buffer of its own), else a copy."""
    out = np.asarray(arr)
    if out.dtype == dtype and out.flags.c_contiguous and out.flags.writeable:
        return out
    return np.array(out, dtype, order="C")


class TieredSlices(SlicedRows):
    """Moves and merges of a tiered table's slices, both tiers (see the module docstring)."""

    if TYPE_CHECKING:  # the tiered table's, as ``tiered_table.py`` makes them
        cold: ColdRows
        budget: int
        refused: int
        #: The last move's copy of rows on disk: (its slices, their ids sorted, the writes
        #: that put them there, their bookkeeping), until its patch is taken.
        _copied: tuple[SliceSet, np.ndarray, np.ndarray, np.ndarray] | None

        def _cold_fits(self, n: int) -> bool: ...
        def shrink_for_cold(
            self, n: int, in_ram: int | None = None, keep: np.ndarray | None = None
        ) -> int: ...

    # -- a lost ps's rows, put in (a replacement) ---------------------------------------------------
    def checked_merge(self, copy: TableCopy, patch: TablePatch) -> Callable[[], int]:
        """As an untiered table's (every check first, nothing changed), but the rows go to
        disk, read back as they are looked up: a lost ps's share of a table may be far more
        than the hot set. A copy's records (its source's rows on disk) not changed since are
        written as they came, their bookkeeping set; the other rows as a save writes them.
        ResourceExhaustedError if the budget cannot index them."""
        dim, dtype = self.config.dim, self.dtype
        records = records_of(copy, dim, dtype)
        record_ids = self._checked(copy, patch, records)
        live = np.ascontiguousarray(patch.live, np.int64)
        n = live.size
        if not self._cold_fits(n):  # the hot set gives RAM for their index, if it can
            self.shrink_for_cold(n, in_ram=0)
        if not self._cold_fits(n):
            self.refused += 1
            raise ResourceExhaustedError(
                f"dynamic table {self.name!r}: {n} more rows on disk would take their index past "
                f"this ps's budget of {self.budget} bytes (pstrain serve --memory-budget)"
            )
        epoch = self.clock.epoch  # (in the next delta, as an untiered table's merge)
        last_seen = self.lookups - np.asarray(patch.ages, np.int64)
        freq = np.asarray(patch.freq, np.int64)
        lru = self.config.evict == "lru" or self.config.max_age is not None
        # the records of live rows the patch did not change go as they came; the rest
        # (the source's rows in RAM, and those changed) are gathered from copy and patch
        pos = self._kept_at(live, record_ids, patch)
        kept = kept_records(records, pos, epoch, last_seen, freq)
        kept_at = pos[pos >= 0]
        rest = np.ones(n, bool)
        rest[kept_at] = False
        rest_at = np.flatnonzero(rest)
        rest_ids = live[rest_at]
        slot_init = {**self.slot_init, **copy.slot_init, **patch.slot_init}
        keys = set(self.slots) | set(copy.slots) | set(patch.slots) | set(copy.record_slots)
        rows, slots = self._gathered(rest_ids, copy, patch, {k: slot_init[k] for k in keys})
        meta = np.zeros(rest_ids.size, META)
        meta["epoch"] = epoch
        meta["last_seen"] = last_seen[rest_at]
        meta["freq"] = freq[rest_at]
        removed = np.ascontiguousarray(patch.removed if patch.removed is not None else [], np.int64)
        cand_ids = np.ascontiguousarray(patch.cand_ids if patch.cand_ids is not None else [], np.int64)
        counts = np.asarray(patch.cand_counts if cand_ids.size else [], np.int64)
        record_slots = tuple(copy.record_slots)

        def put() -> int:
            for key in keys:
                self.slot(key, slot_init[key])
            places = self.cold.write_records(kept, record_slots)
            try:
                self.cold.put(rest_ids, rows, slots, meta, meta["last_seen"] if lru else meta["freq"])
            except BaseException:
                self.cold.unwritten(places)  # (written, never indexed)
                raise
            self.cold.add(
                live[kept_at],
                places,
                np.full(kept_at.size, epoch, np.uint32),
                last_seen[kept_at] if lru else freq[kept_at],
            )
            if removed.size:
                self.removed.add(removed)
            self.merge_sightings(cand_ids, counts)
            return n

        return put

    def _checked(self, copy: TableCopy, patch: TablePatch, records: np.ndarray) -> np.ndarray:
        """An untiered table's checks of ``copy`` and ``patch`` (InvalidArgumentError, nothing
        changed), its records' ids counted as the copy's; returns those ids."""
        dim, dtype = self.config.dim, self.dtype
        ids = np.empty(records.size, np.int64)
        copy_field(ids, records, "id")
        if copy.records is None:
            super().checked_merge(copy, patch)  # the checks; its way of putting them in is not used
            return ids
        try:
            hot_ids = np.asarray(copy.ids if copy.ids is not None else [], np.int64).reshape(-1)
        except (ValueError, TypeError) as exc:
            raise InvalidArgumentError(f"ps/install: the ids of table {copy.name!r}'s copy: {exc}") from None
        # (the records' values, which the checks do not read, stand in as a view of one row)
        stand_in = np.broadcast_to(np.zeros(dim, dtype), (hot_ids.size + ids.size, dim))
        checked = msgspec.structs.replace(
            copy,
            ids=np.concatenate([hot_ids, ids]),
            rows=stand_in,
            slots={k: stand_in for k in set(copy.slots) | set(copy.record_slots)},
            records=None,
            record_slots=[],
        )
        super().checked_merge(checked, patch)
        checked_array(copy.rows, dtype, (hot_ids.size, dim), "the copy's rows")
        for k, values in copy.slots.items():
            checked_array(values, dtype, (hot_ids.size, dim), f"the copy's slot {k!r}")
        return ids

    def _kept_at(self, live: np.ndarray, record_ids: np.ndarray, patch: TablePatch) -> np.ndarray:
        """For each record of a copy (its id in ``record_ids``), its id's place in ``live``,
        or -1 if it is not there (removed since the copy) or the patch changed it."""
        if not record_ids.size:
            return np.empty(0, np.int64)
        where = IdIndex(live.size, self.kernels)
        where.insert(live, np.arange(live.size, dtype=np.int64))
        pos = where.get(record_ids)
        changed = np.ascontiguousarray(patch.ids if patch.ids is not None else [], np.int64)
        if changed.size:
            at = where.get(changed)
            is_changed = np.zeros(live.size, bool)
            is_changed[at[at >= 0]] = True
            pos[(pos >= 0) & is_changed[pos.clip(0)]] = -1
        return pos

    def _gathered(
        self, target: np.ndarray, copy: TableCopy, patch: TablePatch, slot_init: dict[str, float]
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The rows and slots (``slot_init``'s) of ids ``target`` from the copy's arrays, then
        the patch's over them (the newer). A copy that lists ``target`` as it is (the usual
        case) gives its arrays as they are (this table's to write), not copied."""
        dim, dtype = self.config.dim, self.dtype
        n = target.size
        whole = copy.ids is not None and np.array_equal(np.asarray(copy.ids), target)
        if whole:
            rows = _owned(copy.rows, dtype)
            slots = {
                k: _owned(copy.slots[k], dtype) if k in copy.slots else np.full((n, dim), init, dtype)
                for k, init in slot_init.items()
            }
        else:
            rows = np.zeros((n, dim), dtype)
            slots = {k: np.full((n, dim), init, dtype) for k, init in slot_init.items()}
        where: IdIndex | None = None  # target id -> its place in ``target`` (made if needed)
        for part in (patch,) if whole else (copy, patch):
            ids = np.ascontiguousarray(part.ids if part.ids is not None else [], np.int64)
            if not ids.size:
                continue
            if ids.size == n and np.array_equal(ids, target):  # (no row changed since the copy)
                rows[:] = np.asarray(part.rows, dtype)
                for k, values in part.slots.items():
                    slots[k][:] = np.asarray(values, dtype)
                continue
            if where is None:
                where = IdIndex(n, self.kernels)
                where.insert(target, np.arange(n, dtype=np.int64))
            at = where.get(ids)
            hit = at >= 0
            rows[at[hit]] = np.asarray(part.rows, dtype)[hit]
            for k, values in part.slots.items():
                slots[k][at[hit]] = np.asarray(values, dtype)[hit]
        return rows, slots

    # -- moves of slices between ps ------------------------------------------------------------------
    def _cold_in(self, moving: SliceSet) -> tuple[np.ndarray, np.ndarray]:
        """The cold slots and ids of the rows on disk in slices ``moving`` (one pass over the
        index of the rows on disk)."""
        ids, slots = self.cold.index.items()
        keep = in_slices(ids, moving.slices, moving.owned)
        return slots[keep], ids[keep]

    def copy_slices(self, moving: SliceSet) -> dict[str, Any]:
        """An untiered table's copy, and the rows of those slices on disk (both halves of
        :meth:`begin_copy` at once)."""
        out, read = self.begin_copy(moving)
        if read is not None:
            read()
        return out

    def begin_copy(self, moving: SliceSet) -> tuple[dict[str, Any], Callable[[], None] | None]:
        """A move's copy in two halves: this one, on the serving loop, copies the rows in
        RAM and takes the places of those on disk (the copy is of this moment: the caller
        marks the change clock now); the one returned, which may run on a thread, reads
        those records into the copy (records never change, and no segment goes until it
        ends: begin_read). What identifies each record read, and its bookkeeping, is kept
        for the patch (:meth:`patch_slices`)."""
        out = super().copy_slices(moving)
        slots, _ = self._cold_in(moving)
        self._copied = None
        if not slots.size:
            return out, None
        places = self.cold.places[slots]
        order = np.argsort(places)  # (distinct: any sort gives the one order, the patch's)
        places, gens = places[order], self.cold.gens[slots[order]]
        self.cold.begin_read()

        def read() -> None:
            try:
                self._copied = (moving, *self._read_copy(out, places, gens))
            finally:
                self.cold.end_read()

        return out, read

    def _read_copy(
        self, out: dict[str, Any], places: np.ndarray, gens: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The records at ``places`` into the copy ``out``; returns their ids, write numbers
        (``gens``) and bookkeeping, by id."""
        shipped = self.cold.records_at(places)
        if shipped is not None:  # the records as they lie on disk (moved_records.py)
            records, record_slots = shipped
            ids = np.empty(records.size, np.int64)
            copy_field(ids, records, "id")
            meta = np.empty(records.size, META)
            copy_field(meta, records, "epoch", "freq")
            out["records"], out["record_slots"] = records.view(np.uint8), list(record_slots)
            by_id = np.argsort(ids)
            return ids[by_id], gens[by_id], meta[by_id]
        # (records of several layouts) read in the order they lie (no scatter), each field
        # straight to the end of the copy's arrays (no concatenation after)
        hot = out["ids"].shape[0]

        def grown(arr: np.ndarray) -> np.ndarray:
            whole = np.empty((hot + places.size, *arr.shape[1:]), arr.dtype)
            whole[:hot] = arr
            return whole

        ids, rows = grown(out["ids"]), grown(out["rows"])
        slot_arrays = {k: grown(v) for k, v in out["slots"].items()}
        tails = {
            "ids": ids[hot:],
            "rows": rows[hot:],
            **{f"slot:{k}": v[hot:] for k, v in slot_arrays.items()},
        }
        got = self.cold.fill_many(places, [*tails, "meta"], dict(self.slot_init), tails)
        out["ids"], out["rows"], out["slots"] = ids, rows, slot_arrays
        by_id = np.argsort(ids[hot:])
        return ids[hot:][by_id], gens[by_id], got["meta"][by_id]

    def patch_slices(self, moving: SliceSet, mark: int) -> dict[str, Any]:
        """An untiered table's patch, with the rows on disk: every id (its age and count
        from its record), and those changed since ``mark``. A row on disk still in the
        record the copy read (same id, same write: records never change) has not changed
        since: its bookkeeping comes from the copy's read, and only the rows written to disk
        since are read again."""
        out = super().patch_slices(moving, mark)
        slots, ids = self._cold_in(moving)
        copied, self._copied = self._copied, None
        if not slots.size:
            return out
        order = np.argsort(self.cold.places[slots])  # as the copy lists them:
        slots, ids = slots[order], ids[order]  # unchanged since, the receiver takes it whole
        meta = np.empty(slots.size, META)
        known = np.zeros(slots.size, bool)
        if copied is not None and copied[0] == moving and copied[1].size:
            c_ids, c_gens, c_meta = copied[1], copied[2], copied[3]
            at = np.searchsorted(c_ids, ids).clip(0, c_ids.size - 1)
            known = (c_ids[at] == ids) & (c_gens[at] == self.cold.gens[slots])
            meta[known] = c_meta[at[known]]
        fresh = ~known
        cold = self.cold.read(self.cold.places[slots[fresh]], dict(self.slot_init))
        meta[fresh] = cold["meta"]
        out["live"] = np.concatenate([out["live"], ids])
        out["ages"] = np.concatenate([out["ages"], self.lookups - meta["last_seen"]])
        out["freq"] = np.concatenate([out["freq"], meta["freq"]])
        changed = cold["meta"]["epoch"] > mark
        out["ids"] = np.concatenate([out["ids"], cold["ids"][changed]])
        out["rows"] = np.concatenate([out["rows"], cold["rows"][changed]])
        out["slots"] = {k: np.concatenate([v, cold[f"slot:{k}"][changed]]) for k, v in out["slots"].items()}
        return out

    def drop_slices(self, moving: SliceSet) -> int:
        dropped = super().drop_slices(moving)
        _, ids = self._cold_in(moving)
        self.cold.remove(ids)
        return dropped + int(ids.size)
