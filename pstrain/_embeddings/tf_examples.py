"""``tf.train.Example`` records parsed as TF parses them: ``parse_example`` and
``parse_single_example`` with ``FixedLenFeature`` and ``VarLenFeature`` specs.

A recommender's data is most often TFRecord files of ``tf.train.Example``\\ s: a feature
map of named lists of int64, float or bytes. ``parse_example(records, features)`` gives,
for each feature asked for, a ``(batch, *shape)`` array (``FixedLenFeature``: every record
holds exactly that many values, or the feature's ``default_value`` stands in) or a
:class:`~pstrain.SparseTensor` (``VarLenFeature``: any number of values per record, as TF
gives it, which embedding lookups and datasets take as bags of ids). The records are read
with ``protobuf`` (a dependency already, through the TensorBoard writer), from the
``Example`` schema declared here in a pool of its own, so that a process that imports
TensorFlow too has no clash of names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from .._base.errors import InvalidArgumentError
from .._base.exports import expose
from .jagged import SparseTensor

__all__ = ["FixedLenFeature", "VarLenFeature", "parse_example", "parse_single_example"]


def _example_class() -> Any:
    """``tensorflow.Example``, as ``example.proto`` and ``feature.proto`` declare it."""
    f = descriptor_pb2.FileDescriptorProto(
        name="pstrain_tf_example.proto", package="tensorflow", syntax="proto3"
    )
    label, message, packed = (
        descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED,
        descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE,
        descriptor_pb2.FieldOptions(packed=True),
    )
    types = descriptor_pb2.FieldDescriptorProto
    for name, kind in (
        ("BytesList", types.TYPE_BYTES),
        ("FloatList", types.TYPE_FLOAT),
        ("Int64List", types.TYPE_INT64),
    ):
        m = f.message_type.add(name=name)
        field = m.field.add(name="value", number=1, label=label, type=kind)
        if kind != types.TYPE_BYTES:
            field.options.CopyFrom(packed)
    feature = f.message_type.add(name="Feature")
    feature.oneof_decl.add(name="kind")
    for number, (name, kind) in enumerate(
        (("bytes_list", "BytesList"), ("float_list", "FloatList"), ("int64_list", "Int64List")), 1
    ):
        feature.field.add(
            name=name,
            number=number,
            type=message,
            type_name=f".tensorflow.{kind}",
            oneof_index=0,
            label=types.LABEL_OPTIONAL,
        )
    features = f.message_type.add(name="Features")
    entry = features.nested_type.add(
        name="FeatureEntry", options=descriptor_pb2.MessageOptions(map_entry=True)
    )
    entry.field.add(name="key", number=1, type=types.TYPE_STRING, label=types.LABEL_OPTIONAL)
    entry.field.add(
        name="value", number=2, type=message, type_name=".tensorflow.Feature", label=types.LABEL_OPTIONAL
    )
    features.field.add(
        name="feature", number=1, type=message, type_name=".tensorflow.Features.FeatureEntry", label=label
    )
    example = f.message_type.add(name="Example")
    example.field.add(
        name="features", number=1, type=message, type_name=".tensorflow.Features", label=types.LABEL_OPTIONAL
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tensorflow.Example"))


_Example = _example_class()

#: A dtype's kind of ``tf.train.Feature`` list, and the numpy type its values take.
_KINDS = {
    "int64": ("int64_list", np.int64),
    "float32": ("float_list", np.float32),
    "string": ("bytes_list", object),
}


def _kind(dtype: Any, what: str) -> str:
    """``"int64"``, ``"float32"`` or ``"string"`` from a numpy dtype, ``bytes``/``str``, or
    TF's dtype (by its name)."""
    name = getattr(dtype, "name", None)
    if dtype in (bytes, str, object) or name == "string":
        return "string"
    try:
        numpy = np.dtype(dtype)
    except TypeError:
        numpy = None
    kind = "int64" if numpy == np.int64 else "float32" if numpy == np.float32 else None
    if kind is None:
        raise InvalidArgumentError(
            f"{what}: dtype must be int64, float32 or string (bytes), as TF's, got {dtype!r}"
        )
    return kind


