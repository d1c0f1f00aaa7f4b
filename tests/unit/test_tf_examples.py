"""``pstrain.data.parse_example`` and ``parse_single_example`` of ``tf.train.Example``
records give TensorFlow's own arrays and sparse parts (``references/make_references.py
tf_examples``): fixed features with defaults, variable ones of every type, a feature missing
from every record; what TF refuses is refused, naming the record and the feature; and the
parsed sparse ids are bags for a lookup."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pstrain import JaggedTensor, SparseTensor
from pstrain._kernels import compiled, reference
from pstrain.data import (
    Dataset,
    FixedLenFeature,
    RaggedFeature,
    TFRecordDataset,
    TFRecordWriter,
    VarLenFeature,
    parse_example,
    parse_single_example,
)
from pstrain.errors import InvalidArgumentError
from tests.unit.example_records import example_class

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

TF = json.loads((Path(__file__).resolve().parent / "references" / "tf_examples.json").read_text())
RECORDS = [base64.b64decode(r) for r in TF["records"]]
SPEC = {
    "pair": FixedLenFeature([2], np.int64),
    "label": FixedLenFeature([], np.float32, default_value=-1.0),
    "country": FixedLenFeature([], bytes, default_value=b"none"),
    "clicks": VarLenFeature(np.int64),
    "weights": VarLenFeature(np.float32),
    "terms": VarLenFeature(bytes),
    "absent": VarLenFeature(np.int64),
    "history_ids": RaggedFeature(np.int64, value_key="history"),
}


def plain(value):
    """A parsed value as the reference holds it (bytes base64-encoded)."""
    if isinstance(value, JaggedTensor):  # TF's RaggedTensor: its values and row splits
        return {"values": value.values.tolist(), "row_splits": value.offsets.tolist()}
    if isinstance(value, SparseTensor):
        values = [base64.b64encode(v).decode() if isinstance(v, bytes) else v for v in value.values.tolist()]
        return {
            "indices": value.indices.tolist(),
            "values": values,
            "dense_shape": value.dense_shape.tolist(),
        }
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if value.dtype == object:
        return [base64.b64encode(v).decode() for v in value.reshape(-1).tolist()]
    return value.tolist()


def assert_tfs(got, want):
    """The parsed features are TF's: integers and bytes exactly, floats to float32's
    precision (the reference holds them as Python floats)."""
    assert set(got) == set(want)
    for key, value in got.items():
        mine, theirs = plain(value), want[key]
        if isinstance(mine, dict) and "row_splits" in mine:
            assert mine == theirs, key
            continue
        if isinstance(mine, dict):
            assert mine["indices"] == theirs["indices"] and mine["dense_shape"] == theirs["dense_shape"], key
            mine, theirs = mine["values"], theirs["values"]
        if key in ("label", "weights"):
            np.testing.assert_allclose(mine, theirs, rtol=1e-6)
        else:
            assert mine == theirs, key


def test_a_batch_parses_to_tensorflows_arrays_and_sparse_parts():
    got = parse_example(RECORDS, SPEC)
    assert_tfs(got, TF["batch"])
    assert (
        got["pair"].dtype == np.int64 and got["label"].dtype == np.float32 and got["country"].dtype == object
    )
    assert got["weights"].values.dtype == np.float32
    as_array = parse_example(np.array(RECORDS, dtype=object), SPEC)  # a batch of a TFRecordDataset
    assert as_array["pair"].tolist() == got["pair"].tolist()


def test_one_record_parses_without_the_batch_dimension():
    assert_tfs(parse_single_example(RECORDS[3], SPEC), TF["single"])


def test_parsed_ids_are_bags_for_a_lookup_and_records_come_from_files(tmp_path):
    clicks = parse_example(RECORDS, SPEC)["clicks"]
    bags = JaggedTensor.from_sparse(clicks)
    assert len(bags) == len(RECORDS) and bags.values.tolist() == clicks.values.tolist()
    path = tmp_path / "examples.tfrecord"
    with TFRecordWriter(str(path)) as writer:
        for r in RECORDS:
            writer.write(r)
    ds = TFRecordDataset(str(path)).batch(4).map(lambda records: parse_example(records, SPEC))
    first = next(iter(ds))
    assert first["pair"].tolist() == TF["batch"]["pair"][:4]
    assert isinstance(Dataset.from_tensor_slices(parse_example(RECORDS, {"clicks": SPEC["clicks"]})), Dataset)


@pytest.mark.parametrize(
    "spec, kind, match",
    [
        (
            {"pair": FixedLenFeature([2], np.float32)},
            "type",
            "record 0, feature 'pair': data types don't match",
        ),
        ({"label": FixedLenFeature([], np.float32)}, "missing", "record 0: feature 'label' .* is required"),
        (
            {"pair": FixedLenFeature([3], np.int64)},
            "length",
            r"feature 'pair' of shape \(3,\) holds 2 values",
        ),
    ],
)
def test_what_tensorflow_refuses_is_refused_naming_the_feature(spec, kind, match):
    assert TF["refused"][kind] == "InvalidArgumentError"
    with pytest.raises(InvalidArgumentError, match=match):
        parse_example(RECORDS, spec)


def test_bad_specs_and_records_are_refused():
    for make, match in (
        (lambda: FixedLenFeature([2], np.int32), "dtype must be int64, float32 or string"),
        (lambda: RaggedFeature(np.float32), "parse it with VarLenFeature"),
        (lambda: RaggedFeature(np.int64, partitions=[1]), "partitions are not supported"),
        (
            lambda: parse_example(
                RECORDS, {"x": FixedLenFeature([], np.int64, 0), "y": RaggedFeature(np.float32)}
            ),
            "VarLenFeature",
        ),
        (lambda: FixedLenFeature([-1], np.int64), "shape must be whole numbers"),
        (lambda: FixedLenFeature([2], np.int64, default_value=[1, 2, 3]), "default_value has 3 values"),
        (
            lambda: parse_example(RECORDS, {"x": "int"}),
            "expected a FixedLenFeature, VarLenFeature or RaggedFeature",
        ),
        (lambda: parse_example(RECORDS[0], SPEC), "a batch"),
        (lambda: parse_example([b"\xff\xff\xff"], SPEC), "record 0 is not a tf.train.Example"),
        (lambda: parse_single_example(RECORDS, SPEC), "one record"),
    ):
        with pytest.raises(InvalidArgumentError, match=match):
            make()


def protobufs_values(record, names, kinds):
    """What protobuf itself reads of ``record``: per feature, its values or None (missing,
    or a feature with no list, as TF takes it); a list of another kind raises."""
    example = example_class().FromString(record)
    out = []
    for name, kind in zip(names, kinds):
        feature = example.features.feature.get(name)
        present = None if feature is None else feature.WhichOneof("kind")
        if present is None:
            out.append(None)
            continue
        if present != {"b": "bytes_list", "f": "float_list", "i": "int64_list"}[kind]:
            raise ValueError("data types don't match")
        out.append(list(getattr(feature, present).value))
    return out


def random_record(rng, example_cls):
    example = example_cls()
    for name in rng.choice(["a", "b", "c", "d", "e", "unasked"], int(rng.integers(0, 6)), replace=False):
        feature = example.features.feature[str(name)]
        kind = {"a": "i", "b": "f", "c": "b", "d": "i", "e": "f", "unasked": "i"}[str(name)]
        n = int(rng.integers(0, 5))
        if rng.random() < 0.1:
            continue  # a feature with no list
        if kind == "i":
            feature.int64_list.value.extend(rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64).tolist())
        elif kind == "f":
            feature.float_list.value.extend(rng.normal(size=n).astype(np.float32).tolist())
        else:
            feature.bytes_list.value.extend(
                [bytes(rng.integers(0, 256, int(rng.integers(0, 4)))) for _ in range(n)]
            )
    return example.SerializeToString()


def test_random_records_read_as_protobuf_reads_them_compiled_and_in_python():
    """Random Examples, and pairs of them end to end (protobuf merges them: a key given
    twice takes its last value), with features missing, empty, listless or not asked for:
    both kernels give protobuf's own values, record by record."""
    rng = np.random.default_rng(11)
    example_cls = example_class()
    names, kinds = ["a", "b", "c", "d", "e"], "ifbif"
    singles = [random_record(rng, example_cls) for _ in range(150)]
    records = singles + [singles[i] + singles[i + 1] for i in range(0, 100, 2)]
    keys = {n.encode(): i for i, n in enumerate(names)}
    got = [k.parse_examples(records, keys, kinds.encode()) for k in (compiled, reference)]
    for values, counts in got:
        starts = np.cumsum(np.maximum(counts, 0), axis=1) - np.maximum(counts, 0)
        for r, record in enumerate(records):
            want = protobufs_values(record, names, kinds)
            for f, expected in enumerate(want):
                if expected is None:
                    assert counts[f, r] == -1, (r, f)
                    continue
                mine = values[f][starts[f, r] : starts[f, r] + counts[f, r]].tolist()
                if kinds[f] == "f":
                    np.testing.assert_array_equal(np.float32(mine), np.float32(expected))
                else:
                    assert mine == expected, (r, f)
    np.testing.assert_array_equal(got[0][1], got[1][1])


