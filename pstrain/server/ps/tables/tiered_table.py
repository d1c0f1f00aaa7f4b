"""A dynamic table's shard larger than the memory it may use: a hot set in RAM, the rest on
local disk (:class:`~pstrain.server.ps.tables.cold_rows.ColdRows`).

A :class:`TieredTable` is a :class:`~pstrain.server.ps.tables.dynamic_table.DynamicTable`
whose RAM part is held within the ps's byte budget. When a training lookup admits rows
and the hot set has no room, the hot rows looked up least recently (LRU) or least often
(LFU), never those of the request, move to disk with their optimizer slots and
bookkeeping (*demoted*). A request that names rows on disk gets them back first
(*promoted*): the ps reads them on a thread (:meth:`cold_wanted`, :meth:`promote`, which
``TableHandlers.stage`` calls before the request's handler), so the handler itself, which
runs in one step on the serving loop, finds every row in RAM. A lookup that does not train
(evaluation, serving) moves nothing: its rows on disk are read on a thread the same way and
left there (:meth:`_read_through`). A row evicted (past the table's capacity, or
``max_age``) leaves the disk too, the coldest first.

The budget: the hot arrays grow while what the ps holds in RAM (its tables, variables and
indexes), the indexes of rows on disk aside, stays within ``HOT_SHARE`` of
``--memory-budget`` (those indexes have the rest). When the index of the rows on disk
needs more than that, the hot set gives it RAM before a request
(:meth:`TieredTable.shrink_for_cold`: its coldest rows go to disk, its arrays get
smaller), down to ``HOT_FLOOR`` of the budget, and grows back once the index is within its
share again. A variable or optimizer slot the budget has no room for gets RAM from the
hot set the same way (:meth:`TieredTable.give_back`, which ``TableHandlers.give_room``
calls). Past the budget a lookup that would admit rows is refused whole with
:class:`~pstrain.errors.ResourceExhaustedError` (counted), as is one whose rows cannot all
be in RAM at once. Saves and deltas write the rows of both tiers into the same files as
an untiered table's (the disk part streamed from its segments, ``tiered_saves.py``; a
full save links the checkpoint files a restore linked in rather than write their rows),
so restores, ``load_variables`` and the serving feed read them as they read any table. Slices moving
to another ps (a join, a drain) take their rows on disk with them, and rows merged into a
tiered shard (a move's, or a lost ps's in its replacement) go to its disk
(``tiered_slices.py``).
"""

from __future__ import annotations

import os
import time
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, NoReturn, cast

import numpy as np

from ...._base.errors import InvalidArgumentError, ResourceExhaustedError
from ...._formats.files.direct_writes import ALIGN, CHUNK
from ...._kernels.id_index import IdIndex
from ..checkpoints.snapshots import Snapshot
from ..store import ChangeClock
from .cold_places import MaskedPlaces
from .cold_records import META, scatter_rows
from .cold_rows import ColdRows, resize_rows
from .dynamic_table import EVICT_BATCH, DynamicTable, Found
from .table_config import TableConfig
from .tiered_saves import SAVE_BLOCK, ColdPart, TieredSource
from .tiered_slices import TieredSlices

if TYPE_CHECKING:
    from ...._formats.messages.placement_map import SliceSet

__all__ = ["HOT_SHARE", "REQUEST_ROOM", "Tiering", "TieredTable"]

#: Records a lookup that does not train reads at a time (whole records, of which it keeps the
#: rows): 16,384 of W9's 288 bytes are 4.5 MiB.
READ_THROUGH_PIECE = 1 << 14

#: Of a ps's ``--memory-budget``, what is kept for the arrays of requests in flight (rows
#: gathered for a reply, a decoded update, a save's staging) beside what it holds: its
#: variables and tables hold at most the rest (:attr:`Tiering.limit`).
REQUEST_ROOM = 1 / 16

#: Of a ps's ``--memory-budget``, what its tables' hot rows (and everything else it holds)
#: may grow to; the rest is kept for the indexes of rows on disk (50 to 75 bytes a row:
#: half the budget indexes about eight times the rows the other half holds, for rows of
#: 32 floats with one slot), which may take more from the hot set (``HOT_FLOOR``).
HOT_SHARE = 0.5
#: What the hot set keeps of the budget at least, once the index of the rows on disk has
#: grown past its share and taken RAM from the hot set (:meth:`TieredTable.shrink_for_cold`).
HOT_FLOOR = 1 / 8
#: A hot row's share of the index of the rows in RAM, at its emptiest (four slots of 16
#: bytes, as a growth leaves it): while the index need not grow. A growth takes its new
#: slots at once, beside the old until it is rebuilt (:meth:`TieredTable._hot_limit`).
INDEX_ROW_BYTES = 64
#: Bytes of bookkeeping per hot row besides its values and slots (ids, ages, counts,
#: epochs, marks, live, its share of the index).
HOT_ROW_EXTRA = 8 + 8 + 8 + 4 + 1 + 1 + INDEX_ROW_BYTES
#: Optimizer slots a row in RAM is budgeted for (Adam's and FTRL's two; Adagrad has one).
SLOTS = 2
#: Characters of a table's quoted name in its tier's directory name (after its serial).
NAME_CHARS = 160
#: Rows moved at a time when a shard's rows in RAM are compacted (a copy of each block).
COMPACT_ROWS = 1 << 14


@dataclass(frozen=True)
class Tiering:
    """A ps's tiered tables: its byte budget and the directory of its rows on disk (this
    ps's own: ``pstrain serve`` makes one per process under ``--table-dir``)."""

    budget: int
    directory: str
    segment_rows: int = 1 << 20

    @property
    def limit(self) -> int:
        """What the ps's variables and tables may hold in RAM: the budget less
        ``REQUEST_ROOM``."""
        return self.budget - int(self.budget * REQUEST_ROOM)

    @property
    def save_bytes(self) -> int:
        """What a save on this ps stages at a time (:func:`save_bytes`)."""
        return save_bytes(self.budget)

    def table_directory(self, name: str, serial: int) -> str:
        """Where the shard of table ``name`` made ``serial``-th keeps its rows (a restore
        staged beside a live shard gets its own). The serial makes it unique; the name, for
        a reader of the directory, is cut to ``NAME_CHARS`` (a table's name may be 1,024
        characters, and three times that quoted: a file name has 255 bytes at most)."""
        return os.path.join(self.directory, f"{serial}-{urllib.parse.quote(name, safe='')[:NAME_CHARS]}")


