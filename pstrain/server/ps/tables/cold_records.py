"""A cold row's record on disk, and the copies between records and arrays.

A tiered shard's segments (``cold_segments.py``) and a move's shipment of them
(``moved_records.py``) hold each row as one packed record: its id, the bookkeeping of
``META`` (the epoch it last changed in, its last training lookup, its lookup count), its
values, then each optimizer slot's (:func:`record_dtype`). The copies here move a record's
fields, or a row, as one block of bytes wherever both sides allow it: numpy's assignment of
a record's sub-array field goes value by value, 3 to 6 times slower on a save's or a
move's rows.
"""

from __future__ import annotations

import numpy as np

from ...._kernels import KERNELS

__all__ = [
    "META",
    "as_cells",
    "copy_field",
    "field_cells",
    "pack_records",
    "put_field",
    "record_dtype",
    "scatter_cells",
    "scatter_rows",
]

#: Per record: the epoch it last changed in, its last training lookup and its lookup count.
META = np.dtype([("epoch", "<u4"), ("pad", "<u4"), ("last_seen", "<i8"), ("freq", "<i8")])


def as_cells(arr: np.ndarray, dtype: np.dtype) -> np.ndarray | None:
    """``arr``'s rows as one opaque cell each (a 1-D view), if ``arr`` is C-contiguous and of
    ``dtype``; else None. Copying cells moves each row as one block: numpy's assignment of a
    record's sub-array field (``records["row"] = rows``) goes value by value, 3 to 6 times
    slower than this on the rows of a move or a save here."""
    if arr.dtype != dtype or not arr.flags.c_contiguous or not arr.size:
        return None
    flat = arr.reshape(arr.shape[0], -1)
    return flat.view(np.uint8).view(f"V{flat.shape[1] * arr.dtype.itemsize}").reshape(arr.shape[0])


def field_cells(records: np.ndarray, first: str, last: str | None = None) -> np.ndarray:
    """Fields ``first`` through ``last`` (neighbours, packed) of each record, as one cell
    each: a 1-D strided view to copy cells to or from (:func:`as_cells`)."""
    fields = records.dtype.fields
    assert fields is not None
    start = fields[first][1]
    end_type, end_at = fields[last or first][:2]
    raw = records.view(np.uint8).reshape(records.size, records.dtype.itemsize)
    return raw[:, start : end_at + end_type.itemsize].view(f"V{end_at + end_type.itemsize - start}")[:, 0]


def scatter_cells(out: np.ndarray, at: np.ndarray, cells: np.ndarray) -> None:
    """``out[at] = cells``: rows of ``out`` (C-contiguous, not empty) from cells of as many
    bytes (:func:`as_cells`, :func:`field_cells`), a block per row."""
    dst = as_cells(out, out.dtype)
    assert dst is not None, "a scatter into an array that is not one block"
    dst[at] = cells


def scatter_rows(out: np.ndarray, at: np.ndarray, rows: np.ndarray) -> None:
    """``out[at] = rows``, a block per row where both arrays allow it (:func:`as_cells`)."""
    dst, src = as_cells(out, out.dtype), as_cells(rows, out.dtype)
    if dst is None or src is None:
        out[at] = rows
    else:
        dst[at] = src


def copy_field(out: np.ndarray, records: np.ndarray, first: str, last: str | None = None) -> None:
    """``out[:] = `` fields ``first`` to ``last`` of ``records``, a block per record where
    ``out`` allows it."""
    fields = records.dtype.fields
    assert fields is not None
    cells = as_cells(out, META if last is not None else fields[first][0].base)
    if cells is not None and records.size:
        cells[:] = field_cells(records, first, last)
    elif last is None:
        out[...] = records[first]
    else:
        for name in out.dtype.names or ():
            out[name] = records[name]


def put_field(records: np.ndarray, values: np.ndarray, first: str, last: str | None = None) -> None:
    """Fields ``first`` to ``last`` of ``records`` ``= values`` (of the fields' type: cast if
    not), a block per record."""
    fields = records.dtype.fields
    assert fields is not None
    want = META if last is not None else fields[first][0].base  # (a row's: its values' type)
    values = np.ascontiguousarray(values, None if last is not None else want)
    cells = as_cells(values, want)
    if cells is not None:
        field_cells(records, first, last)[:] = cells
    elif last is None:
        records[first] = values
    else:
        for name in values.dtype.names or ():
            records[name] = values[name]


def pack_records(
    record: np.dtype,
    ids: np.ndarray,
    meta: np.ndarray,
    rows: np.ndarray,
    slots: list[np.ndarray],
    at: np.ndarray | None = None,
) -> np.ndarray:
    """Records of ``record`` (:func:`record_dtype`) of ``ids``, their ``META`` fields
    (``meta``), ``rows`` and each slot of ``slots``, in order; with ``at``, the rows and
    slots are ``rows[at]`` and each ``slot[at]``, gathered straight into the records."""
    records = np.empty(ids.size, record)
    put_field(records, ids, "id")
    put_field(records, meta, "epoch", "freq")
    for i, values in enumerate([rows, *slots]):
        field = "row" if i == 0 else f"slot{i - 1}"
        if at is None:
            put_field(records, values, field)
        else:
            gather_field(records, values, at, field)
    return records


def gather_field(records: np.ndarray, values: np.ndarray, at: np.ndarray, field: str) -> None:
    """``records[field] = values[at]`` (``at`` in range), each row copied once from where it
    lies into its record, the next rows' memory asked for ahead (scattered hot rows wait
    on memory, not on the copy), where ``values`` is C-contiguous of the field's type."""
    fields = records.dtype.fields
    assert fields is not None
    cell, start = fields[field][0], fields[field][1]
    if values.dtype != cell.base or not values.flags.c_contiguous or not records.size:
        put_field(records, values[at], field)
        return
    raw = records.view(np.uint8).reshape(records.size, records.dtype.itemsize)
    src = values.reshape(values.shape[0], -1).view(np.uint8)
    KERNELS.take_fixed(src, np.ascontiguousarray(at, np.int64), raw[:, start : start + cell.itemsize])


def record_dtype(dim: int, dtype: np.dtype, slots: int) -> np.dtype:
    """A record of rows of ``dim`` values of ``dtype`` with ``slots`` optimizer slots: the
    id, ``META``'s fields, the row, then each slot, packed (a segment's records; a move
    ships them so)."""
    cell = (np.dtype(dtype), (dim,))
    return np.dtype(
        [("id", "<i8"), ("epoch", "<u4"), ("pad", "<u4"), ("last_seen", "<i8"), ("freq", "<i8")]
        + [("row", *cell)]
        + [(f"slot{i}", *cell) for i in range(slots)]
    )