def test_both_kernels_refuse_what_is_not_an_example():
    example = example_class()()
    example.features.feature["a"].float_list.value.append(1.0)
    good = example.SerializeToString()
    for kernels in (compiled, reference):
        with pytest.raises(ValueError, match="record 1, feature 'a': data types don't match"):
            kernels.parse_examples([b"", good], {b"a": 0}, b"i")
        for bad in (good[:-1], b"\x0a\xff", b"\x0b"):
            with pytest.raises(ValueError, match="record 0 is not a tf.train.Example"):
                kernels.parse_examples([bad], {b"a": 0}, b"f")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=60), min_size=1, max_size=4), st.data())
def test_any_bytes_are_read_alike_by_both_kernels_or_refused_by_both(records, data):
    """Bytes of any kind (and valid records cut or spliced by hypothesis): the compiled
    parser and its Python twin give the same values, or both refuse with a ValueError;
    neither reads past a record nor keeps more than the records hold."""
    good = example_class()()
    good.features.feature["a"].int64_list.value.extend([1, 2**62])
    good.features.feature["b"].float_list.value.append(0.5)
    if data.draw(st.booleans()):
        cut = data.draw(st.integers(0, len(good.SerializeToString())))
        records = [*records, good.SerializeToString()[:cut]]
    outcomes = []
    for kernels in (compiled, reference):
        try:
            outcomes.append(kernels.parse_examples(records, {b"a": 0, b"b": 1, b"": 2}, b"ifb"))
        except ValueError:
            outcomes.append(None)
    if outcomes[0] is None or outcomes[1] is None:
        assert outcomes[0] is None and outcomes[1] is None
        return
    (values, counts), (ref_values, ref_counts) = outcomes
    np.testing.assert_array_equal(counts, ref_counts)
    for mine, theirs in zip(values, ref_values):
        assert (
            mine.tobytes() == theirs.tobytes() if mine.dtype != object else mine.tolist() == theirs.tolist()
        )
        assert mine.size <= sum(len(r) for r in records)


def test_a_fixed_feature_of_no_values_parses_and_an_empty_default_is_none_as_tfs():
    """``FixedLenFeature([0])``: a record holding the feature (of no values) gives a row of
    none, one without it is refused even with ``default_value=[]``, which TF's parser takes
    for "required" (TensorFlow 2.21 on the same records). A batch of such records raised
    numpy's ValueError."""
    record = bytes.fromhex("0a090a070a016112021a00")  # {"a": an empty int64 list}
    for shape in ([0], [2, 0]):
        assert parse_example([record, record], {"a": FixedLenFeature(shape, np.int64)})["a"].shape == (
            2,
            *shape,
        )
        for default in (None, []):
            spec = FixedLenFeature(shape, np.int64, default_value=default)
            with pytest.raises(InvalidArgumentError, match="record 1: feature 'a' .* is required"):
                parse_example([record, b""], {"a": spec})