def save_bytes(budget: int) -> int:
    """The bytes a save (or a delta) stages at a time on a ps under ``budget``: 1/32 of it,
    within 64 KiB and ``CHUNK`` (8 MiB), whole pages. A save's blocks, read from the hot
    set and from disk and written, come on top of what the budget holds: at 1/32 each,
    the few of them stay within the RSS the budget allows (+15 %)."""
    return max(64 << 10, min(CHUNK, budget // 32 // ALIGN * ALIGN))


def _largest(lo: int, hi: int, fits: Callable[[int], bool]) -> int | None:
    """The largest of ``lo`` .. ``hi`` that ``fits`` (true up to some size, false past it),
    or None if not even ``lo`` does: a bisection."""
    if not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


class TieredTable(TieredSlices, DynamicTable):
    """A dynamic table's shard with its hot set in RAM and the rest on disk; see the
    module docstring. ``budget``: what the ps may hold in RAM (:attr:`Tiering.limit`: its
    ``--memory-budget`` less the room kept for requests in flight); ``ps_budget``: the
    ``--memory-budget`` itself, which statistics and refusals name (``budget`` if not
    given); ``held``: what the ps holds in RAM now (its variables, every table's arrays and
    indexes), in bytes; ``cold_index``: what of that the indexes of its tables' rows on
    disk take (the budget's other share; this table's own if not given)."""

    def __init__(
        self,
        name: str,
        config: TableConfig,
        owner: str | None = None,
        kernels: ModuleType | None = None,
        clock: ChangeClock | None = None,
        *,
        directory: str,
        budget: int,
        held: Callable[[], int],
        cold_index: Callable[[], int] | None = None,
        segment_rows: int = 1 << 20,
        ps_budget: int | None = None,
        shed: Callable[[], bool] | None = None,
    ) -> None:
        super().__init__(name, config, owner, None, kernels, clock)  # the budget limits it, not a size
        self.budget = budget
        self.ps_budget = budget if ps_budget is None else ps_budget
        self.held = held
        self.save_block_bytes = save_bytes(self.ps_budget)
        self.cold = ColdRows(
            directory, config.dim, self.dtype, segment_rows=segment_rows, kernels=self.kernels
        )
        self.cold_index = cold_index or (lambda: self.cold.nbytes)
        #: Forgets the older half of the sightings of the ps's table that remembers the most
        #: (this one's if not given), for rows that need the room: whether there were any.
        self.shed = shed or self.shed_sightings
        self.promoted = self.demoted = self.refused = 0
        self.made_back = 0  # rows put back in RAM made again, as the table made them, not read
        self.shrunk = 0  # times the hot set gave RAM to the index of the rows on disk
        #: The rows the hot set may hold since it last gave RAM to the index of the rows on
        #: disk (it would take back what it gave, to give it again at the next request).
        self.hot_cap: int | None = None
        self.looked_up = 0  # ids of training lookups (the hit rate: 1 - promoted / looked_up)
        self.loop_reads = 0  # reads from disk on the serving loop (no stage before the handler)
        #: Rows a stage read from the page cache on the serving loop, no thread (the rest of
        #: ``cold.rows_read`` came on a thread, or on the loop without a stage: ``loop_reads``)
        self.rows_from_page_cache = 0
        self.compacting = False  # a segment's live rows being copied (``TableHandlers.compact``)
        self.compacted = 0  # rows copied out of half-dead segments
        self.cold_latency: list[float] = []  # seconds of each cold read (the last 1024)
        self.read_through = 0  # rows on disk served where they lie, to lookups that do not train
        #: The rows on disk a stage read on a thread for the lookup that does not train after
        #: it (no await between): their places, ascending, and rows (:meth:`_read_through`).
        self.read_ahead: tuple[np.ndarray, np.ndarray] | None = None
        self._keep_statistics()

    def __len__(self) -> int:
        return len(self.index) + len(self.cold)

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.cold.nbytes

    def _keep_statistics(self) -> None:
        """Have training lookups keep what chooses the hot set (each row's last lookup, or
        its count of them and its last lookup, which breaks the count's ties), whether or
        not the table evicts: an untiered table without a capacity or ``max_age`` keeps
        neither, and its hot set was then the rows that came into RAM last, not those looked
        up last."""
        self._ages = True
        if not self.by_age:
            self._counts = True

    @property
    def by_age(self) -> bool:
        """Whether rows go to disk by their last lookup (LRU, or an age limit), not by their
        count of lookups (LFU): the key the index of the rows on disk keeps for each, which
        says, with the epoch it keeps, what a row's record there would (the record's own
        bookkeeping may be older: a move's rows, written as they came)."""
        return self.config.evict == "lru" or self.config.max_age is not None

    def hot_row_bytes(self) -> int:
        """What a row in RAM may take: its values, ``SLOTS`` optimizer slots' (or more, if it
        has more; slots come with the first update, for every row allocated) and
        ``HOT_ROW_EXTRA``."""
        return self.config.dim * self.dtype.itemsize * (1 + max(SLOTS, len(self.slots))) + HOT_ROW_EXTRA

    # -- the budget ----------------------------------------------------------------------------
    def _next_size(self, need: int) -> int:
        """Doubling, within ``HOT_SHARE`` of the budget (``need`` at least: :meth:`_hot_room`
        checked it fits) and the capacity."""
        most = self._hot_limit()
        want = max(need, min(max(self.alloc * 2, 1024), most))
        if self.config.capacity is not None:
            want = min(want, max(self.config.capacity, need))
        return want

    def _hot_limit(self) -> int:
        """Rows the hot set may hold now: what is allocated, and what the budget's hot
        share lets it grow to (and the budget itself, should the indexes of rows on disk
        have taken more than their share)."""
        held = self.held()
        cold_index = self.cold_index()
        room = self.budget - held
        spare = max(0, min(int(self.budget * HOT_SHARE) - (held - cold_index), room))
        limit = self.alloc + spare // self.hot_row_bytes()
        holds = self.index.holds
        if limit > holds:  # the index of the rows in RAM grows at once to hold them (its new
            # slots beside the old while it is rebuilt), where ``HOT_ROW_EXTRA`` reckons a
            # row's share: as far as the budget has room for that and the arrays, or no
            # further than the index holds without growing
            left = room - self.index.nbytes_holding(limit)
            fits = self.alloc + max(0, left) // (self.hot_row_bytes() - INDEX_ROW_BYTES)
            limit = min(limit, fits) if left >= 0 and fits > holds else holds
        if self.hot_cap is not None:  # given to the index of the rows on disk: kept for it
            if cold_index <= self.budget * (1 - HOT_SHARE):  # until it is back within its share
                self.hot_cap = None
            else:
                limit = min(limit, max(self.hot_cap, self.alloc))
        return limit

    def held_hot(self) -> int:
        """What the ps holds in RAM besides the indexes of rows on disk: what the budget's
        hot share covers."""
        return self.held() - self.cold_index()

    def _cold_fits(self, n: int) -> bool:
        """Whether ``n`` more rows on disk keep the ps within its budget, their index and
        arrays grown as they would grow."""
        return self._fits_grown(n, 0)

    def _fits_grown(self, moving: int, grow: int) -> bool:
        """Whether ``moving`` more rows on disk, and the hot arrays grown by ``grow`` rows
        after them, keep the ps within its budget."""
        held = self.held() - self.cold.nbytes + self.cold.nbytes_with(moving)
        return held + grow * self.hot_row_bytes() <= self.budget

    def holds_at_once(self, needed: int) -> None:
        """ResourceExhaustedError, counted, if ``needed`` rows cannot be in RAM at once (a
        request's rows in RAM and those it would bring back): asked before anything is read
        for it, as :meth:`promote` would refuse it after."""
        limit = self._hot_limit()
        while needed > limit and self.shed():
            limit = self._hot_limit()
        if needed > limit:
            self._refuse_at_once(needed, limit)

    def _sightings_room(self, n: int) -> None:
        """The sightings of ids not admitted yet (``admit_after``) count in the budget and
        give way to rows: while counting ``n`` more would take the ps past the budget, the
        oldest half of the largest table's sightings is forgotten (as past
        ``max_candidates``) and its memory given back."""
        while self.held() + self._sightings_growth(n) > self.budget and self.shed():
            pass

    def _sightings_growth(self, n: int) -> int:
        """Bytes the sightings grow by to count ``n`` more ids (the slots doubled, the
        index rebuilt beside the old one), as :meth:`_room_for` and ``count_sightings``
        grow them."""
        grow = (self._slots_for(n) - self._cand_counts.size) * 16  # (an id and a count a slot)
        if self._cand.holds < len(self._cand) + n:
            grow += self._cand.nbytes_holding(len(self._cand) + n)
        return grow

    def _refuse_at_once(self, needed: int, limit: int) -> NoReturn:
        self.refused += 1
        raise ResourceExhaustedError(
            f"dynamic table {self.name!r}: a request needs {needed} rows in RAM at "
            f"once, and the hot set of this shard holds {limit} within the ps's budget of "
            f"{self.ps_budget} bytes (pstrain serve --memory-budget): raise the budget, shard "
            "the table over more ps, or send smaller batches"
        )

    def _hot_room(self, n: int, protect: np.ndarray) -> None:
        """Make room in RAM for ``n`` more rows, moving hot rows not in ``protect`` to disk;
        ResourceExhaustedError (nothing changed) if they cannot fit."""
        self.demote(self._to_move(n, protect))

    def _to_move(self, n: int, protect: np.ndarray, freeing: np.ndarray | None = None) -> np.ndarray:
        """The hot rows (none of ``protect``) to move to disk to make room in RAM for ``n``
        more, checked against the budget: ResourceExhaustedError, counted, if they cannot fit.
        ``freeing``: ids on disk taken out of its index before the rows move there (a
        promotion's), whose slots they take; where the budget has no room for that index to
        grow, the rows moved out are the coldest whose ids fall in its parts as those leave
        room (:meth:`_coldest_in_room`): as many out as in then needs no more RAM."""
        limit = self._hot_limit()
        free = limit - len(self.index)
        if n <= free:
            return np.empty(0, np.int64)
        if n > limit - protect.size:
            if self.shed():  # their memory may be room enough for these rows
                return self._to_move(n, protect, freeing)
            self._refuse_at_once(n + protect.size, limit)
        picked: dict[int, np.ndarray] = {}  # the rows found for a count that fits only as
        # :meth:`_coldest_in_room` chose them (any coldest fit the other reckoning)

        def fits(moving: int, grow: int) -> bool:
            if self._fits_grown(moving, grow):  # reckoned as if no slot were freed: more RAM
                picked.pop(moving, None)
                return True
            if freeing is None or moving > freeing.size:
                return False
            rows = self._coldest_in_room(moving, protect, freeing)  # grows no part of the index
            held = self.held() - self.cold.nbytes + self.cold.nbytes_after(self.ids[rows], freeing)
            if rows.size < moving or held + grow * self.hot_row_bytes() > self.budget:
                return False
            picked[moving] = rows
            return True

        moving = max(n - free, min(len(self.index) - protect.size, max(1, limit // EVICT_BATCH)))
        if not fits(moving, 0):  # a batch is too many: just what this request needs
            moving = n - free
        unused = self.alloc - len(self.index)  # rows allocated and free: placed without growing
        if moving < n - unused and not fits(moving, n - unused - moving):
            # the hot arrays' growth for the rest would take the room the rows moving to
            # disk need (both were reckoned against what the ps holds now): grow none
            moving = min(n - unused, len(self.index) - protect.size)
        if not fits(moving, max(0, n - unused - moving)):
            if self.shed():  # their memory may be room enough for these rows
                return self._to_move(n, protect, freeing)
            self.refused += 1
            during = (
                " (a save is reading this table: the rows in RAM give none of theirs to that index "
                "until it ends, so the request may be tried again then)"
                if self.saves and self.alloc > self._hot_floor(n)
                else ""
            )
            raise ResourceExhaustedError(
                f"dynamic table {self.name!r}: moving {moving} more rows to disk would take the "
                f"index of the rows on disk past the ps's budget of {self.ps_budget} bytes{during} "
                "(pstrain serve --memory-budget): raise the budget, give the table a capacity, "
                f"{self._smaller_batches(n)}or shard it over more ps"
            )
        return picked[moving] if moving in picked else self._coldest(moving, protect)

    def _coldest_in_room(self, n: int, protect: np.ndarray, freeing: np.ndarray) -> np.ndarray:
        """:meth:`_coldest` of ``n`` hot rows whose ids fall in each part of the disk's index
        no more often than it takes them without growing, once ids ``freeing`` have left it
        (each part's coldest first): rows moved out for as many put back, which grow that
        index none. Fewer if the coldest rows' parts do not allow ``n``."""
        index = self.cold.index
        room = index.room_after(freeing)
        movable = len(self.index) - protect.size
        got = np.empty(0, np.int64)
        for more in (2, 8):
            rows = self._coldest(min(movable, more * n), protect)
            if self.by_age:  # coldest first
                rows = rows[np.argsort(self.last_seen[rows], kind="stable")]
            else:  # (the fewest lookups, the least recent of those first)
                rows = rows[np.lexsort((self.last_seen[rows], self.freq[rows]))]
            part = index.parts_of(self.ids[rows])
            by_part = np.argsort(part, kind="stable")
            grouped = part[by_part]
            rank = np.empty(rows.size, np.int64)  # each row's place among its part's, coldest first
            rank[by_part] = np.arange(rows.size) - np.searchsorted(grouped, grouped)
            got = rows[rank < room[part]][:n]
            if got.size == n or rows.size == movable:
                break
        return np.sort(got)

    # -- RAM shared with the ps's other tiered tables ---------------------------------------------
    def hot_short(self, n: int) -> int:
        """Rows the hot set lacks to hold ``n`` rows at once and as many again (0 if it can
        grow to that within the budget's RAM half): what another table must give back.
        (Its arrays' size first: what every request asks, and the budget's arithmetic sums
        all the ps holds.)"""
        if self.alloc >= 2 * n:
            return 0
        return max(0, 2 * n - self._hot_limit())

    def give_back(self, nbytes: int, keep: np.ndarray | None = None, floor: int = 0) -> int:
        """Free about ``nbytes`` of RAM for another table or a variable on this ps: the
        coldest rows (none of the ids ``keep``: a request's, staged in RAM) move to disk,
        then the rows in RAM move to the first places and the hot arrays are made smaller
        (:meth:`_pack_hot`), to no fewer than ``floor`` rows. Returns the bytes freed:
        none while a save reads the arrays (its snapshots go by place), or if the disk
        index cannot take the rows."""
        if self.saves or not self.alloc:
            return 0
        before = self.nbytes - self.cold.nbytes
        target = max(0, floor, self.alloc - -(-nbytes // self.hot_row_bytes()))
        if target >= self.alloc:
            return 0
        surplus = len(self.index) - target
        if surplus > 0:
            if not self._cold_fits(surplus):
                return 0
            try:
                self.demote(self._coldest(surplus, self._rows_in_ram(keep)))
            except ResourceExhaustedError:  # a full disk: nothing moved (demote writes first)
                return 0
        self._pack_hot(max(target, len(self.index), 1))
        return max(0, before - (self.nbytes - self.cold.nbytes))

    def _pack_hot(self, size: int) -> None:
        """Move the rows in RAM to the first ``len(self)`` places, in order, and make every
        per-row array ``size`` rows. Rows found before are looked for again: the index is
        made anew with its counts moved on (a cached place is never taken for current)."""
        keep = np.flatnonzero(self.live[: self.used])
        n = keep.size
        holders = [
            (self.__dict__, k) for k in ("rows", "ids", "live", "last_seen", "freq", "epochs", "marks")
        ] + [(self.slots, k) for k in self.slots]
        for where, key in holders:
            arr = where[key]
            for lo in range(0, n, COMPACT_ROWS):  # in place: each row moves to a lower place
                hi = min(n, lo + COMPACT_ROWS)
                arr[lo:hi] = arr[keep[lo:hi]]
            del arr  # (the holder's alone: resized in place, unless a view of it is out)
            resize_rows(where, key, size)
        self.live[n:] = False
        self.marks[n:] = 0
        self.alloc, self.used, self.nfree = size, n, 0
        inserted, removed = self.index.inserted, self.index.removed
        del self.index  # its RAM goes back before the new one takes its own
        self.index = IdIndex(max(size, 1), self.kernels)  # (not to grow while the rows fit the arrays)
        self.index.insert(self.ids[:n], np.arange(n, dtype=np.int64))
        self.index.inserted, self.index.removed = inserted + n + 1, removed + n + 1
        self._looked_up.clear()

    def _coldest(self, n: int, protect: np.ndarray) -> np.ndarray:
        """The ``n`` hot rows looked up least recently (LRU) or least often (LFU, its ties the
        least recently), none of ``protect``: the rows that go to disk first."""
        return self._victims(n, protect, self.by_age)

    def demote(self, rows: np.ndarray) -> None:
        """Move hot ``rows`` to disk (written first: a full disk changes nothing)."""
        if rows.size:
            self._moved_out(rows, *self._write_out(rows))

    def _moved_out(
        self,
        rows: np.ndarray,
        ids: np.ndarray,
        places: np.ndarray,
        meta: np.ndarray,
        keys: np.ndarray,
        made: np.ndarray | None,
    ) -> None:
        """Hot ``rows``, whose records :meth:`_write_out` wrote, indexed on disk and let go in RAM."""
        self.cold.add(ids, places, meta["epoch"], keys, as_made=made)
        self.release(rows)
        self.demoted += rows.size

    def _write_out(
        self, rows: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """Write hot ``rows``' records to disk, not yet indexed there: their ids, places,
        ``META`` records, eviction keys and which are rows as the table made them
        (:meth:`_as_made`) (a full disk: ResourceExhaustedError, counted, nothing changed)."""
        meta = np.zeros(rows.size, META)
        meta["epoch"], meta["last_seen"], meta["freq"] = (
            self.epochs[rows],
            self.last_seen[rows],
            self.freq[rows],
        )
        ids = self.ids[rows]
        try:
            places = self.cold.write(ids, self.rows, self.slots, meta, where=rows)
        except ResourceExhaustedError:
            self.refused += 1
            raise
        return ids, places, meta, meta["last_seen"] if self.by_age else meta["freq"], self._as_made(rows, ids)

    def _as_made(self, rows: np.ndarray, ids: np.ndarray) -> np.ndarray | None:
        """Which hot ``rows`` (of ``ids``) hold what :meth:`_create` made them, bit for bit:
        their initial values and slots, a count of 0 (the rows of a table made ahead of its
        training, never trained since). A promotion makes those again rather than read
        their records (:meth:`read_cold`). Only where the record's other field is all a
        promotion takes from it: a count of lookups (a table that moves rows to disk by
        their last lookup); an LFU table's records keep their last lookups, which differ."""
        if not self.by_age or not rows.size:
            return None
        made = np.empty(rows.size, np.uint8)
        slots, inits = self._slot_inits()
        self.kernels.as_created(rows, ids, self.rows, slots, inits, self.freq, *self.initial_formula, made)
        return made.view(bool)

    # -- RAM given to the index of the rows on disk -------------------------------------------------
    def _hot_floor(self, n: int) -> int:
        """Rows the hot set keeps room for whatever the index of the rows on disk needs:
        ``HOT_FLOOR`` of the budget, and a request of ``n`` rows in RAM twice over."""
        return max(2 * n, int(self.budget * HOT_FLOOR) // self.hot_row_bytes())

    def _smaller_batches(self, n: int) -> str:
        """For a refusal of ``n`` rows for want of room to index rows on disk: advice to
        send smaller batches, if this request's size is what keeps the hot set from giving
        that index its RAM (it keeps room for a request's rows twice over); else ""."""
        if self.saves or self.alloc <= self.hot_floor() or self.alloc > self._hot_floor(n):
            return ""
        return (
            f"send smaller batches (the rows in RAM keep room for twice a request's {n}, and so "
            f"cannot give the index of the rows on disk their RAM: {self.alloc} rows are in RAM "
            f"where {self.hot_floor()} would do for small requests), "
        )

    def hot_floor(self) -> int:
        """Rows the hot set keeps whatever else wants the budget's RAM (``HOT_FLOOR`` of it):
        what it gives variables and optimizer slots stops there."""
        return self._hot_floor(0)

    def cold_short(self, n: int, in_ram: int | None = None) -> bool:
        """Whether ``n`` more rows moving to disk would take the index of the rows there past
        the budget while the hot set holds more than its floor (for ``in_ram`` rows of a
        request: ``n`` if None): what :meth:`shrink_for_cold` mends, between requests."""
        return self.alloc > self._hot_floor(n if in_ram is None else in_ram) and not self._cold_fits(n)

    def _shrunk_fits(self, size: int, n: int) -> bool:
        """Whether, once the hot arrays hold ``size`` rows (the coldest past them moved to
        disk) and ``n`` more rows moved to disk after them, the ps is within its budget."""
        moving = max(0, len(self.index) - size)
        hot = super().nbytes
        hot_after = (
            hot
            - (self.alloc - size) * self.allocated_row_bytes()
            - self.index.nbytes
            + IdIndex.nbytes_new(max(size, 1))
        )
        cold = self.cold.nbytes
        return self.held() - hot - cold + hot_after + self.cold.nbytes_with(moving + n) <= self.budget

    def shrink_for_cold(self, n: int, in_ram: int | None = None, keep: np.ndarray | None = None) -> int:
        """Give RAM of the hot set to the index of the rows on disk, so that ``n`` more rows
        can move there: the coldest rows go to disk and the hot arrays are made smaller, by
        an eighth of them at least (each shrink moves every row in RAM: :meth:`_pack_hot`),
        never below :meth:`_hot_floor` for ``in_ram`` rows (a request's: ``n``; rows merged
        in go to disk: 0), and never the rows of ids ``keep`` (the request's, at most half
        the floor). Between requests only (no handler holds places that move), and not
        while a save reads the hot arrays. Returns the rows moved to disk; a full disk
        raises ResourceExhaustedError with nothing changed."""
        floor = self._hot_floor(n if in_ram is None else in_ram)
        if self.saves or self.alloc <= floor or self._cold_fits(n):
            return 0
        top = max(floor, self.alloc - max(1, self.alloc // 8))
        lo = _largest(floor, top, lambda size: self._shrunk_fits(size, n))
        if lo is None:
            return 0  # not even at its floor: the request will be refused
        moving = max(0, len(self.index) - lo)
        rows = self._coldest(moving, self._rows_in_ram(keep)) if moving else np.empty(0, np.int64)
        if rows.size < moving:  # the request's own rows would have to go: not for this
            return 0
        ids, places, meta, keys, made = self._write_out(rows)  # a full disk: nothing changed
        self.release(rows)
        self.demoted += rows.size
        self._pack_hot(lo)  # the hot arrays' RAM goes back first,
        self.cold.add(ids, places, meta["epoch"], keys, as_made=made)  # then the disk's index grows
        self.shrunk += 1
        self.hot_cap = lo
        return int(rows.size)

    # -- promotion ---------------------------------------------------------------------------------
    def in_ram(self, ids: np.ndarray) -> Found:
        """The rows in RAM of ``ids`` (int64, contiguous; -1 where not in RAM), as a stage
        finds them before it reads the others from disk: those a recent training lookup of
        the same ids found (an update follows its lookup: no probe at all), else a probe."""
        index = self.index
        i = self.recent_lookup(ids)
        if i is None:
            return self.found(self.positions(ids))
        _, pos, inserted, _ = self._looked_up[i]
        pos = pos.copy()  # (the update's handler takes the entry itself)
        if inserted != index.inserted:
            index.refind(ids, pos)
        return Found(pos, index.inserted, index.removed)

    def _rows_in_ram(self, ids: np.ndarray | None) -> np.ndarray:
        """The rows in RAM of those of ``ids`` that have one (what a move to disk spares)."""
        if ids is None or not ids.size:
            return np.empty(0, np.int64)
        pos = self.positions(np.ascontiguousarray(ids, np.int64))
        return np.ascontiguousarray(pos[pos >= 0], np.int64)

    def cold_wanted(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Of ``ids``, those on disk now, and their places (what a thread reads, and what
        :meth:`promote` checks they still have)."""
        cold, _, places = self.cold_found(ids)
        return cold, places

    def cold_found(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`cold_wanted`, with the cold slot of each (what :meth:`promote` checks still
        holds its place)."""
        ids = np.ascontiguousarray(ids, np.int64)
        if not len(self.cold):
            return ids[:0], np.empty(0, np.int64), np.empty(0, np.int64)
        slots = self.cold.find(ids)
        there = slots >= 0
        # each once (a request the handler refuses for repeating an id reaches here first)
        cold, slots = ids[there], slots[there]
        distinct = self.kernels.unique_first(cold)[0]  # (a hash pass: no sort)
        if distinct.size != cold.size:
            cold, first = np.unique(cold, return_index=True)
            slots = slots[first]
        return cold, slots, self.cold.places[slots]

    def read_cold(
        self,
        places: np.ndarray,
        ids: np.ndarray | None = None,
        made: np.ndarray | None = None,
        missed: np.ndarray | None = None,
    ) -> dict[str, np.ndarray]:
        """The records at ``places``, timed. A caller that reads on a thread counts itself
        in with ``cold.begin_read`` before it awaits, so no segment is deleted meanwhile.
        ``made`` (with the records' ``ids``): which records hold rows as the table made them
        (``cold.made_at`` of their slots, taken with ``places``); those are made again, not
        read (:meth:`_as_made`). ``missed`` (a bool a place): read only what the page cache
        holds (the serving loop's own read: :meth:`ColdRows.read`); the records left are
        marked True there, their entries not to be used."""
        if made is None or ids is None or not made.any():
            return self._timed_read(places, missed)
        slot_init = dict(self.slot_init)
        got = self.cold.records(places.size, slot_init)
        if missed is not None:
            missed[:] = False  # (a row made again is never missed)
        if not made.all():
            left = None if missed is None else np.zeros(places.size - int(np.count_nonzero(made)), bool)
            for k, v in self._timed_read(places[~made], left).items():
                got[k][~made] = v
            if missed is not None:
                missed[~made] = left
        rows = np.empty((int(np.count_nonzero(made)), self.config.dim), self.dtype)
        made_ids = np.ascontiguousarray(ids[made], np.int64)
        self.kernels.initial_rows(made_ids, *self.initial_formula, rows)
        got["ids"][made], got["rows"][made] = made_ids, rows
        got["meta"][made] = np.zeros(1, META)  # (a count of 0; the rest is the index's: promote)
        for k, init in slot_init.items():
            got[f"slot:{k}"][made] = init
        got["made"] = made  # (what :meth:`promote` counts)
        return got

    def _timed_read(self, places: np.ndarray, missed: np.ndarray | None = None) -> dict[str, np.ndarray]:
        started = time.perf_counter()
        got = self.cold.read(places, dict(self.slot_init), missed)
        if missed is not None:
            self.rows_from_page_cache += places.size - int(np.count_nonzero(missed))
        if missed is None or not missed.all():  # (a read of the page cache that found none: none)
            self.cold_latency = [*self.cold_latency[-1023:], time.perf_counter() - started]
        return got

    def promote(
        self,
        ids: np.ndarray,
        slots: np.ndarray,
        places: np.ndarray,
        records: dict[str, np.ndarray],
        keep: np.ndarray,
        found: Found | None = None,
    ) -> None:
        """Put the records read for ``ids`` back in RAM, those whose cold ``slots`` still hold
        the ``places`` read (from :meth:`cold_found`: another request may have taken some back,
        changed them and moved them out again meanwhile, their records read then stale; or
        compaction moved one, and it is read again when a request needs it),
        never moving out the rows of ``keep`` (the request's ids; ``found``: their rows in
        RAM as :meth:`in_ram` found them before the read) for room. The rows moved out for
        room take the slots on disk of the rows put back: as many out as back needs no more
        RAM for the disk's index (a restored shard's is as full as it may be). A slot that
        still holds its place holds the same id (a place is never given twice): the ids are
        not looked up on disk again."""
        still = self.cold.current(slots, places)
        if not still.any():
            return
        ids = ids[still]
        at = slots[still]  # (what the index says of each, not its record: see ``by_age``)
        epochs, keys = self.cold.epochs[at], self.cold.keys_of(at)
        protect = self.positions_now(keep, found)
        out = self._to_move(ids.size, protect[protect >= 0], freeing=ids)
        written = self._write_out(out) if out.size else None  # a full disk: nothing changed
        self.cold.remove(ids)  # first: the rows moving to disk take the slots these give up
        if written is not None:
            self._moved_out(out, *written)
        rows = self._take_rows(ids.size)
        if self.saves:
            self._touch(rows)
        for key in self.slot_init:
            if key not in self.slots:
                self.slot(key, self.slot_init[key])
        if not still.all():
            records = {k: v[still] for k, v in records.items()}
        meta = records["meta"]
        scatter_rows(self.rows, rows, records["rows"])  # (a block a row)
        for key, arr in self.slots.items():
            scatter_rows(arr, rows, records[f"slot:{key}"])
        self.ids[rows], self.live[rows] = ids, True
        self.last_seen[rows] = keys if self.by_age else meta["last_seen"]
        self.freq[rows] = meta["freq"] if self.by_age else keys
        self.epochs[rows] = epochs
        self.index.insert(ids, rows)
        self.promoted += ids.size
        if "made" in records:
            self.made_back += int(np.count_nonzero(records["made"]))

    def _hot_positions(self, ids: np.ndarray, pos: np.ndarray | None) -> np.ndarray:
        """The :meth:`positions` of ``ids`` (``pos``, if given, are they), once those on
        disk are back in RAM: a stage brought them back before the handler (nothing read
        here, and only the ids not in RAM, new ones, are looked for on disk); one that no
        stage promoted (a request routed without one) is read here, on the loop: correct, if
        slower for it."""
        pos = self.positions(ids) if pos is None else pos
        missing = pos < 0
        if not missing.any():
            return pos
        cold_ids, slots, places = self.cold_found(ids[missing])
        if not cold_ids.size:
            return pos
        self.loop_reads += 1
        self.promote(cold_ids, slots, places, self.read_cold(places, cold_ids, self.cold.made_at(slots)), ids)
        return self.positions(ids)  # (a promotion may move as many rows out)

    def read_rows(self, places: np.ndarray, missed: np.ndarray | None = None) -> np.ndarray:
        """The rows (not their slots) of the records at ``places``, for a lookup that does
        not train, read a piece at a time, so that no more than a piece of whole records is
        held beside the rows (``missed``: only what the page cache holds, as
        :meth:`read_cold`)."""
        rows = np.empty((places.size, self.config.dim), self.dtype)
        for lo in range(0, places.size, READ_THROUGH_PIECE):
            piece = slice(lo, lo + READ_THROUGH_PIECE)
            left = None if missed is None else missed[piece]  # (a view: marked in place)
            rows[piece] = self.read_cold(places[piece], missed=left)["rows"]
        return rows

    # -- what the ps serves --------------------------------------------------------------------
    def lookup(self, ids: np.ndarray, train: bool, pos: np.ndarray | None = None) -> np.ndarray:
        ids = np.ascontiguousarray(ids, np.int64)
        if len(self.cold):
            if not train:
                return self._read_through(ids, pos)
            pos = self._hot_positions(ids, pos)
        if train:
            self.looked_up += ids.size
        return super().lookup(ids, train, pos)

    def _read_through(self, ids: np.ndarray, pos: np.ndarray | None) -> np.ndarray:
        """A lookup that does not train (evaluation, serving): the rows in RAM, and those
        on disk read where they lie. Nothing moves between the tiers, so it needs no room in
        RAM nor on disk (a full disk still serves every row), and a scan of rows seen once
        does not push the training's rows out of RAM. The rows on disk come from the stage's
        read (:attr:`read_ahead`) where their records are still current; the others, which
        moved meanwhile, are read here."""
        pos = self.positions(ids) if pos is None else pos
        out = super().lookup(ids, False, pos)
        missing = np.flatnonzero(pos < 0)
        if not missing.size:
            return out
        slots = self.cold.find(np.ascontiguousarray(ids[missing]))
        there = slots >= 0
        if not there.any():
            return out
        at, places = missing[there], self.cold.places[slots[there]]
        rows = np.empty((at.size, self.config.dim), self.dtype)
        unread = np.ones(at.size, bool)
        if self.read_ahead is not None:  # records never change: one read at a place is current
            read, got = self.read_ahead  # (its places ascending, never none)
            k = np.minimum(np.searchsorted(read, places), read.size - 1)
            hit = read[k] == places
            rows[hit] = got[k[hit]]
            unread = ~hit
        if unread.any():
            self.loop_reads += 1
            rows[unread] = self.read_rows(places[unread])
        out[at] = rows
        self.read_through += at.size
        return out

    def _room(self, new: np.ndarray, pos: np.ndarray) -> np.ndarray:
        new = super()._room(new, pos)
        if new.size:
            self._hot_room(new.size, pos[pos >= 0])
        return new

    def _evict_for(self, n: int, protect: np.ndarray) -> None:
        """Past the capacity: the coldest rows go, those on disk first."""
        if len(self.cold):
            gone = self.cold.victims(min(n, len(self.cold)))
            self.cold.remove(gone)
            self.removed.add(gone)
            self.evicted += gone.size
            n -= gone.size
        if n > 0:
            super()._evict_for(n, protect)

    def _expire(self, serving: np.ndarray) -> None:
        super()._expire(serving)
        age = self.config.max_age
        if age is None or not len(self.cold) or self.lookups % max(1, age // 8):
            return
        live = self.cold.live_slots()
        stale = live[self.cold.keys_of(live) < self.lookups - age]
        if stale.size:
            gone = self.cold.ids_of(stale)
            self.cold.remove(gone)
            self.removed.add(gone)
            self.evicted += gone.size

    def apply(
        self,
        rule: Callable[..., None],
        ids: np.ndarray,
        grad: np.ndarray,
        slots: dict[str, tuple[str, float]],
        cfg: dict[str, Any],
        t: int,
        pos: np.ndarray | None = None,
    ) -> int:
        if len(self.cold):
            pos = self._hot_positions(np.ascontiguousarray(ids, np.int64), pos)
        return super().apply(rule, ids, grad, slots, cfg, t, pos)

    # -- checkpoints ---------------------------------------------------------------------------------
    def _snapshot(
        self, rows: np.ndarray | None, since: int | None = None, moving: SliceSet | None = None
    ) -> dict[str, Any]:
        """As an untiered table's, with the rows on disk (changed after epoch ``since``, or
        in slices ``moving``, if given) after each array's rows in RAM."""
        hot = super()._snapshot(rows)
        # (a block of records, with every array's part of it, within the save's staging)
        record = META.itemsize + 8 + self.config.dim * self.dtype.itemsize * (1 + len(self.slots))
        block = max(1, min(SAVE_BLOCK, self.save_block_bytes // (2 * record)))
        slices = None if moving is None else (moving.slices, list(moving.owned))
        places = self.cold.saved_places(since, slices)
        part = ColdPart(
            self.cold, places, dict(self.slot_init), block, whole=since is None and moving is None
        )
        self.cold.begin_save()
        save = {key: TieredSource(snap, part, key) for key, snap in hot.items()}
        # read as the table reads a Snapshot (before_write) and as a save writes one
        self.saves[-1] = cast("dict[str, Snapshot]", save)
        return save

    def end_snapshot(self, save: dict[str, Any]) -> None:
        if save in self.saves:
            self.saves.remove(save)
            self.cold.end_save()

    def save_links(
        self, save: dict[str, Any], directory: str, rename: dict[str, str]
    ) -> list[tuple[str, np.ndarray]]:
        """The checkpoint files a restore linked into the tier whose rows ``save`` (a full
        one) would read: the file and the rows of it the save reads (a link's bits), which it then does not
        (the save links the file beside its own: a restored shard's later full saves do not
        write its base's rows that did not change again). Files on another file system, or
        whose slots the save names otherwise, are written as before."""
        part = next((s.part for s in save.values() if isinstance(s, TieredSource)), None)
        if part is None or not part.whole:
            return []
        links = []
        for number, path in self.cold.files.linkable(directory, rename):
            bits = part.places.take_out(number)
            if bits.any():
                links.append((path, bits))
        return links

    def changes(self, since: int) -> tuple[dict[str, Any], np.ndarray] | None:
        gone = self.removed.after(since) if since >= self.removed.since else None
        if gone is None:
            return None
        changed = self.kernels.rows_after(self.epochs[: self.used], since, self.live.view(np.uint8))
        return self._snapshot(changed, since), gone[(self.index.get(gone) < 0) & (self.cold.find(gone) < 0)]

    def export(self) -> dict[str, np.ndarray]:
        out = super().export()
        places = self.cold.places_now()
        if places.size:
            cold = self.cold.read(places, dict(self.slot_init))
            out["ids"] = np.concatenate([out["ids"], cold["ids"]])
            out["rows"] = np.concatenate([out["rows"], cold["rows"]])
            for key in self.slots:
                out[f"slot:{key}"] = np.concatenate([out[f"slot:{key}"], cold[f"slot:{key}"]])
        return out

    def load(
        self,
        ids: np.ndarray,
        rows: np.ndarray,
        slots: dict[str, np.ndarray],
        slot_init: dict[str, float],
        replacing: DynamicTable | None = None,
    ) -> None:
        """Replace every row with those given: as many as the hot share lets in RAM, the
        rest on disk (ResourceExhaustedError if the disk or the budget cannot take them).
        ``replacing``: the shard this one replaces once the restore commits, budgeted as
        gone (both are held until then)."""
        self.cold.reset()
        hot = self.rows_in_ram_for(ids.size, len(slots), replacing)
        if hot == ids.size:  # all in RAM: the arrays as they are (the table takes them)
            super().load(ids, rows, slots, slot_init)
        else:  # the part in RAM copied once, for the table to take (not the whole kept alive)
            super().load(
                ids[:hot].copy(), rows[:hot].copy(), {k: v[:hot].copy() for k, v in slots.items()}, slot_init
            )
        if ids.size > hot:
            rest = slice(hot, ids.size)
            meta = np.zeros(ids.size - hot, META)
            self.cold.put(
                np.ascontiguousarray(ids[rest], np.int64),
                np.ascontiguousarray(rows[rest], self.dtype),
                {k: np.ascontiguousarray(v[rest], self.dtype) for k, v in slots.items()},
                meta,
                np.zeros(ids.size - hot, np.int64),
                tight=True,  # (an index grown to hold them would take up to twice the memory)
            )
        self._keep_statistics()  # (the load made the table anew)

    def array_holders(self) -> list[dict[Any, Any]]:
        """Where this shard's arrays are held (its own attributes, its slots', its indexes'
        and its tier's: their ``__dict__``, or the dict itself), for ``set_aside.py`` to
        write them out and read them back. Recent lookups' places are forgotten (looked for
        again after)."""
        self._looked_up.clear()
        cold = self.cold
        return [
            self.__dict__,
            self.slots,
            self.index.__dict__,
            self._cand.__dict__,
            cold.__dict__,
            cold.places.__dict__,
            cold.places.of,
            *(part.__dict__ for part in cold.index.parts),
        ]

    def rows_in_ram_for(
        self, n: int, slots: int, replacing: DynamicTable | None = None, besides: int = 0
    ) -> int:
        """How many of ``n`` rows with ``slots`` optimizer slots a load keeps in RAM (the rest
        go to disk); ResourceExhaustedError if the budget cannot index the rest. Reads what
        the whole ps holds: on the serving loop. ``replacing``: as :meth:`load`'s;
        ``besides``: bytes the load holds beside the shard until it ends (a restore's plan),
        which the hot set makes room for as far as it can (down to one row): a shard that
        fits the budget once loaded is not refused for them."""
        gone_cold = replacing.cold.nbytes if isinstance(replacing, TieredTable) else 0
        gone_hot = (replacing.nbytes - gone_cold) if replacing is not None else 0
        # (of this shard, the arrays and index a load replaces; its admission's stay)
        others_hot = self.held_hot() - gone_hot - self.alloc * self.allocated_row_bytes() - self.index.nbytes
        per = self._loaded_row_bytes(slots)
        # the hot share's room, and at least the hot set's floor (as training keeps it: the
        # first of several shards restored together takes the share's room, the others
        # their floor, then the whole budget decides)
        floor = min(n, max(1, int(self.budget * HOT_FLOOR) // max(per, self.hot_row_bytes())))
        hot = min(n, max(1, floor, (int(self.budget * HOT_SHARE) - others_hot - besides) // per))
        other_cold = self.cold_index() - self.cold.nbytes - gone_cold

        def fits(hot: int, extra: int = besides) -> bool:  # the whole budget
            return (
                others_hot + extra + hot * per + other_cold + self.cold.nbytes_with(n - hot, tight=True)
                <= self.budget
            )

        if other_cold + self.cold.nbytes_with(n - hot, tight=True) > self.budget - int(
            self.budget * HOT_SHARE
        ):
            # the index of the rows on disk needs more than its half: it takes it from the
            # hot set, as in training (shrink_for_cold), down to the hot set's floor (as
            # training reckons it, rows budgeted for ``SLOTS`` slots: what it may have left)
            hot = _largest(floor, hot, fits) or floor
        if not fits(hot):  # fewer in RAM, down to one, before a refusal
            hot = _largest(1, hot, fits) or 1  # (none with ``besides``: as few as may be)
        if not fits(hot, 0):
            self.refused += 1
            raise ResourceExhaustedError(
                f"dynamic table {self.name!r}: {n} rows do not fit this ps's budget of "
                f"{self.ps_budget} bytes with the rows on disk indexed in RAM (pstrain serve "
                "--memory-budget): raise the budget or shard over more ps"
            )
        return hot

    def ram_for(self, n: int, slots: int, hot: int) -> int:
        """The bytes ``n`` rows with ``slots`` optimizer slots take in RAM once loaded with
        ``hot`` of them there (:meth:`rows_in_ram_for`) and the rest indexed on disk: what a
        restore holds for its shard, counted with the ps's tables until it is in place
        (shards restored together must each see the others')."""
        return hot * self._loaded_row_bytes(slots) + self.cold.nbytes_with(n - hot, tight=True)

    def _loaded_row_bytes(self, slots: int) -> int:
        return self.config.dim * self.dtype.itemsize * (1 + slots) + HOT_ROW_EXTRA

    def fill_pieces(
        self,
        pieces: Iterable[tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]],
        n: int,
        slot_init: dict[str, float],
        hot: int,
        linked: Iterable[tuple[np.ndarray, np.ndarray | MaskedPlaces]] = (),
    ) -> None:
        """As :meth:`load` into a table made anew, the ``n`` rows coming a piece at a time
        (a restore reading its base as it goes, ``delta_files.TablePlan``): the first
        ``hot`` kept for RAM, the others written to disk as their piece comes, all indexed
        once every piece came, with the ``(ids, places)`` of ``linked`` (rows left in files
        linked into the tier: ``tiered_restore.py``). Touches this table alone: a restore
        runs it on a thread, before the table is served."""
        dim, dtype = self.config.dim, self.dtype
        hot_ids = np.empty(hot, np.int64)
        hot_rows = np.empty((hot, dim), dtype)
        hot_slots = {k: np.empty((hot, dim), dtype) for k in slot_init}
        cold_ids: list[np.ndarray] = []
        places: list[np.ndarray] = []
        done = 0
        for ids, rows, slots in pieces:
            k = ids.size
            if done + k > n or set(slots) != set(slot_init):
                raise InvalidArgumentError(f"dyn/restore of {self.name!r}: the saved rows are not as planned")
            into = min(k, max(0, hot - done))  # (the first rows: to RAM)
            if into:
                hot_ids[done : done + into] = ids[:into]
                hot_rows[done : done + into] = rows[:into]
                for key, values in slots.items():
                    hot_slots[key][done : done + into] = values[:into]
            if k > into:
                rest = slice(into, k)
                cold_ids.append(np.ascontiguousarray(ids[rest], np.int64))
                places.append(
                    self.cold.write(
                        cold_ids[-1],
                        rows[rest],
                        {key: values[rest] for key, values in slots.items()},
                        np.zeros(k - into, META),
                    )
                )
            done += k
        if done != n:
            raise InvalidArgumentError(f"dyn/restore of {self.name!r}: {done} saved rows, {n} planned")
        super().load(hot_ids, hot_rows, hot_slots, slot_init)
        # (an index grown to hold them would take up to twice the memory)
        self.cold.add_parts([*zip(cold_ids, places), *linked])
        self._keep_statistics()  # (the load made the table anew)

    def statistics(self) -> dict[str, int]:
        lat = np.sort(np.asarray(self.cold_latency)) if self.cold_latency else np.zeros(1)
        return {
            **super().statistics(),
            "rows": len(self),
            "hot_rows": len(self.index),
            "cold_rows": len(self.cold),
            "disk_bytes": self.cold.disk_bytes(),
            "cold_reads": self.cold.reads,
            "cold_rows_read": self.cold.rows_read,
            "cold_rows_from_page_cache": self.rows_from_page_cache,
            "cold_read_p50_us": int(lat[len(lat) // 2] * 1e6),
            "cold_read_p99_us": int(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6),
            # 1: this process's reads from disk go through io_uring; 0: by pread (no ring
            # here, PSTRAIN_IO_URING=0 or the numpy kernels), or none read yet
            "cold_reads_io_uring": int(bool(self.kernels.io_uring_reads())),
            "looked_up": self.looked_up,
            "promoted": self.promoted,
            "made_back": self.made_back,
            "read_through": self.read_through,
            "demoted": self.demoted,
            "compacted": self.compacted,
            "refused": self.refused,
            "sightings_shed": self.sightings_shed,
            "budget": self.ps_budget,
        }

    def has_row(self, ids: np.ndarray) -> np.ndarray:
        """Which of ``ids`` have a row here, in RAM or on disk."""
        held = super().has_row(ids)
        if len(self.cold):
            held |= self.cold.find(ids) >= 0
        return held
