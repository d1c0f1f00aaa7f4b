"""Slices of a dynamic table's hash space moving between ps (an elastic ps joined or
leaves): which slices a shard serves, the copy of some slices' rows, what changed in them
since, and putting them into the receiving shard.

A table part of which moved is cut into ``S`` slices (an id is in slice
``shard_of(id, S)``); the coordinator's placement map says which ps holds each. A shard
that gave slices away, or is receiving some, serves only the slices :class:`SliceGuards`
lists for it: a request with an id of another slice is refused whole, before anything
changes, with the ps's newest map (:class:`~pstrain.errors.PlacementChangedError`). The
rows, optimizer slots, LRU ages, LFU counts and admission sightings move with their ids;
an id moved is neither evicted nor admitted (the counters do not change), and the
receiving shard stamps every row it takes with its change clock, so its next delta
checkpoint holds them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Iterable
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from ...._base.errors import InvalidArgumentError, PlacementChangedError
from ...._formats.messages.placement_map import SliceSet, TableCopy, TablePatch
from ...._formats.numerics.idhash import in_slices, shard_of
from ..store import VariableStore
from .moved_records import PulledToRam, as_columns

if TYPE_CHECKING:
    from ...._kernels.id_index import IdIndex
    from ..store import ChangeClock, Snapshot
    from .removed_log import RemovedLog
    from .table_config import TableConfig

__all__ = ["SliceGuards", "SlicedRows"]


class SliceGuards:
    """The slices each table of one ps serves, for the tables part of which moved (a table
    not listed serves every id sent to it: the shard it was created as)."""

    def __init__(self, store: VariableStore) -> None:
        self.store = store
        self._masks: dict[str, tuple[int, np.ndarray]] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._masks

    def set(self, name: str, serving: SliceSet | None) -> None:
        if serving is None:
            self._masks.pop(name, None)
            return
        mask = np.zeros(serving.slices, bool)
        mask[np.asarray(serving.owned, np.int64)] = True
        self._masks[name] = (serving.slices, mask)

    def slices(self, name: str) -> int | None:
        """How many slices table ``name``'s hash space is cut in, None if it is not guarded."""
        entry = self._masks.get(name)
        return entry[0] if entry is not None else None

    def get(self, name: str) -> SliceSet | None:
        entry = self._masks.get(name)
        if entry is None:
            return None
        return SliceSet(slices=entry[0], owned=np.flatnonzero(entry[1]).tolist())

    def check(self, name: str, ids: np.ndarray) -> None:
        """Refuse (PlacementChangedError with this ps's map) ids of slices not served here."""
        entry = self._masks.get(name)
        if entry is None or not ids.size:
            return
        slices, mask = entry
        if not bool(np.all(mask[shard_of(ids, slices)])):
            self.store.refusals += 1
            raise PlacementChangedError(
                f"dynamic table {name!r}: some of these ids are in slices {self.store.task} "
                "does not hold (they moved, or are arriving)",
                placement=self.store.placement.to_builtins(),
            )


def checked_array(value: Any, dtype: Any, shape: tuple[int, ...], what: str) -> np.ndarray:
    """``value`` as ``dtype`` and ``shape`` (a -1 in it: any length; None: empty), or
    InvalidArgumentError."""
    try:
        arr = np.asarray(value) if value is not None else np.empty((0,) + shape[1:], dtype)
    except ValueError as exc:  # (ragged lists)
        raise InvalidArgumentError(f"ps/install: {what} is not an array: {exc}") from None
    if arr.ndim != len(shape) or any(want not in (-1, got) for got, want in zip(arr.shape, shape)):
        expected = str(shape).replace("-1", "any length")
        raise InvalidArgumentError(f"ps/install: {what} is {arr.shape}, expected {expected}")
    if arr.size and arr.dtype.kind not in ("biu" if np.dtype(dtype).kind in "iu" else "biuf"):
        raise InvalidArgumentError(f"ps/install: {what} is of dtype {arr.dtype}, expected {np.dtype(dtype)}")
    return arr.astype(dtype, copy=False)


