"""The ps's variable store: one record per variable, pins, and copy-on-write.

Reads do not copy: a reply refers to a variable's own array, which is
*pinned* until the bytes have left (or a checkpoint has written it). An
in-place update of a pinned array first copies it (copy-on-write), so a
reader always sees one consistent version and a writer never waits for a
slow reader. Everything here runs on the serving loop with no ``await``, so
each change is atomic.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from ..errors import AlreadyExistsError, NotFoundError

__all__ = ["VariableRecord", "VariableStore"]


class VariableRecord:
    """One variable: its array, and how many replies or saves still refer to it."""

    __slots__ = ("name", "array", "trainable", "pins", "gen", "owner")

    def __init__(self, name: str, array: np.ndarray, trainable: bool, owner: str | None = None) -> None:
        self.name = name
        self.array = array
        self.trainable = trainable
        self.pins = 0
        self.gen = 0
        self.owner = owner  # the strategy instance (coordinator) that created it, if it said

    def replace(self, array: np.ndarray) -> None:
        """A new array (the old one stays with whoever pinned it)."""
        self.array = array
        self.pins = 0
        self.gen += 1

    def writable(self) -> np.ndarray:
        """The array, safe to change in place (copied first if shared)."""
        arr = self.array
        if self.pins or not arr.flags.writeable:
            arr = arr.copy()
            self.replace(arr)
        return arr

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

    def __init__(self, task: str) -> None:
        self.task = task
        self._records: dict[str, VariableRecord] = {}
        self._slots: dict[str, set[str]] = {}  # variable -> its optimizer slots here

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
            raise NotFoundError(f"variable {name!r} not found on {self.task}")
        return record

    def find(self, name: str) -> VariableRecord | None:
        return self._records.get(name)

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
            self._records[r.name] = r
        return replaced

    def put(self, name: str, array: np.ndarray, trainable: bool, slot_of: str | None = None) -> None:
        """Create ``name`` or replace its array (a restore); ``slot_of``: its variable."""
        record = self._records.get(name)
        if record is None:
            self._records[name] = VariableRecord(name, array, trainable)
        else:
            record.replace(array)
        if slot_of is not None:
            self._slots.setdefault(slot_of, set()).add(name)

    def slot(self, name: str, like: np.ndarray, init: float, of: str) -> np.ndarray:
        """The writable array of optimizer slot ``name`` of variable ``of``, created full of
        ``init`` on first use."""
        record = self._records.get(name)
        if record is None:
            record = self._records[name] = VariableRecord(name, np.full(like.shape, init, like.dtype), False)
            self._slots.setdefault(of, set()).add(name)
        return record.writable()

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
        return sum(r.array.nbytes for r in self._records.values())
