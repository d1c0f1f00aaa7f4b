"""Text records split into typed columns as TF's ``tf.io.decode_csv`` splits them: the
usual step after a :class:`~pstrain.data.TextLineDataset` of CSV or TSV files (Criteo's
click logs are TSV), in a ``map`` over batches of lines.

Each column's ``record_defaults`` entry gives its type and the value of an empty field (an
empty list: the field is required), as TF's: a Python int makes an int32 column, a float a
float32 one, a string a column of bytes; numpy values keep their own type (int32, int64,
float32, float64). Fields may be quoted (``"a,b"``, ``""`` for a quote) unless
``use_quote_delim=False``.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._base.errors import InvalidArgumentError
from .._base.exports import expose

__all__ = ["decode_csv"]

_NUMBERS = {
    np.dtype(np.int32): "int32",
    np.dtype(np.int64): "int64",
    np.dtype(np.float32): "float",
    np.dtype(np.float64): "double",
}


def decode_csv(
    records: Any,
    record_defaults: Sequence[Any],
    field_delim: str = ",",
    use_quote_delim: bool = True,
    name: str | None = None,
    na_value: str = "",
    select_cols: Sequence[int] | None = None,
) -> list[np.ndarray]:
    """The columns of ``records`` (a line, or an array or list of lines, as bytes or str):
    a list of arrays of the records' shape, one per column (per ``select_cols``, ascending
    indices, if given), as TF's ``tf.io.decode_csv``. A field that is empty or
    ``na_value`` takes its column's default; a record with another number of fields (without
    ``select_cols``), a field that is not a number of its column's type, or a missing field
    without a default is refused, naming the record and the field."""
    if not isinstance(field_delim, str) or len(field_delim) != 1:
        raise InvalidArgumentError(f"decode_csv: field_delim must be one character, got {field_delim!r}")
    columns = [_column(d, i) for i, d in enumerate(record_defaults)]
    if not columns:
        raise InvalidArgumentError("decode_csv: record_defaults must give at least one column")
    if select_cols is not None:
        select = [int(c) for c in select_cols]
        if len(select) != len(columns) or any(b <= a for a, b in zip(select, select[1:])) or select[0] < 0:
            raise InvalidArgumentError(
                f"decode_csv: select_cols must be {len(columns)} ascending column indices (one per "
                f"record default), got {list(select_cols)}"
            )
    else:
        select = list(range(len(columns)))
    shape = np.shape(records)
    lines = [_text(r) for r in np.asarray(records, dtype=object).reshape(-1)]
    if use_quote_delim:
        rows = list(csv.reader(lines, delimiter=field_delim, quotechar='"', doublequote=True, strict=False))
        rows = [row if row else [""] for row in rows]  # (csv gives an empty line no field)
    else:
        rows = [line.split(field_delim) for line in lines]
    if len(rows) != len(lines):
        raise InvalidArgumentError("decode_csv: a record holds a line break inside quotes")
    out = []
    for k, (col, (kind, default)) in enumerate(zip(select, columns)):
        values = []
        for i, row in enumerate(rows):
            if select_cols is None and len(row) != len(columns):
                raise InvalidArgumentError(
                    f"decode_csv: Expect {len(columns)} fields but have {len(row)} in record {i}"
                )
            if col >= len(row):
                raise InvalidArgumentError(f"decode_csv: record {i} has no field {col}")
            field = row[col]
            if field == "" or field == na_value:
                if default is None:
                    raise InvalidArgumentError(
                        f"decode_csv: Field {k} is required but missing in record {i}!"
                    )
                values.append(default)
            else:
                values.append(_parsed(field, kind, k, i))
        out.append(_array(values, kind).reshape(shape))
    return out


def _column(default: Any, i: int) -> tuple[Any, Any]:
    """A column's type (a numpy dtype, or ``bytes``) and its default (None: required)."""
    if isinstance(default, (list, tuple)):
        if len(default) != 1:
            raise InvalidArgumentError(
                f"decode_csv: record_defaults[{i}] must be one value, or an empty numpy array of the "
                f"column's type for a required field (np.array([], np.int64)), got {default!r}"
            )
        return _column(default[0], i)
    if isinstance(default, bool) or isinstance(default, np.bool_):
        raise InvalidArgumentError(
            f"decode_csv: record_defaults[{i}] is a bool: a column is a number or a string"
        )
    if isinstance(default, (str, bytes)):
        return bytes, default.encode() if isinstance(default, str) else default
    if isinstance(default, int):
        return np.dtype(np.int32), np.int32(default)  # TF's type of a Python int
    if isinstance(default, float):
        return np.dtype(np.float32), np.float32(default)
    arr = np.asarray(default)
    if arr.size > 1:
        raise InvalidArgumentError(
            f"decode_csv: record_defaults[{i}] must be one value (or none), got {default!r}"
        )
    if arr.dtype.kind in "USO":
        value = None if arr.size == 0 else arr.reshape(-1)[0]
        return bytes, None if value is None else _column(value, i)[1]
    if arr.dtype not in _NUMBERS:
        raise InvalidArgumentError(
            f"decode_csv: record_defaults[{i}] is of {arr.dtype}: a column is int32, int64, float32, "
            "float64 or a string"
        )
    return arr.dtype, None if arr.size == 0 else arr.dtype.type(arr.reshape(-1)[0])


def _text(record: Any) -> str:
    if isinstance(record, (bytes, np.bytes_)):
        return bytes(record).decode("utf-8", "surrogateescape")
    if isinstance(record, str):
        return str(record)
    raise InvalidArgumentError(
        f"decode_csv: records must be strings (bytes or str), got {type(record).__name__}"
    )


def _parsed(field: str, kind: Any, k: int, i: int) -> Any:
    if kind is bytes:
        return field.encode("utf-8", "surrogateescape")
    try:
        if kind.kind == "f":
            return kind.type(float(field))
        value = int(field)
        info = np.iinfo(kind)
        if not info.min <= value <= info.max:
            raise ValueError
        return kind.type(value)
    except ValueError:
        raise InvalidArgumentError(
            f"decode_csv: Field {k} in record {i} is not a valid {_NUMBERS[kind]}: {field}"
        ) from None


def _array(values: list[Any], kind: Any) -> np.ndarray:
    if kind is bytes:
        out = np.empty(len(values), object)
        out[:] = values
        return out
    return np.array(values, kind)


expose(globals(), "pstrain.data")