class FixedLenFeature:
    """TF's ``tf.io.FixedLenFeature``: every record holds ``prod(shape)`` values of
    ``dtype`` (int64, float32 or bytes), parsed to an array of ``shape``; a record without
    the feature takes ``default_value`` (a number, a list of them, or an array of the
    shape), or is refused when there is none."""

    __slots__ = ("shape", "dtype", "default_value")

    def __init__(self, shape: Sequence[int] | int, dtype: Any, default_value: Any = None) -> None:
        dims = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in dims):
            raise InvalidArgumentError(f"FixedLenFeature: shape must be whole numbers, got {shape!r}")
        self.shape = tuple(int(d) for d in dims)
        self.dtype = _kind(dtype, "FixedLenFeature")
        self.default_value = None
        if default_value is not None:
            default = np.asarray(default_value, dtype=_KINDS[self.dtype][1])
            size = int(np.prod(self.shape))
            if default.size == 1 and size != 1:
                default = np.full(self.shape, default.reshape(-1)[0], default.dtype)
            if default.size != size:
                raise InvalidArgumentError(
                    f"FixedLenFeature: default_value has {default.size} values, the shape {self.shape} {size}"
                )
            self.default_value = default.reshape(self.shape)

    def __repr__(self) -> str:
        return f"FixedLenFeature(shape={self.shape}, dtype={self.dtype}, default_value={self.default_value})"


