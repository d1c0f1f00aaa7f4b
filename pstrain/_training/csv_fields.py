"""Text records split into typed columns as TF's ``tf.io.decode_csv`` splits them: the
usual step after a :class:`~pstrain.data.TextLineDataset` of CSV or TSV files (Criteo's
click logs are TSV), in a ``map`` over batches of lines.

Each column's ``record_defaults`` entry gives its type and the value of an empty field (an
empty list: the field is required), as TF's: a Python int makes an int32 column, a float a
float32 one, a string a column of bytes; numpy values keep their own type (int32, int64,
float32, float64). Fields may be quoted (``"a,b"``, ``""`` for a quote) unless
``use_quote_delim=False``. Fields and numbers are found as TF's parser finds them: an empty
record has no field, a quote must end its field and an unquoted field holds none, and
numbers are C's (``0x1p3`` a float, ``1_000`` none, past float32's range ``inf``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._base.errors import InvalidArgumentError
from .._base.exports import expose
from .c_numbers import c_float, c_int

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
    last = select[-1] if select_cols is not None else None  # (TF reads every field to count them)
    rows = [_fields(line, field_delim, use_quote_delim, last, i) for i, line in enumerate(lines)]
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


def _fields(line: str, delim: str, quoting: bool, last: int | None, i: int) -> list[str]:
    """Record ``i``'s fields, as TF's ``DecodeCSVOp::ExtractFields`` finds them (up to
    field ``last``, if given): an empty record has none; a line break at a field's start is skipped;
    an unquoted field holds no line break (and, quoting, no quote); a quoted one ends with a
    quote at the end or before a delimiter, and holds a quote as two."""
    if '"' not in line and "\r" not in line and "\n" not in line:
        return line.split(delim) if line else []  # (the usual record: no quote, no line break)
    fields: list[str] = []
    n, at = len(line), 0
    most = n + 1 if last is None else last + 1  # fields to read
    while at < n and len(fields) < most:
        if line[at] in "\r\n":
            at += 1
            continue
        if quoting and line[at] == '"':
            at += 1
            chars = []
            while at < n - 1 and (line[at] != '"' or line[at + 1] != delim):
                if line[at] != '"':
                    chars.append(line[at])
                    at += 1
                elif line[at + 1] == '"':
                    chars.append('"')
                    at += 2
                else:
                    raise InvalidArgumentError(
                        f"decode_csv: record {i}: a quote inside a quoted field must be doubled"
                    )
            if not (at < n and line[at] == '"' and (at == n - 1 or line[at + 1] == delim)):
                raise InvalidArgumentError(
                    f"decode_csv: record {i}: a quoted field must end with a quote, at the end or "
                    "before a delimiter"
                )
            at += 2
        else:
            end = line.find(delim, at)
            end = n if end < 0 else end
            field = line[at:end]
            if "\r" in field or "\n" in field or (quoting and '"' in field):
                raise InvalidArgumentError(
                    f"decode_csv: record {i}: an unquoted field holds a quote or a line break"
                )
            chars = [field]
            at = end + 1
        fields.append("".join(chars))
    if len(fields) < most and line[-1] == delim:  # (a delimiter last: an empty field after it)
        fields.append("")
    return fields


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
            return c_float(field)  # (made the column's type with the column: _array)
        value = c_int(field)
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
    with np.errstate(over="ignore"):  # (a number past float32's range is inf there, as TF's)
        return np.array(values, kind)


expose(globals(), "pstrain.data")
