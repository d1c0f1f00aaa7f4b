"""One shard of a dynamic embedding table, as a ps holds it: rows keyed by raw int64 ids.

A row exists for an id once the id is *admitted*: at its first training
lookup, or under a policy after ``admit_after`` sightings, or with
probability ``admit_probability`` at each sighting (decided by a hash of the
id and its sighting count, so a retried lookup decides the same). Until then a
lookup returns ``default_value``. A new row starts at the id's deterministic
initial value (:func:`~pstrain._formats.numerics.idhash.initial_rows`); its optimizer slots start
at their initial values and live in arrays parallel to the rows, so they are
created, evicted and restored with them.

Eviction: with a ``capacity``, admitting past it first evicts the least
recently used rows (``evict="lru"``, by the clock of the last training lookup)
or the least frequently used ones (``"lfu"``), never rows of the lookup being
served, a sixteenth of the capacity at a time (so the scan for victims is paid
once per many lookups, not per lookup); with ``max_age``, rows not looked up in training for that many of
this shard's training lookups are evicted. An evicted id that comes back
starts again from its initial value.

Memory: rows, slots and the per-row bookkeeping grow in blocks as rows are
admitted (never past ``capacity``), and the sightings of ids not yet admitted
are remembered for at most ``max_candidates`` ids (the oldest half forgotten
past that). No I/O and no awaits here: each call is atomic on the serving loop.

>>> t = DynamicTable("emb", TableConfig(dim=2, admit_after=2))
>>> t.lookup(np.array([7, 8]), train=True).tolist()   # first sighting: default rows
[[0.0, 0.0], [0.0, 0.0]]
>>> len(t), bool(np.any(t.lookup(np.array([7]), train=True) != 0)), len(t)
(0, True, 1)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from ...._base.errors import InvalidArgumentError
from ...._formats.numerics.idhash import row_hash
from ...._kernels import KERNELS
from ...._kernels.id_index import IdIndex
from ..checkpoints.snapshots import BLOCK_BYTES
from ..store import ChangeClock, Snapshot
from .admission import Admission
from .removed_log import RemovedLog
from .table_config import TableConfig
from .table_slices import SlicedRows

__all__ = ["DynamicTable", "Found", "TableConfig"]

BLOCK_ROWS = 1 << 14  # rows are allocated this many at a time (then doubling, up to capacity)
FIRST_BLOCK_BYTES = 4 << 20  # ... but the first block is at most this large: wide rows start small
#: A full table evicts at least 1/EVICT_BATCH of its capacity at once.
EVICT_BATCH = 16
#: Training lookups whose rows an update of the same ids can take (one per worker in flight).
RECENT = 8


@dataclass
class Found:
    """Rows of a request's ids (``pos``, -1 where an id has none), found when the index had
    taken in ``inserted`` ids and let go of ``removed``: still right while none has left it
    since (:meth:`DynamicTable.positions_now`)."""

    pos: np.ndarray
    inserted: int
    removed: int


class DynamicTable(SlicedRows, Admission):
    """One shard of a dynamic table; see the module docstring."""

    def __init__(
        self,
        name: str,
        config: TableConfig,
        owner: str | None = None,
        max_bytes: int | None = None,
        kernels: ModuleType | None = None,
        clock: ChangeClock | None = None,
        room: Callable[[int, str], None] | None = None,
    ) -> None:
        self.name = name
        self.config = config
        self.owner = owner
        self.dtype = np.dtype(config.dtype)
        #: The ps's ``--max-variable-bytes``: a shard's rows (and their slots) stay within it.
        self.max_bytes = max_bytes
        #: Asked with the bytes a training lookup could grow the table by (and its name):
        #: raises if the ps cannot hold them (``--max-store-bytes``, over all it holds).
        self.room = room
        row = config.dim * self.dtype.itemsize
        if max_bytes is not None and (
            row > max_bytes or (config.capacity is not None and config.capacity * row > max_bytes)
        ):
            rows = "a row" if row > max_bytes else f"capacity {config.capacity} rows"
            raise InvalidArgumentError(
                f"dynamic table {name!r}: {rows} of dim {config.dim} ({config.dtype}) is more "
                f"than this ps's limit of {max_bytes} bytes per variable (pstrain serve "
                "--max-variable-bytes): lower the capacity or the dim, or shard over more ps"
            )
        self.kernels = kernels or KERNELS
        #: Bytes a save copies out of each array at a time (less on a ps under a budget).
        self.save_block_bytes = BLOCK_BYTES
        self.index = IdIndex(kernels=self.kernels)  # id -> row
        self.alloc = 0
        self.rows = np.empty((0, config.dim), self.dtype)
        self.ids = np.empty(0, np.int64)  # id of each row
        self.live = np.empty(0, bool)
        self.last_seen = np.empty(0, np.int64)
        self.freq = np.empty(0, np.int64)
        self.slots: dict[str, np.ndarray] = {}
        self.slot_init: dict[str, float] = {}
        self.free = np.empty(0, np.int64)  # rows given up by eviction, reused first (a stack)
        self.nfree = self.used = 0  # free rows; rows ever handed out (the high-water mark)
        self.lookups = 0  # training lookups served (the LRU clock)
        # What eviction reads, so what a training lookup keeps: each row's last lookup (LRU,
        # max_age, and LFU's ties), its count of lookups (LFU). A table without either keeps
        # neither.
        evicts = config.capacity is not None
        self._ages = config.max_age is not None or evicts
        self._counts = evicts and config.evict == "lfu"
        # Sightings of ids not admitted yet: an index id -> slot of ``_cand_counts``; slots
        # are handed out in order, so the oldest are the lowest (forgotten first).
        self._cand = IdIndex(kernels=self.kernels)
        self._cand_ids = np.empty(0, np.int64)
        self._cand_counts = np.empty(0, np.int64)
        self._cand_used = 0
        self.admitted = 0
        self.evicted = 0
        self.saves: list[dict[str, Snapshot]] = []  # the arrays each save in progress reads
        # Delta checkpoints: the epoch each row last changed in (the ps's clock), the evictions.
        self.clock = clock or ChangeClock()
        #: the epoch this shard was made in: a delta since an earlier mark holds all of it
        self.made = self.clock.epoch
        self.epochs = np.empty(0, np.uint32)
        # all 0: rows marked for a moment (the rows an eviction protects; a batch's rows while
        # the numpy reference kernels check them distinct)
        self.marks = np.empty(0, np.uint8)
        # The last training lookups' ids and rows, with the index's counts then: the update
        # that follows a lookup of the same ids takes its rows from here, not another probe.
        self._looked_up: deque[tuple[np.ndarray, np.ndarray, int, int]] = deque(maxlen=RECENT)
        self.removed = RemovedLog(self.clock, config.capacity)

    def __len__(self) -> int:
        return len(self.index)

    @property
    def nbytes(self) -> int:
        return (
            self.alloc * self.allocated_row_bytes()
            + self.index.nbytes
            + self._cand.nbytes
            + self._cand_counts.nbytes
            + self._cand_ids.nbytes
        )

    # -- rows ------------------------------------------------------------------------------------
    def positions(self, ids: np.ndarray) -> np.ndarray:
        """The row of each id, -1 where it has none."""
        return self.index.get(ids)

    def found(self, pos: np.ndarray) -> Found:
        """``pos``, rows of some ids found now, with the index's counts now."""
        return Found(pos, self.index.inserted, self.index.removed)

    def positions_now(self, ids: np.ndarray, found: Found | None) -> np.ndarray:
        """``found`` (rows of ``ids``) brought up to now: found again if an id left the
        index since (its row may be another's now), the ids without a row looked for again
        if ids came in; or the rows of ``ids`` found now."""
        index = self.index
        if found is None or found.removed != index.removed:
            return self.positions(ids)
        pos = found.pos
        if found.inserted != index.inserted:
            index.refind(ids, pos)
        return pos

    def locate(self, ids: np.ndarray) -> np.ndarray | None:
        """:meth:`positions` of ``ids``, or None if an id occurs twice among them (one
        compiled pass: the index slots found are checked distinct, marked where they lie,
        the ids without one by a hash set of just those)."""
        return self.index.locate(ids, self.marks)

    def locate_update(self, ids: np.ndarray) -> np.ndarray | None:
        """:meth:`locate` for an update: the rows a recent training lookup of the same ids
        (in the same order, so distinct) found, while no id has left the index since (its
        row could be another id's now); ids without a row then are looked for again if ids
        came in since."""
        ids = np.ascontiguousarray(ids, np.int64)
        i = self.recent_lookup(ids)
        if i is None:
            return self.locate(ids)
        _, pos, inserted, _ = self._looked_up[i]
        del self._looked_up[i]
        if inserted != self.index.inserted:
            self.index.refind(ids, pos)
        return pos

    def recent_lookup(self, ids: np.ndarray) -> int | None:
        """Which of the last training lookups (``_looked_up``) was of ``ids`` (int64,
        contiguous; the same ids in the same order), while no id has left the index since:
        the rows it found are still theirs (ids without one may have one now)."""
        removed = self.index.removed
        for i, (seen, _, _, was_removed) in enumerate(self._looked_up):
            # compiled calls: with cold caches each numpy call here costs microseconds
            if was_removed == removed and self.kernels.same_ids(seen, ids):
                return i
        return None

    def _grow(self, need: int) -> None:
        if need > self.alloc:
            self._resize(self._next_size(need))

    def _next_size(self, need: int) -> int:
        """Rows to allocate for ``need``: doubling, within the limit and the capacity."""
        cap = self.config.capacity
        first = max(1, min(BLOCK_ROWS, FIRST_BLOCK_BYTES // (self.config.dim * self.dtype.itemsize)))
        new = max(need, first, self.alloc * 2)
        if self.max_bytes is not None:  # never past the limit (lookup checked the need fits)
            new = max(need, min(new, self.max_bytes // self.row_bytes()))
        if cap is not None:
            new = min(new, max(cap, need))
        return new

    def _resize(self, new: int, skip: tuple[str, ...] = ()) -> None:
        """Every per-row array (but ``skip``) to ``new`` rows (new rows: 0, slots at their
        initial value)."""
        old = self.alloc
        holders = [
            (self.__dict__, k)
            for k in ("rows", "ids", "live", "last_seen", "freq", "epochs", "marks")
            if k not in skip
        ]
        for where, key in holders + [(self.slots, k) for k in self.slots]:
            try:  # in place (realloc: no second array beside it at its peak), unless a view is out
                where[key].resize((new,) + where[key].shape[1:], refcheck=True)  # new rows: 0
            except ValueError:
                grown = np.zeros((new,) + where[key].shape[1:], where[key].dtype)
                grown[:old] = where[key]
                where[key] = grown
            if where is self.slots and self.slot_init[key]:
                where[key][old:] = self.slot_init[key]
        self.alloc = new

    def allocated_row_bytes(self) -> int:
        """Bytes each allocated row takes: its values, slots and bookkeeping (id, ages,
        count, epoch, live, mark)."""
        return self.rows.itemsize * self.config.dim * (1 + len(self.slots)) + 8 * 3 + 4 + 2

    def row_bytes(self) -> int:
        """Bytes a row holds: its values and each optimizer slot's."""
        return self.config.dim * self.dtype.itemsize * (1 + len(self.slots))

    def check_room(self, new_rows: int) -> None:
        """Refuse (changing nothing) a training lookup that could admit ``new_rows`` rows
        past the ps's limits: a shard past ``--max-variable-bytes`` (only a table without a
        capacity can grow that far), or arrays grown past what the ps may hold in all
        (:attr:`room`)."""
        if self.max_bytes is not None and self.config.capacity is None:
            total = (len(self.index) + new_rows) * self.row_bytes()
            if total > self.max_bytes:
                raise InvalidArgumentError(
                    f"dynamic table {self.name!r}: admitting up to {new_rows} more rows would take "
                    f"this shard to {total} bytes (rows and slots), more than this ps's limit of "
                    f"{self.max_bytes} (pstrain serve --max-variable-bytes): give the table a "
                    "capacity (its rows are then evicted), or shard it over more ps"
                )
        if self.room is not None:
            need = self.used + max(0, new_rows - self.nfree)  # (freed rows are taken first)
            if need > self.alloc:
                self.room((self._next_size(need) - self.alloc) * self.allocated_row_bytes(), self.name)

    def _take_rows(self, n: int) -> np.ndarray:
        reuse = min(n, self.nfree)
        taken = self.free[self.nfree - reuse : self.nfree]
        self.nfree -= reuse
        fresh = n - reuse
        if not fresh:  # a full table: every row from the stack, in one numpy call
            return taken.copy()
        self._grow(self.used + fresh)
        out = np.concatenate([taken, np.arange(self.used, self.used + fresh, dtype=np.int64)])
        self.used += fresh
        return out

    def _touch(self, rows: np.ndarray) -> None:
        """``rows`` are about to change: saves in progress keep their old values first."""
        for save in self.saves:
            for snap in save.values():
                snap.before_write(rows)

    def snapshot(self) -> dict[str, Snapshot]:
        """The table as of now, for a save that reads it while training goes on: ``ids``,
        ``live``, ``rows`` and each slot (``slot:<key>``) over the rows handed out so far."""
        return self._snapshot(None)

    def _snapshot(self, rows: np.ndarray | None) -> dict[str, Snapshot]:
        """Snapshots of ids, rows and slots over the rows handed out so far, all of them
        (with ``live``; ``rows`` None) or only ``rows``; kept old values by every change."""
        used = self.used
        arrays = {
            "ids": self.ids[:used],
            "rows": self.rows[:used],
            **{f"slot:{k}": v[:used] for k, v in self.slots.items()},
        }
        if rows is None:
            arrays["live"] = self.live[:used]
        save = {k: Snapshot(a, rows=rows, block_bytes=self.save_block_bytes) for k, a in arrays.items()}
        self.saves.append(save)
        return save

    def end_snapshot(self, save: dict[str, Snapshot]) -> None:
        if save in self.saves:
            self.saves.remove(save)

    def save_links(
        self, save: dict[str, Snapshot], directory: str, rename: dict[str, str]
    ) -> list[tuple[str, np.ndarray]]:
        """Files full save ``save`` (just taken, to a file in ``directory``, its slots named
        by ``rename``) links rather than writes (``_formats/files/table_links.py``): each
        file and which of its rows are the save's (a link's bits), now taken out of ``save``. A table in
        RAM has none."""
        return []

    @property
    def initial_formula(self) -> tuple[int, int, int, float, float]:
        """What the table kernels take of a new row's initial values (:func:`row_hash`'s
        constants of the table's seed, and the range)."""
        cfg = self.config
        return (*row_hash(cfg.seed), cfg.init_low, cfg.init_high)

    def _slot_inits(self) -> tuple[tuple[np.ndarray, ...], tuple[float, ...]]:
        """The optimizer slots' arrays and their initial values, in one order (the kernels')."""
        return tuple(self.slots.values()), tuple(self.slot_init[k] for k in self.slots)

    def _create(self, new_ids: np.ndarray) -> np.ndarray:
        """Rows for ``new_ids`` (unique, absent), at their initial values: values, slots and
        bookkeeping written in one compiled pass."""
        rows = self._take_rows(new_ids.size)
        if self.saves:
            self._touch(rows)
        self.kernels.create_rows(
            rows,
            new_ids,
            self.rows,
            *self._slot_inits(),
            self.ids,
            self.live.view(np.uint8),
            self.last_seen,
            self.freq,
            self.epochs,
            self.lookups,
            self.clock.epoch,
            *self.initial_formula,
        )
        self.index.insert(new_ids, rows)
        self.admitted += new_ids.size
        return rows

    def _evict_rows(self, rows: np.ndarray) -> None:
        if rows.size:
            self.removed.add(self.release(rows))
            self.evicted += rows.size

    def release(self, rows: np.ndarray) -> np.ndarray:
        """Give up ``rows`` (ids out of the index, rows reused first); returns their ids."""
        if self.saves:
            self._touch(rows)
        gone = self.ids[rows]
        self.index.delete(gone)
        self.live[rows] = False
        need = self.nfree + rows.size
        if need > self.free.size:  # the stack grows by doubling
            grown = np.empty(max(need, 2 * self.free.size), np.int64)
            grown[: self.nfree] = self.free[: self.nfree]
            self.free = grown
        self.free[self.nfree : need] = rows
        self.nfree = need
        return gone

    def _evict_for(self, n: int, protect: np.ndarray) -> None:
        """Make room for ``n`` rows by evicting rows not in ``protect``: the least recently
        (LRU) or least often (LFU) looked up (one compiled pass per key histogram, no sort).
        LFU's ties go to the least recently looked up: the kernel's own tie rule, the lowest
        rows, would take the rows made last (they take the rows the last eviction freed),
        whose step may still be to send its update."""
        self._evict_rows(self._victims(n, protect, self.config.evict == "lru"))

    def _victims(self, n: int, protect: np.ndarray, lru: bool) -> np.ndarray:
        """The ``n`` rows looked up least recently (``lru``) or least often, none of
        ``protect``, as :meth:`_evict_for` takes them."""
        live, marks, used = self.live.view(np.uint8), self.marks, self.used
        if lru:  # LRU's keys are lookups, none later than the clock: the kernel's range pass is spared
            return self.kernels.pick_victims(self.last_seen, live, protect, marks, used, n, 0, self.lookups)
        return self.kernels.pick_victims(self.freq, live, protect, marks, used, n, 0, -1, self.last_seen)

    # -- what the ps serves ----------------------------------------------------------------------
    def lookup(self, ids: np.ndarray, train: bool, pos: np.ndarray | None = None) -> np.ndarray:
        """Rows of ``ids`` (unique); a training lookup admits, creates, evicts and counts.
        ``pos``: their :meth:`positions` (from :meth:`locate`; changed here), else found here."""
        ids = np.ascontiguousarray(ids, np.int64)
        pos = self.positions(ids) if pos is None else pos
        if train:
            missing, missing_ids = self.kernels.absent(ids, pos)  # one compiled call
            self.check_room(missing.size)  # before anything changes
            self.lookups += 1
            self._expire(pos)
            if missing.size:
                new = self._room(self._admit(missing_ids, missing), pos)
                if new.size:
                    pos[new] = self._create(ids[new])
            self._looked_up.append((ids.copy(), pos, self.index.inserted, self.index.removed))
        out = np.empty((ids.size, self.config.dim), self.dtype)
        # a training lookup's bookkeeping (what eviction reads) in the gather's pass
        self.kernels.gather_rows(
            self.rows,
            pos,
            out,
            self.config.default_value,
            self.last_seen if train and self._ages else None,
            self.freq if train and self._counts else None,
            self.lookups,
        )
        return out

    def _room(self, new: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Room for the admitted ``new`` (where in the lookup's ids), evicting past the
        capacity, never rows of the lookup (``pos``); returns those that get a row."""
        cap = self.config.capacity
        if cap is not None:
            over = len(self) + new.size - cap
            if over > 0:  # a batch at a time: the scan for victims is not paid per lookup
                self._evict_for(max(over, cap // EVICT_BATCH), pos[pos >= 0])
            new = new[: max(0, cap - len(self))]  # never past the capacity
        return new

    def _expire(self, serving: np.ndarray) -> None:
        """Evict the rows not looked up in training for ``max_age`` lookups, except those of
        the lookup being served (``serving``: its rows, -1 for ids without one): an id is
        never evicted by its own lookup, its row handed to another id of the same batch."""
        age = self.config.max_age
        if age is None or self.lookups % max(1, age // 8):
            return
        used = self.used
        stale = self.live[:used] & (self.last_seen[:used] < self.lookups - age)
        stale[serving[serving >= 0]] = False
        self._evict_rows(np.flatnonzero(stale))

    def slot(self, key: str, init: float) -> np.ndarray:
        arr = self.slots.get(key)
        if arr is None:
            arr = self.slots[key] = np.full(self.rows.shape, init, self.dtype)
            self.slot_init[key] = init
        return arr

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
        """One optimizer step on the rows of ``ids`` (unique) that exist; returns how many.
        Gradients of ids without a row (not admitted, or evicted since) are dropped: the
        rule skips rows of -1, in the same pass (a fused kernel) or before it. ``pos``: the
        ids' :meth:`positions` (from :meth:`locate`, nothing changed since), else found here."""
        pos = self.positions(ids) if pos is None else pos
        changed = self.kernels.stamp_rows(self.epochs, pos, self.clock.epoch)  # for deltas
        if not changed:
            return 0
        arrays = {name: self.slot(key, init) for name, (key, init) in slots.items()}
        if self.saves:
            self._touch(pos[pos >= 0])
        rule(self.rows, grad.astype(self.dtype, copy=False), pos, arrays, cfg, t)
        return int(changed)

    # -- checkpoints -------------------------------------------------------------------------------
    def changes(self, since: int) -> tuple[dict[str, Snapshot], np.ndarray] | None:
        """What changed after mark ``since`` (a delta), for a save thread to copy while
        training goes on: snapshots of ``ids``, ``rows`` and each slot (``slot:<key>``) over
        the rows changed (an update meanwhile keeps their old values first, as for a full
        save; end them with :meth:`end_snapshot`), and the ids removed (evicted and not
        back). None if not all evictions since were kept. Forgets the evictions up to
        ``since`` (the caller's base has them)."""
        gone = self.removed.after(since) if since >= self.removed.since else None
        if gone is None:
            return None
        changed = self.kernels.rows_after(self.epochs[: self.used], since, self.live.view(np.uint8))
        return self._snapshot(changed), gone[self.index.get(gone) < 0]  # evicted, not back

    def export(self) -> dict[str, np.ndarray]:
        """``ids``, ``rows`` and each slot (``slot:<key>``) of the live rows, in row order."""
        live = np.flatnonzero(self.live[: self.used])
        out = {"ids": self.ids[live], "rows": self.rows[live]}
        for key, arr in self.slots.items():
            out[f"slot:{key}"] = arr[live]
        return out

    def load(
        self, ids: np.ndarray, rows: np.ndarray, slots: dict[str, np.ndarray], slot_init: dict[str, float]
    ) -> None:
        """Replace every row with those given (a restore)."""
        fresh = DynamicTable(
            self.name, self.config, self.owner, self.max_bytes, self.kernels, self.clock, self.room
        )
        fresh.slot_init = dict(slot_init)
        n = ids.size
        shape = (n, self.config.dim)
        if (
            n
            and all(_adoptable(a, self.dtype, shape) for a in (rows, *slots.values()))
            and _adoptable(ids, np.int64, (n,))
        ):
            # arrays made for this restore (a read, a composition): taken as the table's own,
            # not copied into fresh ones (the copy, into pages never touched, cost more than
            # reading the files did)
            fresh._resize(n, skip=("rows", "ids"))
            fresh.rows, fresh.ids = rows, ids
            fresh.slots = dict(slots)
        else:
            fresh._resize(max(n, 1))  # just what is restored (admissions then double it)
            fresh.slots = {k: np.full(fresh.rows.shape, slot_init[k], self.dtype) for k in slots}
            fresh.rows[:n] = rows
            fresh.ids[:n] = ids
            for k, arr in slots.items():
                fresh.slots[k][:n] = arr
        fresh.live[:n] = True
        fresh.used = n
        fresh.index = IdIndex(n, self.kernels)
        fresh.index.insert(ids, np.arange(n))
        self.__dict__.update(fresh.__dict__)

    def statistics(self) -> dict[str, int]:
        return {
            "rows": len(self.index),
            "admitted": self.admitted,
            "evicted": self.evicted,
            "bytes": self.nbytes,
            "candidates": self.candidates,
            "capacity": self.config.capacity or 0,
        }


def _adoptable(arr: np.ndarray, dtype: Any, shape: tuple[int, ...]) -> bool:
    """Whether a table may take ``arr`` as its own array: its own memory (not a view of a
    larger array, which would stay alive with it), C-contiguous, writable, of ``dtype`` and
    ``shape``."""
    return (
        isinstance(arr, np.ndarray)
        and arr.base is None
        and arr.shape == shape
        and arr.flags.c_contiguous
        and arr.flags.writeable
        and arr.dtype == dtype
    )
