"""What a tiered table does when slices of its hash space move to another ps, or a lost
ps's rows arrive (mixed into :class:`~pstrain.server.ps.tables.tiered_table.TieredTable`).

A move's copy holds both tiers. Pulled by the ps it goes to (:class:`CopyStream`), it is
taken as a save takes the table, at the copy's mark: the rows in RAM from a snapshot, then
the records of those on disk as they lie there, a block at a time, read on a thread; the
receiver writes each block to its disk as it comes (:class:`PulledToDisk`) and indexes
them at the switch. Relayed whole (a coordinator that moves the copy itself), its rows in
RAM are arrays and those on disk records (``moved_records.py``). The patch then gives what
changed since. Rows merged into a tiered shard (a move's, or a lost ps's in its
replacement) go to its disk, read back as they are looked up: records written as they
came, arrays written as a save writes.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ...._base.errors import FailedPreconditionError, InvalidArgumentError, ResourceExhaustedError
from ...._formats.numerics.idhash import in_slices
from ...._kernels.id_index import IdIndex
from .cold_records import META, copy_field, pack_records
from .cold_rows import ColdRows
from .moved_records import checked_records, kept_records, records_of
from .table_slices import SlicedRows

if TYPE_CHECKING:
    from ...._formats.messages.placement_map import SliceSet, TableCopy, TablePatch

__all__ = ["CopyStream", "PulledToDisk", "TieredSlices"]

#: Ids of a move's patch checked at a time (against the index of this shard's rows).
_CHECKED_AT_ONCE = 1 << 16


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
        ps_budget: int
        refused: int

        @property
        def by_age(self) -> bool: ...
        def _cold_fits(self, n: int) -> bool: ...
        def end_snapshot(self, save: dict[str, Any]) -> None: ...
        def _snapshot(
            self, rows: np.ndarray | None, since: int | None = None, moving: SliceSet | None = None
        ) -> dict[str, Any]: ...
        def shrink_for_cold(
            self, n: int, in_ram: int | None = None, keep: np.ndarray | None = None
        ) -> int: ...

    # -- a lost ps's rows, put in (a replacement) ---------------------------------------------------
    def checked_merge(
        self, copy: TableCopy, patch: TablePatch, pulled: PulledToDisk | None = None
    ) -> Callable[[], int]:
        """As an untiered table's (every check first, nothing changed), but the rows go to
        disk, read back as they are looked up: a lost ps's share of a table may be far more
        than the hot set. A copy's records (its source's rows on disk) not changed since are
        written as they came, their bookkeeping set; the records ``pulled`` ahead (written
        here already) are indexed where they lie, those changed since counted dead; the
        other rows go as a save writes them. ResourceExhaustedError if the budget cannot
        index them."""
        dim, dtype = self.config.dim, self.dtype
        records = records_of(copy, dim, dtype)
        if pulled is not None and records.size:
            raise InvalidArgumentError(f"ps/install: table {copy.name!r}: records both carried and pulled")
        if pulled is not None and pulled.table is not self:
            raise FailedPreconditionError(
                f"ps/install: table {copy.name!r} was replaced here while its rows were pulled "
                "(a restore?): the move is undone"
            )
        if pulled is None:
            record_ids = np.empty(records.size, np.int64)
            copy_field(record_ids, records, "id")
            blocks = [record_ids]
        else:
            blocks = [ids for ids, _ in pulled.blocks]
        live, ages, freq, removed, cand_ids, counts = self._patch_arrays(patch)
        n = live.size
        keys = set(self.slots) | set(copy.slots) | set(patch.slots) | set(copy.record_slots)
        keys |= pulled.slots if pulled is not None else set()
        slot_init = self._slot_init(copy, patch, keys)
        hot_ids, _, _ = self._part_arrays(copy, "the copy's")
        changed_ids, _, _ = self._part_arrays(patch, "the patch's")
        # each record's place in ``live``: -1 (it dies) if its row is not there, or changed since
        at = self._matched(live, blocks, hot_ids, changed_ids)
        del blocks
        self.room_on_disk(n)
        epoch = self.clock.epoch  # (in the next delta, as an untiered table's merge)
        last_seen = self.lookups - ages
        # the records of live rows the patch did not change go as they came (pulled: they
        # lie here already); the rest (the source's rows in RAM, and those changed) are
        # gathered from copy and patch
        kept = kept_records(records, at[0], epoch, last_seen, freq) if pulled is None else None
        kept_at = np.concatenate([np.empty(0, np.int64), *(a[a >= 0] for a in at)])
        rest = np.ones(n, bool)
        rest[kept_at] = False
        rest_at = np.flatnonzero(rest)
        rest_ids = live[rest_at]
        rows, slots = self._gathered(rest_ids, copy, patch, {k: slot_init[k] for k in keys})
        meta = np.zeros(rest_ids.size, META)
        meta["epoch"] = epoch
        meta["last_seen"] = last_seen[rest_at]
        meta["freq"] = freq[rest_at]
        record_slots = tuple(copy.record_slots)
        by_age = self.by_age

        def put() -> int:
            for key in keys:
                self.slot(key, slot_init[key])
            if pulled is None:
                assert kept is not None
                places = self.cold.write_records(kept, record_slots)
            else:
                places = pulled.places_of(at)
            try:
                self.cold.put(rest_ids, rows, slots, meta, meta["last_seen"] if by_age else meta["freq"])
            except BaseException:  # (written, never indexed: they die)
                if pulled is None:
                    self.cold.unwritten(places)
                else:
                    pulled.forget()
                raise
            if pulled is not None:  # (those changed since the copy die; the rest are indexed)
                pulled.merged(at)
            self.cold.add(
                live[kept_at],
                places,
                np.full(kept_at.size, epoch, np.uint32),
                last_seen[kept_at] if by_age else freq[kept_at],
            )
            if removed.size:
                self.removed.add(removed)
            self.merge_sightings(cand_ids, counts)
            return n

        return put

    def room_on_disk(self, n: int) -> None:
        """Make room in the budget for the index of ``n`` more rows on disk (the hot set
        gives RAM for it, if it can), or ResourceExhaustedError, counted."""
        if not self._cold_fits(n):
            self.shrink_for_cold(n, in_ram=0)
        if not self._cold_fits(n):
            self.refused += 1
            raise ResourceExhaustedError(
                f"dynamic table {self.name!r}: {n} more rows on disk would take their index past "
                f"this ps's budget of {self.ps_budget} bytes (pstrain serve --memory-budget)"
            )

    def _matched(
        self, live: np.ndarray, blocks: list[np.ndarray], hot_ids: np.ndarray, changed_ids: np.ndarray
    ) -> list[np.ndarray]:
        """For each block of a copy's record ids, each one's place in ``live`` (the patch's
        ids), or -1 where it is not there (removed since the copy) or the patch changed it;
        InvalidArgumentError (nothing changed) if ``live`` names an id twice or one this
        shard holds, if a record names a live id another did, or if a live id has a row in
        none of the copy's records, its arrays (``hot_ids``) and the patch's
        (``changed_ids``). One index of ``live``, at three quarters full, for all of it: no
        sort, and nothing else per row but a byte or two (a move may bring millions)."""
        n = live.size
        where = IdIndex(max(n, 1), self.kernels, fill=0.75)
        where.insert(live, np.arange(n, dtype=np.int64))
        for lo in range(0, n, _CHECKED_AT_ONCE):
            part = live[lo : lo + _CHECKED_AT_ONCE]
            if not np.array_equal(where.get(part), np.arange(lo, lo + part.size)):
                raise InvalidArgumentError("ps/install: the patch names a moved id twice")
            if bool(np.any(self.has_row(part))):
                raise InvalidArgumentError(f"ps/install: {self.name!r} already holds some moved ids")
        found, changed, taken = np.zeros(n, bool), np.zeros(n, bool), np.zeros(n, bool)
        at = where.get(changed_ids)
        found[at[at >= 0]] = changed[at[at >= 0]] = True
        at = where.get(hot_ids)
        found[at[at >= 0]] = True
        out, kept = [], 0
        for ids in blocks:
            at = where.get(ids)
            hit = at >= 0
            found[at[hit]] = True
            at[hit] = np.where(changed[at[hit]], -1, at[hit])  # (none live: every record dies)
            taken[at[at >= 0]] = True
            kept += int(np.count_nonzero(at >= 0))
            out.append(at)
        if kept != int(np.count_nonzero(taken)):
            raise InvalidArgumentError("ps/install: the copy names a moved id twice")
        if not bool(np.all(found)):
            raise InvalidArgumentError("ps/install: a moved id has no row in the copy or the patch")
        return out

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
        """An untiered table's copy, and the rows of those slices on disk, read here (both
        halves of :meth:`begin_copy` at once)."""
        out, places = self._copy_in_ram(moving)
        if places.size:
            self._read_copy(out, places)
        return out

    def begin_copy(self, moving: SliceSet) -> tuple[dict[str, Any], Callable[[], Awaitable[None]] | None]:
        """A move's copy whole, in two halves (a move a coordinator relays; a move whose rows
        are pulled a block at a time is :meth:`stream_copy`'s): this one, on the serving
        loop, copies the rows in RAM and takes the places of those on disk (the copy is of
        this moment: the caller marks the change clock now); the one returned, awaited on
        the loop, reads those records into the copy on a thread (records never change, and
        no segment goes until it ends: :meth:`_on_thread`)."""
        out, places = self._copy_in_ram(moving)
        if not places.size:
            return out, None
        return out, self._on_thread(lambda: self._read_copy(out, places))

    def _copy_in_ram(self, moving: SliceSet) -> tuple[dict[str, Any], np.ndarray]:
        """The copy but the rows on disk, and their places (ascending)."""
        out = super().copy_slices(moving)
        slots, _ = self._cold_in(moving)
        return out, np.sort(self.cold.places[slots])

    def _on_thread(self, read: Callable[[], None]) -> Callable[[], Awaitable[None]]:
        """``read`` of records whose places were taken now, to await later: it runs on a
        thread, and no segment goes from now until it ends. (The read's end runs on the
        loop: only the loop collects and deletes segments.)"""
        cold = self.cold
        cold.begin_read()

        async def run() -> None:  # (awaited once: the caller awaits every one it began)
            thread = asyncio.ensure_future(asyncio.to_thread(read))
            # ended when the thread is, even if the awaiting handler is cancelled first
            thread.add_done_callback(lambda _: cold.end_read())
            await asyncio.shield(thread)

        return run

    def _read_copy(self, out: dict[str, Any], places: np.ndarray) -> None:
        """The records at ``places`` into the copy ``out``."""
        shipped = self.cold.records_at(places)
        if shipped is not None:  # the records as they lie on disk (moved_records.py)
            records, record_slots = shipped
            out["records"], out["record_slots"] = records.view(np.uint8), list(record_slots)
            return
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
        self.cold.fill_many(places, list(tails), dict(self.slot_init), tails)
        out["ids"], out["rows"], out["slots"] = ids, rows, slot_arrays

    def stream_copy(self, moving: SliceSet) -> tuple[dict[str, Any], CopyStream]:
        """A move's copy that the receiving ps pulls a block at a time (``ps/move_records``),
        rows in RAM and on disk alike, as records: taken as a save takes the table (a
        snapshot of the rows in RAM, kept as they were by the updates that follow; the
        places of those on disk, whose records never change), of slices ``moving`` alone.
        Neither ps holds the copy whole: the receiver writes each block to its disk as it
        comes. The copy is of this moment (the caller marks the change clock now); the
        returned fields carry no rows, only how many to pull."""
        out = self._copy_of(moving, np.empty(0, np.int64))
        stream = CopyStream(self, self._snapshot(self._rows_in(moving), moving=moving))
        out["record_count"] = stream.size
        return out, stream

    def patch_slices(self, moving: SliceSet, mark: int) -> dict[str, Any]:
        """An untiered table's patch, with the rows on disk, read here (both halves of
        :meth:`begin_patch` at once)."""
        out, places = self._patch_of(moving, mark)
        if places.size:
            self._read_patch(out, places)
        return out

    def begin_patch(
        self, moving: SliceSet, mark: int
    ) -> tuple[dict[str, Any], Callable[[], Awaitable[None]] | None]:
        """:meth:`patch_slices` in two halves, as :meth:`begin_copy`: this one on the loop as
        the slices stop being served (every id, its age or count from the index of the rows
        on disk, the rows in RAM changed since ``mark``, and the places of the records on
        disk changed since); the one returned reads those records into the patch on a
        thread. Nothing of the slices changes meanwhile: they are no longer served."""
        out, places = self._patch_of(moving, mark)
        if not places.size:
            return out, None
        return out, self._on_thread(lambda: self._read_patch(out, places))

    def _patch_of(self, moving: SliceSet, mark: int) -> tuple[dict[str, Any], np.ndarray]:
        """The patch but the rows on disk changed since ``mark``, and their places."""
        out = super().patch_slices(moving, mark)
        slots, ids = self._cold_in(moving)
        if not slots.size:
            return out, np.empty(0, np.int64)
        keys = self.cold.keys_of(slots)
        zeros = np.zeros(slots.size, np.int64)
        ages, freq = (self.lookups - keys, zeros) if self.by_age else (zeros, keys)
        out["live"] = np.concatenate([out["live"], ids])
        out["ages"] = np.concatenate([out["ages"], ages])
        out["freq"] = np.concatenate([out["freq"], freq])
        return out, self.cold.places[slots[self.cold.epochs[slots] > mark]]

    def _read_patch(self, out: dict[str, Any], places: np.ndarray) -> None:
        """The records at ``places`` into the patch ``out`` (after its rows from RAM)."""
        cold = self.cold.read(places, dict(self.slot_init))
        out["ids"] = np.concatenate([out["ids"], cold["ids"]])
        out["rows"] = np.concatenate([out["rows"], cold["rows"]])
        out["slots"] = {k: np.concatenate([v, cold[f"slot:{k}"]]) for k, v in out["slots"].items()}

    def pull_sink(self, name: str) -> PulledToDisk:
        """Where the blocks of a move's copy pulled into this shard go (:class:`PulledToDisk`)."""
        return PulledToDisk(self, name)

    def drop_slices(self, moving: SliceSet) -> int:
        dropped = super().drop_slices(moving)
        _, ids = self._cold_in(moving)
        self.cold.remove(ids)
        return dropped + int(ids.size)


