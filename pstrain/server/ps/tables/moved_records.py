"""A move's rows on disk, shipped as their records.

A tiered shard that gives slices away reads the records of their rows on disk as they lie
there and ships them so (``TableCopy.records``, with the slots they carry in
``record_slots``), beside the arrays of its rows in RAM: no taking apart into arrays on
one side and packing again on the other. A tiered receiver writes them to its own disk as
they are, only their bookkeeping (epoch, last lookup, count) set to what the patch says
(:func:`kept_records`); any other receiver takes them apart into arrays first
(:func:`as_columns`). Both check them whole before anything changes.
"""

from __future__ import annotations

import msgspec
import numpy as np

from ...._base.errors import InvalidArgumentError
from ...._formats.messages.placement_map import TableCopy
from .cold_rows import META, copy_field, put_field, record_dtype

__all__ = ["as_columns", "kept_records", "records_of"]


def records_of(copy: TableCopy, dim: int, dtype: np.dtype) -> np.ndarray:
    """``copy.records`` as records of rows of ``dim`` values of ``dtype`` (a view; none if
    it has none), checked: InvalidArgumentError naming what is wrong."""
    names = list(copy.record_slots)
    record = record_dtype(dim, dtype, len(names))
    raw = copy.records
    if raw is None:
        if names:
            raise InvalidArgumentError(f"ps/install: table {copy.name!r} lists record slots and no records")
        return np.empty(0, record)
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.ndim != 1:
        raise InvalidArgumentError(
            f"ps/install: the records of table {copy.name!r} are not a vector of bytes"
        )
    if names != sorted(set(names)):
        raise InvalidArgumentError(
            f"ps/install: the record slots of table {copy.name!r} are not distinct and sorted: {names}"
        )
    if raw.size % record.itemsize:
        raise InvalidArgumentError(
            f"ps/install: {raw.size} bytes of records of table {copy.name!r}, not a whole number "
            f"of records of {record.itemsize} bytes ({dim} x {np.dtype(dtype)} with {len(names)} slot(s))"
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