class VarLenFeature:
    """TF's ``tf.io.VarLenFeature``: any number of values of ``dtype`` per record (none
    where the feature is missing), parsed to a :class:`~pstrain.SparseTensor`, as TF's."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: Any) -> None:
        self.dtype = _kind(dtype, "VarLenFeature")

    def __repr__(self) -> str:
        return f"VarLenFeature(dtype={self.dtype})"


def parse_example(
    serialized: Any, features: Mapping[str, Any], example_names: Any = None, name: str | None = None
) -> dict[str, Any]:
    """TF's ``tf.io.parse_example``: a batch of serialized ``tf.train.Example``\\ s (a list or
    1-D array of bytes, such as a batch of a :class:`TFRecordDataset`) parsed by
    ``features`` (``{name: FixedLenFeature | VarLenFeature}``) into ``{name: array of
    (batch, *shape)}`` and ``{name: SparseTensor of dense_shape (batch, longest)}``.
    ``example_names`` and ``name`` are TF's, accepted. A record that does not parse, a
    feature of the wrong type or length, or one missing without a default is refused,
    naming the record and the feature."""
    records = _records(serialized)
    specs = _specs(features)
    parsed = [_features_of(r, i) for i, r in enumerate(records)]
    out: dict[str, Any] = {}
    for key, spec in specs.items():
        found = [_values(p, key, spec, i) for i, p in enumerate(parsed)]
        if isinstance(spec, FixedLenFeature):
            out[key] = _stacked(found, key, spec)
        else:
            values = [np.zeros(0, _KINDS[spec.dtype][1]) if v is None else v for v in found]
            lengths = np.fromiter((v.size for v in values), np.int64, len(values))
            rows = np.repeat(np.arange(len(values), dtype=np.int64), lengths)
            cols = (
                np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])
                if len(values)
                else np.zeros(0, np.int64)
            )
            flat = np.concatenate(values) if values else np.zeros(0, _KINDS[spec.dtype][1])
            out[key] = SparseTensor(
                np.stack([rows, cols], axis=1), flat, [len(values), int(lengths.max(initial=0))]
            )
    return out


def parse_single_example(
    serialized: Any, features: Mapping[str, Any], example_names: Any = None, name: str | None = None
) -> dict[str, Any]:
    """TF's ``tf.io.parse_single_example``: one serialized ``tf.train.Example`` parsed as
    :func:`parse_example` parses a batch of one, without the batch dimension (a
    ``VarLenFeature`` a 1-D :class:`~pstrain.SparseTensor`)."""
    if isinstance(serialized, np.ndarray) and serialized.ndim == 0:
        serialized = serialized[()]
    if not isinstance(serialized, (bytes, bytearray, memoryview)):
        raise InvalidArgumentError(
            f"parse_single_example: serialized must be one record (bytes), got {type(serialized).__name__}"
        )
    batch = parse_example([bytes(serialized)], features)
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, SparseTensor):
            out[key] = SparseTensor(value.indices[:, 1:], value.values, value.dense_shape[1:])
        else:
            out[key] = value[0]
    return out


def _records(serialized: Any) -> list[bytes]:
    items = list(serialized.reshape(-1)) if isinstance(serialized, np.ndarray) else serialized
    if isinstance(items, (bytes, str)) or not isinstance(items, Sequence):
        raise InvalidArgumentError(
            "parse_example: serialized must be a batch (a list or 1-D array) of records; "
            "parse_single_example parses one"
        )
    for r in items:
        if not isinstance(r, (bytes, bytearray, memoryview)):
            raise InvalidArgumentError(f"parse_example: a record must be bytes, got {type(r).__name__}")
    return [bytes(r) for r in items]


def _specs(features: Mapping[str, Any]) -> dict[str, FixedLenFeature | VarLenFeature]:
    if not isinstance(features, Mapping) or not features:
        raise InvalidArgumentError(
            "parse_example: features must be a dict of {name: FixedLenFeature | VarLenFeature}"
        )
    for key, spec in features.items():
        if not isinstance(spec, (FixedLenFeature, VarLenFeature)):
            raise InvalidArgumentError(
                f"parse_example: feature {key!r}: expected a FixedLenFeature or VarLenFeature, got {spec!r}"
            )
    return dict(features)


def _features_of(record: bytes, i: int) -> Any:
    example = _Example()
    try:
        example.ParseFromString(record)
    except Exception as exc:  # protobuf's DecodeError, whatever the backend
        raise InvalidArgumentError(f"parse_example: record {i} is not a tf.train.Example ({exc})") from None
    return example.features.feature


def _values(feature_map: Any, key: str, spec: FixedLenFeature | VarLenFeature, i: int) -> np.ndarray | None:
    """Record ``i``'s values of feature ``key`` (None where a fixed one is missing)."""
    list_name, numpy = _KINDS[spec.dtype]
    if key not in feature_map:
        return None if isinstance(spec, FixedLenFeature) else np.zeros(0, numpy)
    feature = feature_map[key]
    present = feature.WhichOneof("kind")
    if present is None:  # a feature with no list at all: no values
        return np.zeros(0, numpy) if isinstance(spec, VarLenFeature) else None
    if present != list_name:
        raise InvalidArgumentError(
            f"parse_example: record {i}, feature {key!r}: data types don't match: it holds "
            f"{present}, the spec asks for {spec.dtype}"
        )
    values = getattr(feature, list_name).value
    if numpy is object:
        out = np.empty(len(values), object)
        out[:] = list(values)
        return out
    return np.fromiter(values, numpy, len(values))


def _stacked(values: list[np.ndarray | None], key: str, spec: FixedLenFeature) -> np.ndarray:
    size = int(np.prod(spec.shape))
    rows = []
    for i, v in enumerate(values):
        if v is None:
            if spec.default_value is None:
                raise InvalidArgumentError(
                    f"parse_example: record {i}: feature {key!r} (data type: {spec.dtype}) is required "
                    "but could not be found"
                )
            v = spec.default_value
        if v.size != size:
            raise InvalidArgumentError(
                f"parse_example: record {i}: feature {key!r} of shape {spec.shape} holds {v.size} "
                f"values, not {size}"
            )
        rows.append(np.asarray(v).reshape(spec.shape))
    numpy = _KINDS[spec.dtype][1]
    if not rows:
        return np.zeros((0, *spec.shape), numpy)
    if numpy is object:
        out = np.empty((len(rows), *spec.shape), object)
        for i, r in enumerate(rows):
            out[i, ...] = r  # (element by element: a 0-d row is its bytes, not an array)
        return out
    return np.stack(rows).astype(numpy, copy=False)


expose(globals(), "pstrain.data")
