"""The ps's variable store: one record per variable, pins, snapshots and copy-on-write.

Reads do not copy: a reply refers to a variable's own array, which is
*pinned* until the bytes have left. An in-place update of a pinned array
first copies it (copy-on-write), so a reader always sees one consistent
version and a writer never waits for a slow reader. Everything here runs on
the serving loop with no ``await``, so each change is atomic.

A checkpoint save does not pin a large array: it takes a
:class:`~pstrain.server.ps.checkpoints.snapshots.Snapshot` of it (copy-on-write per row, while
training goes on), which :mod:`~pstrain.server.ps.checkpoints.snapshots` describes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..._base.cluster import Named, named
from ..._base.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    NotFoundError,
    PlacementChangedError,
    ResourceExhaustedError,
)
from ..._formats.messages.placement_map import PlacementMap
from ..._formats.numerics.casting import cast_value
from ..._kernels import KERNELS
from ..._kernels.batches import ascending_rows
from .checkpoints.snapshots import BLOCK_BYTES, ChangedRows, Snapshot

__all__ = [
    "BLOCK_BYTES",
    "Budget",
    "SNAPSHOT_MIN_BYTES",
    "ChangeClock",
    "Snapshot",
    "VariableRecord",
    "VariableStore",
    "checked_rows",
    "checked_value",
]

#: Arrays at least this large are saved through a Snapshot; smaller ones are pinned.
SNAPSHOT_MIN_BYTES = 1 << 20


@dataclass(frozen=True)
class Budget:
    """What a ps may hold in RAM for variables and tables (``limit``, bytes: its
    ``--memory-budget``, ``whole``, less the room kept for requests in flight), what it
    holds (``held()``), and ``give_room(nbytes, keep)``: its tiered tables' rows in RAM
    moved to disk to free about ``nbytes`` (none of ``keep``'s ids, per table), returning
    why they gave less, if a refusal should say it ("" otherwise)."""

    limit: int
    held: Callable[[], int]
    give_room: Callable[[int, Mapping[str, np.ndarray] | None], str]
    whole: int


class ChangeClock:
    """What changed since a save, for delta checkpoints: every change is stamped with the
    current *epoch*; :meth:`mark` ends an epoch, so a delta "since mark m" holds exactly the
    rows stamped after ``m``. One clock per ps (its variables and its tables)."""

    __slots__ = ("epoch",)

    def __init__(self) -> None:
        self.epoch = 1

    def mark(self) -> int:
        """End the current epoch: changes stamped up to the returned mark are covered."""
        m = self.epoch
        self.epoch += 1
        return m


class VariableRecord:
    """One variable: its array, how many replies refer to it, the saves reading it, and when
    its rows last changed (``changed``: the whole array; ``row_epochs``: per row, for arrays
    of at least ``SNAPSHOT_MIN_BYTES``, whose deltas carry only the rows that changed).

    An update flags its rows in ``flags``, a bit a row, rather than writing each row's
    epoch: the bits of a million rows stay in the caches, where an update's rows' epochs
    are a cache miss each. The flags are the rows changed in epoch ``flagged_in``; they
    are stamped into ``row_epochs`` (:meth:`stamp_flagged`) before anything reads the
    epochs, before an update in a later epoch flags rows, and before a row is stamped
    directly (while a save's snapshot reads the epochs as rows change).

    ``initial`` makes the variable's initial value again, bit for bit (its seeded
    initializer), as long as the array holds nothing else: a restore that will replace it
    gives its memory back first (:meth:`release_initial`), so a job restored at its start
    never holds the initial values beside the restored ones.
    """

    __slots__ = (
        "name",
        "_array",
        "_meta",
        "initial",
        "trainable",
        "pins",
        "gen",
        "owner",
        "snapshots",
        "clock",
        "changed",
        "row_epochs",
        "flags",
        "flagged_in",
    )

    def __init__(
        self,
        name: str,
        array: np.ndarray,
        trainable: bool,
        owner: str | None = None,
        initial: Callable[[], np.ndarray] | None = None,
    ) -> None:
        self.name = name
        self._array: np.ndarray | None = array
        self._meta: tuple[tuple[int, ...], np.dtype] = (array.shape, array.dtype)
        #: Makes the initial value again; None once the array changed (or was given).
        self.initial = initial
        self.trainable = trainable
        self.pins = 0
        self.gen = 0
        self.owner = owner  # the strategy instance (coordinator) that created it, if it said
        self.snapshots: list[Snapshot] = []
        self.clock: ChangeClock | None = None  # set when the record joins a store
        self.changed = 0  # the epoch the whole array last changed in
        self.row_epochs: np.ndarray | None = None
        self.flags: np.ndarray | None = None  # a bit a row of row_epochs: changed in flagged_in
        self.flagged_in = 0  # 0: no row flagged

    @property
    def array(self) -> np.ndarray:
        arr = self._array
        if arr is None:  # given back by release_initial(), and read before a restore replaced it
            assert self.initial is not None
            arr = self._array = self.initial()
        return arr

    @array.setter
    def array(self, value: np.ndarray) -> None:
        self._array = value
        self._meta = (value.shape, value.dtype)

    @property
    def loaded(self) -> bool:
        """Whether the array is in memory (not released, or made again since)."""
        return self._array is not None

    def reload(self, array: np.ndarray) -> None:
        """Put back a released initial value made again off the serving loop (unless it
        was read, and so made, meanwhile, or replaced)."""
        if self._array is None and self.initial is not None:
            self._array = array

    @property
    def shape(self) -> tuple[int, ...]:
        """The array's shape (without making a released initial value again)."""
        return self._meta[0]

    @property
    def dtype(self) -> np.dtype:
        return self._meta[1]

    @property
    def nbytes(self) -> int:
        """The array's bytes, counted while released too (it may be made again)."""
        return math.prod(self._meta[0]) * self._meta[1].itemsize  # (a tiered ps asks per request)

    def release_initial(self) -> bool:
        """Give back the memory of an array that still holds only its initial values (a
        restore about to replace them), unless a reply or a save holds it; whether it is
        released. A restore that fails or is aborted makes the same values again off the
        serving loop (:meth:`reload`); a read before that makes them on the read."""
        if self.initial is None:
            return False
        if self._array is not None and not self.pins and not self.snapshots:
            self._array = None
        return self._array is None

    def track(self, clock: ChangeClock) -> None:
        """Stamp this record's changes on ``clock`` (a store's)."""
        self.clock = clock
        arr = self.array
        big = arr.ndim >= 1 and arr.nbytes >= SNAPSHOT_MIN_BYTES and arr.shape[0] > 1
        self.row_epochs = np.zeros(arr.shape[0], np.uint32) if big else None
        self.flags = np.zeros((arr.shape[0] + 7) // 8, np.uint8) if big else None
        self.flagged_in = 0

    def replace(self, array: np.ndarray, *, change: bool = True) -> None:
        """A new array (the old one stays with whoever pinned or snapshot it); ``change``:
        its values are new (a copy of the same values is not a change)."""
        same_rows = array.shape[:1] == self.shape[:1]
        self.array = array
        self.initial = None  # values of its own now, even if a copy of the initial ones
        self.pins = 0
        self.gen += 1
        self.snapshots = []  # they read the old array, which nobody changes any more
        if self.clock is not None:
            if change:
                self.changed = self.clock.epoch
            if not same_rows:
                self.track(self.clock)

    def changed_rows(self, since: int) -> np.ndarray | None:
        """The rows changed after mark ``since`` (ascending), or None: the whole array."""
        if self.changed > since or self.row_epochs is None:
            return None
        self.stamp_flagged()
        return KERNELS.rows_after(self.row_epochs, since)

    def stamp_flagged(self) -> None:
        """Stamp the rows flagged since the last time with the epoch they changed in."""
        if self.flagged_in:
            assert self.flags is not None and self.row_epochs is not None
            KERNELS.stamp_flagged(self.flags, self.row_epochs, self.flagged_in)
            self.flagged_in = 0

    def writable(self, rows: np.ndarray | None = None) -> np.ndarray:
        """The array, safe to change in place: copied first if a reply shares it; a save's
        snapshot keeps the old values of ``rows`` (None: every row) first."""
        arr = self.array
        self.initial = None  # about to change
        if self.pins or not arr.flags.writeable:
            arr = arr.copy()
            self.replace(arr, change=False)
        for snap in self.snapshots:
            snap.before_write(rows)
        clock = self.clock
        if clock is None:
            return arr
        epochs = self.row_epochs
        if rows is None or epochs is None:
            self.changed = clock.epoch
        elif not (rows.dtype == np.int64 and rows.ndim == 1 and rows.flags.c_contiguous):
            self.stamp_flagged()
            epochs[rows] = clock.epoch
        elif self.snapshots:  # a delta's snapshot reads the epochs of the rows as they change
            self.stamp_flagged()
            KERNELS.stamp_rows(epochs, rows, clock.epoch)  # (the rows are in range)
        else:
            if self.flagged_in != clock.epoch:
                self.stamp_flagged()  # (flags of an earlier epoch)
                self.flagged_in = clock.epoch
            assert self.flags is not None
            KERNELS.flag_rows(self.flags, rows, epochs.shape[0])
        return arr

    def snapshot(self, rows: np.ndarray | None = None, block_bytes: int = BLOCK_BYTES) -> Snapshot | None:
        """A snapshot for a save, of ``rows`` (ascending) or all of them, read ``block_bytes``
        at a time (None: too small, or not row-shaped; pin it instead)."""
        arr = self.array
        if arr.ndim == 0 or arr.nbytes < SNAPSHOT_MIN_BYTES or not arr.flags.c_contiguous:
            return None
        snap = Snapshot(arr, rows=rows, block_bytes=block_bytes)
        self.snapshots.append(snap)
        return snap

    def changes_snapshot(self, since: int, mark: int, block_bytes: int = BLOCK_BYTES) -> ChangedRows | None:
        """A snapshot of the rows changed after mark ``since`` (``mark``: the epoch just
        ended), found by the save's writer ``block_bytes`` at a time (None: not row-stamped,
        or not contiguous)."""
        arr = self.array
        if self.row_epochs is None or not arr.flags.c_contiguous:
            return None
        self.stamp_flagged()  # (rows changed while it lives are stamped, not flagged)
        snap = ChangedRows(arr, self.row_epochs, since, mark, block_bytes=block_bytes)
        self.snapshots.append(snap)
        return snap

    def end_snapshot(self, snap: Snapshot) -> None:
        if snap in self.snapshots:
            self.snapshots.remove(snap)

    def pin(self) -> Callable[[], None]:
        """Share the current array until the returned ``release()`` is called."""
        self.pins += 1
        gen = self.gen

        def release() -> None:
            if self.gen == gen and self.pins:
                self.pins -= 1

        return release


class VariableStore:
    """The variables of one ps, by name.

    >>> store = VariableStore("/job:ps/replica:0/task:0")
    >>> store.add([VariableRecord("w", np.zeros(3), True)])  # nothing replaced
    []
    >>> store.get("w").array.shape, len(store)
    ((3,), 1)
    """

    def __init__(self, task: str | Named) -> None:
        self._name = named(task)  # the ps's name as it is now (a ps that joined is renamed)
        #: Stamps every change, for delta checkpoints (shared with this ps's tables).
        self.clock = ChangeClock()
        self._records: dict[str, VariableRecord] = {}
        self._slots: dict[str, set[str]] = {}  # variable -> its optimizer slots here
        #: Variables this ps does not serve because of a move: name -> why (``moves/handlers.py``).
        self.away: dict[str, str] = {}
        #: The newest placement map this ps knows: a refusal carries it.
        self.placement = PlacementMap()
        self.refusals = 0  # requests refused because a variable they name moved
        #: Bytes held beside the variables until a step ends: restores staged, not committed
        #: yet (``checkpoints/saves.py``) and copies staged by a move (``moves/handlers.py``).
        self.staged: list[Callable[[], int]] = []
        #: The ps's ``--memory-budget``, what it holds in RAM for variables and tables, and
        #: how its tiered tables give some back (None: no budget): variables created,
        #: restored or moved in, and optimizer slots made, must fit beside the tables
        #: (:meth:`check_budget`).
        self.budget: Budget | None = None

    def check_budget(self, adding: int, what: str, keep: Mapping[str, np.ndarray] | None = None) -> None:
        """Make room for ``adding`` bytes more under this ps's ``--memory-budget`` (the tiered
        tables' coldest rows in RAM go to disk, none of ``keep``'s ids: a request's staged
        rows), or ResourceExhaustedError: a ps with a budget never holds more than it in
        RAM, so a fixed variable too large for it is refused here rather than by the
        kernel's OOM killer."""
        if self.budget is None or adding <= 0:
            return
        limit, held = self.budget.limit, self.budget.held()
        why = ""
        if held + adding > limit:
            why = self.budget.give_room(held + adding - limit, keep)
            held = self.budget.held()
        if held + adding > limit:
            raise ResourceExhaustedError(
                f"{what}: {adding} bytes more would take {self.task} past its memory budget of "
                f"{self.budget.whole} bytes ({held} held now by its variables and tables, which may "
                f"hold {limit}: the rest is kept for requests in flight; pstrain serve "
                f"--memory-budget){why}. A table larger than the budget is a "
                "pstrain.DynamicEmbedding, whose rows past the budget live on --table-dir; or "
                "shard the variable over more ps, or raise the budget"
            )

    @property
    def task(self) -> str:
        return self._name.task

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[VariableRecord]:
        return iter(self._records.values())

    def __contains__(self, name: object) -> bool:
        return name in self._records

    def get(self, name: object) -> VariableRecord:
        """The record of ``name``, or NotFoundError naming it and this ps."""
        record = self._records.get(name) if isinstance(name, str) else None
        if record is None:
            why = self.away.get(name) if isinstance(name, str) else None
            if why is not None:  # nothing of the request is applied: handlers check first
                self.refusals += 1
                raise PlacementChangedError(
                    f"variable {name!r} {why} {self.task}", placement=self.placement.to_builtins()
                )
            raise NotFoundError(f"variable {name!r} not found on {self.task}")
        return record

    def find(self, name: str) -> VariableRecord | None:
        return self._records.get(name)

    def footprint(self, name: str) -> int:
        """Bytes of variable ``name`` and its optimizer slots here (0 if it is not here)."""
        record = self._records.get(name)
        if record is None:
            return 0
        slots = (self._records.get(s) for s in self._slots.get(name, ()))
        return record.nbytes + sum(r.nbytes for r in slots if r is not None)

    def taken_over(self, record: VariableRecord) -> VariableRecord | None:
        """The variable ``record`` would replace: one of the same name created by another
        owner (a restarted coordinator takes over). AlreadyExistsError for a true duplicate."""
        existing = self._records.get(record.name)
        if existing is None:
            return None
        if record.owner is None or existing.owner == record.owner:
            raise AlreadyExistsError(f"variable {record.name!r} already exists on {self.task}")
        return existing

    def add(self, records: list[VariableRecord]) -> list[VariableRecord]:
        """Add new variables, all or none; returns those replaced (created by another owner,
        dropped with their slots). AlreadyExistsError if a name is taken by the same owner."""
        replaced = [old for old in (self.taken_over(r) for r in records) if old is not None]
        for old in replaced:
            self._drop(old.name)
        for r in records:
            r.track(self.clock)
            r.changed = self.clock.epoch  # new: a delta carries it whole
            self._records[r.name] = r
        return replaced

    def put(self, name: str, array: np.ndarray, trainable: bool, slot_of: str | None = None) -> None:
        """Create ``name`` or replace its array (a restore); ``slot_of``: its variable."""
        record = self._records.get(name)
        if record is None:
            record = self._records[name] = VariableRecord(name, array, trainable)
            record.track(self.clock)
        record.replace(array)
        if slot_of is not None:
            self._slots.setdefault(slot_of, set()).add(name)

    def slot(
        self,
        name: str,
        like: np.ndarray,
        init: float,
        of: str,
        rows: np.ndarray | None = None,
        shape: tuple[int, ...] | None = None,
    ) -> np.ndarray:
        """The writable array of optimizer slot ``name`` of variable ``of``, created full of
        ``init`` on first use (``like``'s shape, or ``shape``, and its dtype); ``rows``: those
        about to change (None: all)."""
        record = self._records.get(name)
        if record is None:
            array = np.full(like.shape if shape is None else shape, init, like.dtype)
            record = self._records[name] = VariableRecord(name, array, False)
            record.track(self.clock)
            record.changed = self.clock.epoch
            self._slots.setdefault(of, set()).add(name)
        return record.writable(rows)

    def take(self, name: str) -> list[VariableRecord]:
        """Remove variable ``name`` and its optimizer slots; returns their records (a move
        parks them until it is committed)."""
        records = [self._records.pop(name)]
        slots = self._slots.pop(name, set())
        records += [self._records.pop(s) for s in sorted(slots) if s in self._records]
        return records

    def take_all(self, owners: set[str | None] | None = None) -> list[str]:
        """Remove every variable (with its slots), or those created by ``owners``; returns
        their names."""
        slots = {s for names in self._slots.values() for s in names}
        gone = [
            r.name
            for r in self._records.values()
            if r.name not in slots and (owners is None or r.owner in owners)
        ]
        for name in gone:
            self.take(name)
        return gone

    def slots_of(self, name: str) -> list[VariableRecord]:
        """The optimizer slots of variable ``name`` held here."""
        return [self._records[s] for s in sorted(self._slots.get(name, ())) if s in self._records]

    def _drop(self, name: str) -> None:
        self._records.pop(name, None)
        for slot in self._slots.pop(name, ()):
            self._records.pop(slot, None)

    def delete(self, names: list[str]) -> int:
        """Delete variables (and their optimizer slots) by name, all or none (NotFoundError
        if one is missing)."""
        records = [self.get(n) for n in names]
        for r in records:
            self._drop(r.name)
        return len(records)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self._records.values())

    def held(self) -> int:
        """The bytes this ps holds for variables, staged ones included: what
        ``--max-store-bytes`` limits."""
        return self.nbytes + sum(staged() for staged in self.staged)


def checked_value(record: VariableRecord, value: Any, shape: tuple[int, ...], what: str) -> np.ndarray:
    """``value`` as an array of ``record``'s dtype and of ``shape``, or InvalidArgumentError."""
    if value is None:
        raise InvalidArgumentError(f"{what} of variable {record.name!r}: missing value")
    arr = cast_value(value, record.array.dtype, f"{what} of variable {record.name!r}")
    if arr.shape != shape:
        raise InvalidArgumentError(
            f"{what} of variable {record.name!r}: value has shape {arr.shape}, expected {shape}"
        )
    return arr


def checked_rows(record: VariableRecord, idx: Any, what: str) -> np.ndarray:
    """``idx``, row ids of ``record`` in range (int64 if 1-D), or InvalidArgumentError."""
    return checked_row_order(record, idx, what)[0]


def checked_row_order(record: VariableRecord, idx: Any, what: str) -> tuple[np.ndarray, bool]:
    """:func:`checked_rows`, and whether they ascend strictly (1-D, sorted and distinct: a
    merged gradient's), found in the same pass."""
    if idx is None:
        raise InvalidArgumentError(f"{what} of variable {record.name!r}: missing row ids")
    if idx.dtype.kind not in "iu":
        raise InvalidArgumentError(
            f"{what} of variable {record.name!r}: row ids must be integers, got {idx.dtype}"
        )
    if record.array.ndim == 0:
        raise InvalidArgumentError(f"{what}: variable {record.name!r} is a scalar and has no rows")
    n = record.array.shape[0]
    if idx.ndim == 1:
        rows, first_bad, ascending = ascending_rows(idx, n)
        if first_bad < 0:
            return rows, ascending
        bad = idx[first_bad]
    elif idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
        bad = idx[(idx < 0) | (idx >= n)].reshape(-1)[0]
    else:
        return idx, False
    raise InvalidArgumentError(f"{what} of variable {record.name!r}: row id {int(bad)} out of range [0, {n})")