def _ids(value: Any, what: str) -> np.ndarray:
    """``value`` as a vector of int64 ids (None: none)."""
    return checked_array(value, np.int64, (-1,), what)


class SlicedRows:
    """What a :class:`~pstrain.server.ps.tables.dynamic_table.DynamicTable` does when slices of
    its hash space move (mixed into it)."""

    if TYPE_CHECKING:  # the table's, as ``dynamic_table.py`` makes them
        name: str
        owner: str | None
        config: TableConfig
        dtype: np.dtype
        index: IdIndex
        clock: ChangeClock
        rows: np.ndarray
        ids: np.ndarray
        live: np.ndarray
        last_seen: np.ndarray
        freq: np.ndarray
        epochs: np.ndarray
        free: np.ndarray
        slots: dict[str, np.ndarray]
        slot_init: dict[str, float]
        saves: list[dict[str, Snapshot]]
        used: int
        nfree: int
        lookups: int
        _cand: IdIndex
        _cand_ids: np.ndarray
        _cand_counts: np.ndarray
        _cand_used: int

        def _touch(self, rows: np.ndarray) -> None: ...
        def release(self, rows: np.ndarray) -> np.ndarray: ...
        def _take_rows(self, n: int) -> np.ndarray: ...
        def _remember(self, ids: np.ndarray) -> None: ...
        def slot(self, key: str, init: float) -> np.ndarray: ...
        def positions(self, ids: np.ndarray) -> np.ndarray: ...

        removed: RemovedLog
        kernels: ModuleType

    def _rows_in(self, moving: SliceSet) -> np.ndarray:
        live = np.flatnonzero(self.live[: self.used])
        return live[in_slices(self.ids[live], moving.slices, moving.owned)]

    def _candidates_in(self, moving: SliceSet) -> tuple[np.ndarray, np.ndarray]:
        used = self._cand_used
        ids, counts = self._cand_ids[:used], self._cand_counts[:used]
        keep = (counts > 0) & in_slices(ids, moving.slices, moving.owned)
        return ids[keep].copy(), counts[keep].copy()

    def copy_slices(self, moving: SliceSet) -> dict[str, Any]:
        """The rows of slices ``moving`` as they are now (copies): a ``TableCopy``'s fields (the
        ages, counts and sightings come with the patch, as they are at the switch)."""
        return self._copy_of(moving, self._rows_in(moving))

    def _copy_of(self, moving: SliceSet, rows: np.ndarray) -> dict[str, Any]:
        """A ``TableCopy``'s fields for slices ``moving``, with copies of ``rows``."""
        return {
            "name": self.name,
            "config": self.config.as_dict(),
            "owner": self.owner,
            "moving": moving,
            "ids": self.ids[rows],
            "rows": self.rows[rows],
            "slots": {k: a[rows] for k, a in self.slots.items()},
            "slot_init": dict(self.slot_init),
        }

    def begin_copy(self, moving: SliceSet) -> tuple[dict[str, Any], Callable[[], Awaitable[None]] | None]:
        """:meth:`copy_slices`, and what to await for the rest of it, read off the serving
        loop (a tiered table's rows on disk; here, nothing: None)."""
        return self.copy_slices(moving), None

    def begin_patch(
        self, moving: SliceSet, mark: int
    ) -> tuple[dict[str, Any], Callable[[], Awaitable[None]] | None]:
        """:meth:`patch_slices`, and what to await for the rest of it, as :meth:`begin_copy`."""
        return self.patch_slices(moving, mark), None

    def patch_slices(self, moving: SliceSet, mark: int) -> dict[str, Any]:
        """What slices ``moving`` hold now, against their copy taken at ``mark``: every live id
        (with LRU ages and LFU counts), the rows changed since, the sightings."""
        rows = self._rows_in(moving)
        changed = rows[self.epochs[rows] > mark]
        cand_ids, cand_counts = self._candidates_in(moving)
        evicted = self.removed.kept()
        return {
            "name": self.name,
            "live": self.ids[rows],
            "ages": self.lookups - self.last_seen[rows],
            "freq": self.freq[rows],
            "ids": self.ids[changed],
            "rows": self.rows[changed],
            "slots": {k: a[changed] for k, a in self.slots.items()},
            "cand_ids": cand_ids,
            "cand_counts": cand_counts,
            "slot_init": dict(self.slot_init),
            "removed": evicted[in_slices(evicted, moving.slices, moving.owned)],
        }

    def drop_slices(self, moving: SliceSet) -> int:
        """Forget the rows and sightings of slices ``moving`` (they live on another ps now):
        not evictions (not counted, not in the next delta's removed ids)."""
        rows = self._rows_in(moving)
        self.release(rows)
        cand_ids, _ = self._candidates_in(moving)
        if cand_ids.size:
            self._cand_counts[self._cand.get(cand_ids)] = 0
            self._cand.delete(cand_ids)
        return int(rows.size)

    def has_row(self, ids: np.ndarray) -> np.ndarray:
        """Which of ``ids`` have a row here."""
        return self.positions(ids) >= 0

    def merge_sightings(self, cand_ids: np.ndarray, counts: np.ndarray) -> None:
        """The admission sightings a move brings (at its switch), for ids with neither a
        row nor sightings here."""
        if not cand_ids.size:
            return
        fresh = (self._cand.get(cand_ids) < 0) & ~self.has_row(cand_ids)
        if fresh.any():
            self._remember(cand_ids[fresh])
            known = self._cand.get(cand_ids[fresh])  # (the oldest may be forgotten at once)
            self._cand_counts[known[known >= 0]] = counts[fresh][known >= 0]

    def merge_slices(self, copy: TableCopy, patch: TablePatch) -> int:
        """Put the rows of ``copy``, brought up to date by ``patch``, into ``table`` (checked
        whole first: nothing changes if any part is wrong). Returns rows put in."""
        return self.checked_merge(copy, patch)()

    def pull_sink(self, name: str) -> Any:
        """Where the blocks of a move's copy pulled into this shard go until its switch
        (:class:`~pstrain.server.ps.tables.moved_records.PulledToRam`)."""
        return PulledToRam(name, self.config.dim, self.dtype)

    @staticmethod
    def _patch_arrays(patch: TablePatch) -> tuple[np.ndarray, ...]:
        """The arrays of ``patch`` checked (InvalidArgumentError naming what is wrong): its
        live ids, their ages and counts, the ids removed, the sightings and their counts."""
        live = _ids(patch.live, "live")
        n = live.size
        ages = checked_array(patch.ages, np.int64, (n,), "ages")
        freq = checked_array(patch.freq, np.int64, (n,), "freq")
        removed, cand_ids = _ids(patch.removed, "removed"), _ids(patch.cand_ids, "cand_ids")
        counts = checked_array(
            patch.cand_counts if cand_ids.size else None, np.int64, cand_ids.shape, "cand_counts"
        )
        return live, ages, freq, removed, cand_ids, counts

    def _part_arrays(
        self, part: TableCopy | TablePatch, what: str
    ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """The ids, rows and slots of a copy's arrays or a patch's, checked."""
        dim, dtype = self.config.dim, self.dtype
        ids = _ids(part.ids, f"{what} ids")
        rows = checked_array(part.rows if ids.size else None, dtype, (ids.size, dim), f"{what} rows")
        slots = {
            k: checked_array(a if ids.size else None, dtype, (ids.size, dim), f"{what} slot {k!r}")
            for k, a in part.slots.items()
        }
        return ids, rows, slots

    def _slot_init(self, copy: TableCopy, patch: TablePatch, more: Iterable[str] = ()) -> dict[str, float]:
        """The initial value of each slot, this table's, the copy's and the patch's:
        InvalidArgumentError if a slot of the copy, the patch or ``more`` has none."""
        slot_init = {**self.slot_init, **copy.slot_init, **patch.slot_init}
        if (set(copy.slots) | set(patch.slots) | set(more)) - set(slot_init):
            raise InvalidArgumentError("ps/install: a moved slot has no initial value")
        return slot_init

    def checked_merge(self, copy: TableCopy, patch: TablePatch, pulled: Any = None) -> Callable[[], int]:
        """Check ``copy`` (with the blocks of it ``pulled``, if any: :meth:`pull_sink`'s)
        and ``patch`` whole (InvalidArgumentError naming what is wrong, and nothing changed)
        and return what puts them in, which nothing sent can make fail: a move checks every
        table's before it serves anything. Each row is written once, from the copy or the
        patch, straight into the table's arrays."""
        # (rows on disk at a tiered source: as records, in the copy or pulled)
        copy = as_columns(copy, self.config.dim, self.dtype) if pulled is None else pulled.into(copy)
        live, ages, freq, removed, cand_ids, counts = self._patch_arrays(patch)
        n = live.size
        slot_init = self._slot_init(copy, patch)
        # (where in ``live``, or None: all of it in order; which source row; the source's arrays)
        puts: list[tuple[np.ndarray | None, np.ndarray | None, np.ndarray, dict[str, np.ndarray]]] = []
        found = np.zeros(n, bool)
        for part, what in ((copy, "the copy's"), (patch, "the patch's")):
            ids, rows, slots = self._part_arrays(part, what)
            if not ids.size:
                continue
            if ids.size == n and np.array_equal(ids, live):  # (nothing changed between the two)
                puts.append((None, None, rows, slots))
                found[:] = True
                continue
            order = np.argsort(ids, kind="stable")
            at = order[np.searchsorted(ids, live, sorter=order).clip(0, ids.size - 1)]
            hit = ids[at] == live
            puts.append((np.flatnonzero(hit), at[hit], rows, slots))
            found |= hit
        if not bool(np.all(found)):
            raise InvalidArgumentError("ps/install: a moved id has no row in the copy or the patch")
        if self.kernels.unique_first(live)[0].size != n:  # (a hash set: a sort took 10x longer)
            raise InvalidArgumentError("ps/install: the patch names a moved id twice")
        if n and bool(np.any(self.has_row(live))):
            raise InvalidArgumentError(f"ps/install: {self.name!r} already holds some moved ids")

        def put() -> int:
            for key in set(copy.slots) | set(patch.slots):
                self.slot(key, slot_init[key])
            rows = self._take_rows(n)
            if self.saves:
                self._touch(rows)
            # fresh rows are consecutive: written by slices (a copy at memory speed, no gather)
            to: slice | np.ndarray = (
                slice(int(rows[0]), int(rows[0]) + n)
                if n and int(rows[-1]) - int(rows[0]) == n - 1 and bool(np.all(np.diff(rows) == 1))
                else rows
            )
            for key, arr in self.slots.items():
                arr[to] = self.slot_init[key]
            for where, src, values, slots in puts:
                if where is None:
                    self.rows[to] = values
                    for key, arr in slots.items():
                        self.slots[key][to] = arr
                else:
                    self.rows[rows[where]] = values[src]
                    for key, arr in slots.items():
                        self.slots[key][rows[where]] = arr[src]
            self.ids[to], self.live[to] = live, True
            self.last_seen[to], self.freq[to] = self.lookups - ages, freq
            self.epochs[to] = self.clock.epoch
            self.index.insert(live, rows)
            if removed.size:
                self.removed.add(removed)
            self.merge_sightings(cand_ids, counts)
            return n

        return put

    #: Whether the shard's share of the capacity is no longer the one it was created with
    #: (slices moved, or a restore shared the capacity by the rows each ps restored).
    capacity_reshared = False

    def with_capacity(self, capacity: int | None) -> None:
        """The shard's share of the table's capacity changed (slices moved, or a restore
        shared the table's capacity by the rows each ps holds)."""
        if capacity != self.config.capacity:
            self.config = dataclasses.replace(self.config, capacity=capacity)
            self.capacity_reshared = True
