"""``tf.train.Example`` records parsed as TF parses them: ``parse_example`` and
``parse_single_example`` with ``FixedLenFeature`` and ``VarLenFeature`` specs.

A recommender's data is most often TFRecord files of ``tf.train.Example``\\ s: a feature
map of named lists of int64, float or bytes. ``parse_example(records, features)`` gives,
for each feature asked for, a ``(batch, *shape)`` array (``FixedLenFeature``: every record
holds exactly that many values, or the feature's ``default_value`` stands in) or a
:class:`~pstrain.SparseTensor` (``VarLenFeature``: any number of values per record, as TF
gives it, which embedding lookups and datasets take as bags of ids). The records are read
straight from the protobuf wire format by a compiled kernel (``parse_examples``): a batch
in one pass, without a message object per record.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._base.errors import InvalidArgumentError
from .._base.exports import expose
from .._kernels import KERNELS
from .jagged import JaggedTensor, SparseTensor

__all__ = ["FixedLenFeature", "RaggedFeature", "VarLenFeature", "parse_example", "parse_single_example"]


#: A dtype's code for the kernel, and the numpy type its values take.
_KINDS = {"int64": (b"i", np.int64), "float32": (b"f", np.float32), "string": (b"b", object)}


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
        # an empty default is none, as TF's parser takes an empty dense default for "required"
        if default_value is not None and np.size(default_value) > 0:
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


class RaggedFeature:
    """TF's ``tf.io.RaggedFeature`` of int64 ids without partitions: any number of ids per
    record, parsed to a :class:`~pstrain.JaggedTensor` (its bags, as TF's ``RaggedTensor``
    of shape ``(batch, None)``); ``value_key``: the feature's name in the records (default:
    its key in the spec). A float or bytes ragged feature has no pstrain type (a
    ``JaggedTensor`` holds ids): ``VarLenFeature`` gives it as a ``SparseTensor``.
    ``row_splits_dtype`` and ``validate`` are TF's, accepted (the offsets are int64)."""

    __slots__ = ("dtype", "value_key")

    def __init__(
        self,
        dtype: Any,
        value_key: str | None = None,
        partitions: Sequence[Any] = (),
        row_splits_dtype: Any = None,
        validate: bool = False,
    ) -> None:
        self.dtype = _kind(dtype, "RaggedFeature")
        if self.dtype != "int64":
            raise InvalidArgumentError(
                f"RaggedFeature: a ragged feature of {self.dtype} has no pstrain type (a JaggedTensor "
                "holds int64 ids): parse it with VarLenFeature, as a SparseTensor"
            )
        if partitions:
            raise InvalidArgumentError("RaggedFeature: partitions are not supported (one ragged dimension)")
        if value_key is not None and (not isinstance(value_key, str) or not value_key):
            raise InvalidArgumentError(
                f"RaggedFeature: value_key must be a feature's name, got {value_key!r}"
            )
        self.value_key = value_key

    def __repr__(self) -> str:
        return f"RaggedFeature(dtype={self.dtype}, value_key={self.value_key!r})"


def parse_example(
    serialized: Any, features: Mapping[str, Any], example_names: Any = None, name: str | None = None
) -> dict[str, Any]:
    """TF's ``tf.io.parse_example``: a batch of serialized ``tf.train.Example``\\ s (a list or
    1-D array of bytes, such as a batch of a :class:`TFRecordDataset`) parsed by
    ``features`` (``{name: FixedLenFeature | VarLenFeature | RaggedFeature}``; a ragged
    one a :class:`~pstrain.JaggedTensor`) into ``{name: array of
    (batch, *shape)}`` and ``{name: SparseTensor of dense_shape (batch, longest)}``.
    ``example_names`` and ``name`` are TF's, accepted. A record that does not parse, a
    feature of the wrong type or length, or one missing without a default is refused,
    naming the record and the feature."""
    records = _records(serialized)
    specs = _specs(features)
    # the names read in the records (a ragged feature's value_key may name another)
    sources = sorted({getattr(spec, "value_key", None) or key for key, spec in specs.items()})
    kind_of: dict[str, str] = {}
    for key, spec in specs.items():
        source = getattr(spec, "value_key", None) or key
        if kind_of.setdefault(source, spec.dtype) != spec.dtype:
            raise InvalidArgumentError(f"parse_example: feature {source!r} is asked for as two dtypes")
    kinds = b"".join(_KINDS[kind_of[name]][0] for name in sources)
    try:
        values, counts = KERNELS.parse_examples(
            records, {k.encode(): i for i, k in enumerate(sources)}, kinds
        )
    except ValueError as exc:
        raise InvalidArgumentError(f"parse_example: {exc}") from None
    out: dict[str, Any] = {}
    for key, spec in specs.items():
        f = sources.index(getattr(spec, "value_key", None) or key)
        flat, count = values[f], counts[f]
        if isinstance(spec, FixedLenFeature):
            out[key] = _fixed(flat, count, key, spec)
        elif isinstance(spec, RaggedFeature):
            out[key] = JaggedTensor(flat, np.maximum(count, 0))
        else:
            lengths = np.maximum(count, 0)
            rows = np.repeat(np.arange(len(records), dtype=np.int64), lengths)
            starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
            cols = np.arange(flat.size, dtype=np.int64) - starts
            out[key] = SparseTensor(
                np.stack([rows, cols], axis=1), flat, [len(records), int(lengths.max(initial=0))]
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
        elif isinstance(value, JaggedTensor):  # one record's ids (TF: a 1-D tensor)
            out[key] = value.values
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


def _specs(features: Mapping[str, Any]) -> dict[str, FixedLenFeature | VarLenFeature | RaggedFeature]:
    if not isinstance(features, Mapping) or not features:
        raise InvalidArgumentError(
            "parse_example: features must be a dict of "
            "{name: FixedLenFeature | VarLenFeature | RaggedFeature}"
        )
    for key, spec in features.items():
        if not isinstance(spec, (FixedLenFeature, VarLenFeature, RaggedFeature)):
            raise InvalidArgumentError(
                f"parse_example: feature {key!r}: expected a FixedLenFeature, VarLenFeature or "
                f"RaggedFeature, got {spec!r}"
            )
    return dict(features)


def _fixed(flat: np.ndarray, count: np.ndarray, key: str, spec: FixedLenFeature) -> np.ndarray:
    """A fixed feature's ``(batch, *shape)`` array: each record's values, or the default
    where it has none; a record of another count, or missing without a default, refused."""
    size = int(np.prod(spec.shape))
    missing = count < 0
    wrong = np.flatnonzero(~missing & (count != size))
    if wrong.size:
        raise InvalidArgumentError(
            f"parse_example: record {wrong[0]}: feature {key!r} of shape {spec.shape} holds "
            f"{count[wrong[0]]} values, not {size}"
        )
    if missing.any() and spec.default_value is None:
        raise InvalidArgumentError(
            f"parse_example: record {np.flatnonzero(missing)[0]}: feature {key!r} (data type: "
            f"{spec.dtype}) is required but could not be found"
        )
    out = np.empty((count.size, size), flat.dtype)
    out[~missing] = flat.reshape(int(count.size - missing.sum()), size)  # (size 0 too)
    if missing.any():
        assert spec.default_value is not None
        out[missing] = spec.default_value.reshape(size)
    return out.reshape(count.size, *spec.shape)


expose(globals(), "pstrain.data")
