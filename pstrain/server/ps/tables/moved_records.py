"""A move's rows on disk, shipped as their records.

A tiered shard that gives slices away reads the records of their rows on disk as they lie
there and ships them so (``TableCopy.records``, with the slots they carry in
``record_slots``), beside the arrays of its rows in RAM: no taking apart into arrays on
one side and packing again on the other. A tiered receiver writes them to its own disk as
they are, only their bookkeeping (epoch, last lookup, count) set to what the patch says
(:func:`kept_records`); any other receiver takes them apart into arrays first
(:func:`as_columns`; the blocks of a copy pulled: :class:`PulledToRam`). Both check them
whole before anything changes.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from ...._base.errors import InvalidArgumentError
from ...._formats.messages.placement_map import TableCopy
from .cold_records import META, copy_field, put_field, record_dtype

__all__ = ["PulledToRam", "as_columns", "checked_records", "kept_records", "records_of"]


def records_of(copy: TableCopy, dim: int, dtype: np.dtype) -> np.ndarray:
    """``copy.records`` as records of rows of ``dim`` values of ``dtype`` (a view; none if
    it has none), checked: InvalidArgumentError naming what is wrong."""
    if copy.records is None:
        if copy.record_slots:
            raise InvalidArgumentError(f"ps/install: table {copy.name!r} lists record slots and no records")
        return np.empty(0, record_dtype(dim, dtype, 0))
    return checked_records(copy.records, copy.record_slots, dim, dtype, f"ps/install: table {copy.name!r}")


def checked_records(raw: Any, slots: list[str], dim: int, dtype: np.dtype, what: str) -> np.ndarray:
    """``raw`` (bytes received: a copy's, or a block of one pulled) as records of rows of
    ``dim`` values of ``dtype`` carrying ``slots`` (a view), checked: InvalidArgumentError
    saying ``what`` and what is wrong."""
    names = list(slots)
    record = record_dtype(dim, dtype, len(names))
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.ndim != 1:
        raise InvalidArgumentError(f"{what}: its records are not a vector of bytes")
    if names != sorted(set(names)):
        raise InvalidArgumentError(f"{what}: its record slots are not distinct and sorted: {names}")
    if raw.size % record.itemsize:
        raise InvalidArgumentError(
            f"{what}: {raw.size} bytes of records, not a whole number of records of "
            f"{record.itemsize} bytes ({dim} x {np.dtype(dtype)} with {len(names)} slot(s))"
        )
    return np.ascontiguousarray(raw).view(record)


def as_columns(copy: TableCopy, dim: int, dtype: np.dtype) -> TableCopy:
    """``copy`` with its records taken apart: their ids, rows and slots after those of its
    arrays (a slot they do not carry: its initial value, which ``slot_init`` must give).
    InvalidArgumentError if the records or the arrays are malformed."""
    records = records_of(copy, dim, dtype)
    if copy.records is None:
        return copy
    n = records.size
    ids = np.empty(n, np.int64)
    copy_field(ids, records, "id")
    rows = np.empty((n, dim), dtype)
    copy_field(rows, records, "row")
    keys = set(copy.slots) | set(copy.record_slots)
    hot = 0 if copy.ids is None else int(np.size(copy.ids))
    filled = (keys - set(copy.record_slots)) | ((keys - set(copy.slots)) if hot else set())
    missing = filled - set(copy.slot_init)  # (a slot some rows carry and others do not)
    if missing:
        raise InvalidArgumentError(
            f"ps/install: table {copy.name!r}: slot(s) {sorted(missing)} have no initial value"
        )
    slots = {}
    for key in keys:
        if key in copy.record_slots:
            slots[key] = np.empty((n, dim), dtype)
            copy_field(slots[key], records, f"slot{copy.record_slots.index(key)}")
        else:
            slots[key] = np.full((n, dim), copy.slot_init[key], dtype)
    try:
        hot_ids = np.asarray(copy.ids if copy.ids is not None else [], np.int64).reshape(-1)
        hot_rows = np.asarray(copy.rows if copy.rows is not None else np.empty((0, dim)), dtype)
        hot_slots = {
            k: np.asarray(copy.slots[k], dtype)
            if k in copy.slots
            else np.full((hot_ids.size, dim), copy.slot_init.get(k, 0.0), dtype)  # (checked above)
            for k in keys
        }
        return msgspec.structs.replace(
            copy,
            ids=np.concatenate([hot_ids, ids]),
            rows=np.concatenate([hot_rows.reshape(-1, dim), rows]),
            slots={k: np.concatenate([hot_slots[k].reshape(-1, dim), slots[k]]) for k in keys},
            records=None,
            record_slots=[],
        )
    except (ValueError, TypeError) as exc:
        raise InvalidArgumentError(f"ps/install: the arrays of table {copy.name!r}'s copy: {exc}") from None


def kept_records(
    records: np.ndarray, pos: np.ndarray, epoch: int, last_seen: np.ndarray, freq: np.ndarray
) -> np.ndarray:
    """The records whose ``pos`` (their id's place among the live ids of the patch) is not
    -1, each with the bookkeeping of its place (``last_seen[pos]``, ``freq[pos]``) and
    ``epoch``: written in place when every record is kept (the received bytes are this
    ps's own), else into a copy of those kept."""
    keep = pos >= 0
    if bool(np.all(keep)) and records.flags.writeable:
        out = records
    else:
        out = records[keep]
        pos = pos[keep]
    meta = np.zeros(out.size, META)
    meta["epoch"] = epoch
    meta["last_seen"] = last_seen[pos]
    meta["freq"] = freq[pos]
    put_field(out, meta, "epoch", "freq")
    return out


class PulledToRam:
    """The blocks of a move's copy pulled into a shard held wholly in RAM (a ps without a
    budget, from a tiered one): kept as they came until the switch, then taken apart into
    the copy's arrays (:meth:`into`), as a copy whose records came in one piece would be."""

    def __init__(self, name: str, dim: int, dtype: np.dtype) -> None:
        self.what = f"ps/move_records: table {name!r}"
        self.dim, self.dtype = dim, dtype
        self.blocks: list[tuple[np.ndarray, list[str]]] = []
        self.count = 0

    @property
    def nbytes(self) -> int:
        return sum(records.nbytes for records, _ in self.blocks)

    def checked(self, raw: Any, slots: list[str]) -> np.ndarray:
        """A block received as records (InvalidArgumentError naming what is wrong)."""
        return checked_records(raw, slots, self.dim, self.dtype, self.what)

    def put(self, records: np.ndarray, slots: list[str]) -> None:
        """Keep a block (:meth:`checked`) until the switch."""
        if records.size:
            self.blocks.append((records, list(slots)))
            self.count += records.size

    def into(self, copy: TableCopy) -> TableCopy:
        """``copy`` with the rows of the blocks after its own arrays', taken apart by
        :func:`as_columns` (a slot some rows do not carry: its initial value, which
        ``slot_init`` must give), the blocks of each layout at once."""
        layouts: dict[tuple[str, ...], list[np.ndarray]] = {}
        for records, slots in self.blocks:
            layouts.setdefault(tuple(slots), []).append(records.view(np.uint8))
        out = as_columns(copy, self.dim, self.dtype)
        for layout, raw in layouts.items():  # (the order of rows does not matter: matched by id)
            with_records = msgspec.structs.replace(
                out, records=np.concatenate(raw), record_slots=list(layout)
            )
            out = as_columns(with_records, self.dim, self.dtype)
        return out

    def forget(self) -> None:
        self.blocks.clear()
        self.count = 0