class CopyStream:
    """A move's copy of a tiered shard's slices (:meth:`TieredSlices.stream_copy`), read a
    block at a time (:meth:`read`, on a thread) by the ps it goes to: the rows that were in
    RAM at the mark first, from the snapshot, as records carrying the table's slots then
    (their bookkeeping 0: the patch brings it); then those on disk, as their records lie
    there. The table is as good as saved until the stream closes: its hot set gives no RAM
    meanwhile, and no segment is compacted or deleted."""

    def __init__(self, table: TieredSlices, save: dict[str, Any]) -> None:
        self.table, self.save = table, save
        first = save["ids"]
        self.hot = int(first.hot.select.size)  # (the rows in RAM selected: those of the slices)
        self.part = first.part
        self.size = self.hot + self.part.size
        self.slots = tuple(sorted(k[5:] for k in save if k.startswith("slot:")))
        self.record = table.cold.record(self.slots)
        self._lock = threading.Lock()  # (one read at a time; none once closed)
        self.closed = False

    def read(self, start: int, count: int, max_bytes: int) -> tuple[np.ndarray, tuple[str, ...]]:
        """Rows ``start`` on, at most ``count`` of them and about ``max_bytes``, as records
        of one layout (fewer where the next rows' records carry other slots), with the
        slots they carry; none past the end. FailedPreconditionError once closed."""
        with self._lock:
            if self.closed:
                raise FailedPreconditionError(
                    f"ps/move_records: the copy of table {self.table.name!r} is closed "
                    "(its move went on, or ended)"
                )
            most = min(count, max(1, max_bytes // self.record.itemsize))
            if start >= self.size:
                return np.empty(0, np.uint8), ()
            if start < self.hot:
                hi = min(self.hot, start + most)
                got = {key: src.hot.between(start, hi) for key, src in self.save.items()}
                records = pack_records(
                    self.record,
                    got["ids"],
                    np.zeros(hi - start, META),
                    got["rows"],
                    [got[f"slot:{k}"] for k in self.slots],
                )
                return records.view(np.uint8), self.slots
            lo = start - self.hot
            records, slots = self.table.cold.records_from(self.part.places.between(lo, lo + most))
            return records.view(np.uint8), slots

    def close(self) -> None:
        """The move no longer needs the copy: the table is no longer saved by it."""
        with self._lock:
            if not self.closed:
                self.closed = True
                self.table.end_snapshot(self.save)


class PulledToDisk:
    """The blocks of a move's copy pulled into a tiered shard: each written to its disk as
    it comes, as its records came (their bookkeeping is the patch's: the index keeps it at
    the switch, :attr:`TieredTable.by_age`), and indexed only at the switch
    (:meth:`TieredSlices.checked_merge`); until then :attr:`ColdRows.pending` (no segment is
    compacted), and counted dead if the move ends without it (:meth:`forget`). What a
    block costs in RAM meanwhile is its ids and places, 16 bytes a row."""

    def __init__(self, table: TieredSlices, name: str) -> None:
        self.table = table
        self.what = f"ps/move_records: table {name!r}"
        #: The ids of each block pulled, and the places its records were written at here.
        self.blocks: list[tuple[np.ndarray, np.ndarray]] = []
        self.slots: set[str] = set()
        self.count = 0

    @property
    def nbytes(self) -> int:
        return 16 * self.count

    def checked(self, raw: Any, slots: list[str]) -> np.ndarray:
        """A block received as records (InvalidArgumentError naming what is wrong)."""
        return checked_records(raw, slots, self.table.config.dim, self.table.dtype, self.what)

    def put(self, records: np.ndarray, slots: list[str]) -> None:
        """Write a block (:meth:`checked`) to disk (a full disk: ResourceExhaustedError,
        counted, nothing written)."""
        if not records.size:
            return
        table = self.table
        if table.cold.discarded:
            raise FailedPreconditionError(f"{self.what} went from this ps while its rows were pulled")
        ids = np.empty(records.size, np.int64)
        copy_field(ids, records, "id")
        try:
            places = table.cold.write_records(records, tuple(slots))
        except ResourceExhaustedError:
            table.refused += 1
            raise
        table.cold.pending += records.size
        self.blocks.append((ids, places))
        self.slots |= set(slots)
        self.count += records.size

    def places_of(self, at: list[np.ndarray]) -> np.ndarray:
        """The places of the rows kept by the switch: where ``at`` (per block, as
        :meth:`TieredSlices._matched` gives it) is not -1."""
        return np.concatenate([np.empty(0, np.int64), *(p[a >= 0] for (_, p), a in zip(self.blocks, at))])

    def merged(self, at: list[np.ndarray]) -> None:
        """The switch indexed the rows kept by ``at``; the others die."""
        for (_, places), a in zip(self.blocks, at, strict=True):
            self.table.cold.unwritten(places[a < 0])
        self._done()

    def forget(self) -> None:
        """The move ended without them: every row pulled dies (with their table, if it
        went meanwhile)."""
        if not self.table.cold.discarded:
            for _, places in self.blocks:
                self.table.cold.unwritten(places)
        self._done()

    def _done(self) -> None:
        self.table.cold.pending -= self.count
        self.table.cold.collect()
        self.blocks, self.count = [], 0
