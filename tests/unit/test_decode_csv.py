"""``pstrain.data.decode_csv`` against TensorFlow's ``tf.io.decode_csv`` on the same lines
(``references/make_references.py tf_csv``): quoted fields, defaults, required fields,
``select_cols``, ``field_delim``, ``na_value``, ``use_quote_delim``, and what TF refuses;
then the columns of a dataset of lines."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pstrain.data import TextLineDataset, decode_csv
from pstrain.errors import InvalidArgumentError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

TF = json.loads((Path(__file__).resolve().parent / "references" / "tf_csv.json").read_text())


def defaults(columns):
    return [
        np.array([], kind if kind != "string" else object)
        if value is None
        else [np.array(value, kind if kind != "string" else object)]
        for kind, value in columns
    ]


@pytest.mark.parametrize("case", TF["cases"], ids=lambda c: f"{c['lines'][0]!r}-{sorted(c['kwargs'])}")
def test_columns_are_tensorflows(case):
    if case["error"] is not None:
        with pytest.raises(InvalidArgumentError, match="decode_csv: "):
            decode_csv(case["lines"], defaults(case["columns"]), **case["kwargs"])
        return
    got = decode_csv(case["lines"], defaults(case["columns"]), **case["kwargs"])
    assert len(got) == len(case["result"])
    for column, (kind, _), want in zip(got, case["columns"], case["result"]):
        if kind == "string":
            assert column.dtype == object and [v.decode() for v in column] == want
        else:
            assert column.dtype == np.dtype(kind)
            np.testing.assert_allclose(column.astype(np.float64), want, rtol=1e-6)


def test_python_defaults_type_columns_as_tensorflows_do_and_lines_from_files_split(tmp_path):
    ints, floats, strings = decode_csv(["1,2.5,a"], [[0], [0.0], [""]])
    assert ints.dtype == np.int32 and floats.dtype == np.float32 and strings.dtype == object  # TF's
    (path := tmp_path / "clicks.tsv").write_text("1\t10\tx\n0\t\ty\n")
    lines = TextLineDataset(str(path)).batch(2)
    label, count, word = decode_csv(next(iter(lines)), [[0], [np.int64(-1)], [""]], field_delim="\t")
    assert label.tolist() == [1, 0] and count.tolist() == [10, -1] and word.tolist() == [b"x", b"y"]
    for bad, match in (
        (lambda: decode_csv(["1"], []), "at least one column"),
        (lambda: decode_csv(["1"], [[]]), "must be one value"),
        (lambda: decode_csv(["1"], [[True]]), "is a bool"),
        (lambda: decode_csv(["1"], [np.array([0], np.int8)]), "is of int8"),
        (lambda: decode_csv(["1,2"], [[0], [0]], field_delim=",,"), "one character"),
        (lambda: decode_csv(["1,2"], [[0], [0]], select_cols=[1, 0]), "ascending"),
        (lambda: decode_csv([1], [[0]]), "records must be strings"),
    ):
        with pytest.raises(InvalidArgumentError, match=match):
            bad()


# Records, record defaults, keyword arguments, and what TensorFlow 2.21's tf.io.decode_csv
# gave for them (its columns, or None: refused), read off TF on the same records.
TF_FIELDS = [
    ([""], [[1.5]], {}, None),  # an empty record has no field (TF: "Expect 1 fields but have 0")
    ([""], [[1], [2]], {}, None),
    (['"'], [[8]], {}, None),  # a quote that does not end
    (['"a'], [["d"]], {}, None),
    (['a"b'], [["d"]], {}, None),  # a quote inside an unquoted field
    (['x""y'], [["d"]], {}, None),
    (['"a"x,2'], [["d"], [2]], {}, None),
    (["1\r,2"], [[1], [2]], {}, None),
    (["\r1,2"], [[1], [2]], {}, [[1], [2]]),  # a line break at a field's start is skipped
    (["1,\n2"], [[1], [2]], {}, [[1], [2]]),
    (['"a\nb",2'], [["d"], [2]], {}, [[b"a\nb"], [2]]),
    (['"a""",2'], [["d"], [2]], {}, [[b'a"'], [2]]),
    (['a"b,2'], [["d"], [2]], {"use_quote_delim": False}, [[b'a"b'], [2]]),
    (['1,"x,3'], [[1], [2]], {"select_cols": [0]}, None),
    (["1,2,"], [[1], [2]], {"select_cols": [0, 2]}, [[1], [2]]),
    (["0x10", "0x1.8p1", "-0X1A"], [[1.5]], {}, [[16.0, 3.0, -26.0]]),  # C's hexadecimal numbers
    (["0x10"], [[1]], {}, None),
    (["1_000"], [[1.5]], {}, None),  # (Python's numbers take it)
    (["1_000"], [[1]], {}, None),
    (["1e40", "-1e40"], [[1.5]], {}, [[float("inf"), float("-inf")]]),  # past float32: inf
]


@pytest.mark.parametrize(("records", "record_defaults", "kwargs", "want"), TF_FIELDS)
def test_fields_and_numbers_are_found_as_tensorflows_parser_finds_them(
    records, record_defaults, kwargs, want
):
    """Found comparing 500 random records with TF's: pstrain read an empty record as one
    empty field, took a quote that never ends or one inside an unquoted field, and read
    numbers as Python does (1_000 taken, 0x10 refused)."""
    if want is None:
        with pytest.raises(InvalidArgumentError, match="decode_csv: "):
            decode_csv(records, record_defaults, **kwargs)
        return
    got = decode_csv(records, record_defaults, **kwargs)
    assert [np.asarray(column).tolist() for column in got] == want
    assert np.isnan(decode_csv(["nan(1)"], [[1.5]])[0][0])  # (C's strtod takes it; TF's too)
