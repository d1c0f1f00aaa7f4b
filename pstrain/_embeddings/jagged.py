"""Variable-length features: for each example, a bag of ids (and optionally a weight per id).

:class:`JaggedTensor` is one feature over a batch: its ids end to end (``values``), where
each example's bag starts (``offsets``, one more than the examples) and optional
``weights``. :class:`KeyedJaggedTensor` is many features of one batch, TorchRec's layout:
the features' values one after the other, ``lengths`` feature-major. :class:`SparseTensor`
is TF's ``(indices, values, dense_shape)``; :func:`as_jagged` turns it (or a TF
``SparseTensor`` or ``RaggedTensor``, or a list of lists, or a dense 2-D array) into a
:class:`JaggedTensor`.

All are numpy, and ``pstrain.data`` batches, shuffles and shards them like arrays (a
dataset of them works on row indices: :meth:`JaggedTensor.take`).

>>> jt = JaggedTensor([4, 1, 7, 7, 2], lengths=[2, 0, 3])
>>> len(jt), jt.lengths.tolist(), jt.offsets.tolist()
(3, [2, 0, 3], [0, 2, 2, 5])
>>> jt.take([2, 0]).values.tolist()
[7, 7, 2, 4, 1]
>>> kjt = KeyedJaggedTensor(["a", "b"], [1, 2, 3], lengths=[1, 0, 2, 0])
>>> kjt["b"].values.tolist(), kjt.stride()
([2, 3], 2)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .._base.errors import InvalidArgumentError
from .._base.exports import expose
from .._kernels.batches import interleave_bags, take_bags, take_examples, take_keyed_bags
from .._training.elements import BAGS, COMPONENT_CONVERTERS, ROW_SOURCES, SPARSE

__all__ = ["JaggedTensor", "KeyedJaggedTensor", "SparseTensor", "as_jagged", "as_numpy"]


def as_numpy(x: Any) -> np.ndarray:
    """An array from numpy, a list, or a framework tensor (``.numpy()``)."""
    if hasattr(x, "numpy") and not isinstance(x, np.ndarray):
        x = x.detach().cpu().numpy() if hasattr(x, "detach") else x.numpy()
    return np.asarray(x)


def _ids(values: Any, what: str) -> np.ndarray:
    arr = as_numpy(values)
    if arr.size == 0:
        return arr.reshape(0).astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"{what}: ids must be integers, got {arr.dtype}")
    if arr.ndim != 1:
        raise InvalidArgumentError(f"{what}: ids must be 1-D, got shape {arr.shape}")
    return arr


def _rows(rows: Any, n: int, what: str) -> np.ndarray:
    """Row indices ``rows`` (an int, a slice, integers, below 0 from the end, or a mask of
    ``n`` booleans, as numpy indexes) of ``n`` rows, as contiguous int64 in range."""
    if isinstance(rows, slice):
        return np.arange(n, dtype=np.int64)[rows]
    given = np.asarray(rows)
    if given.dtype == np.bool_:
        if given.shape != (n,):
            raise IndexError(f"{what}: a boolean mask of {given.shape} for {n} bags")
        return np.flatnonzero(given).astype(np.int64)
    if given.size and given.dtype.kind not in "iu":  # (an empty list is float64 to numpy)
        raise IndexError(f"{what}: row indices must be integers, got {given.dtype}")
    idx = np.ascontiguousarray(given.reshape(-1), np.int64)
    if idx.size:
        low, high = int(idx.min()), int(idx.max())
        if low < -n or high >= n:
            raise IndexError(f"{what}: row index out of range for {n} bags")
        if low < 0:
            idx = np.where(idx < 0, idx + n, idx)
    return idx


#: ``JaggedTensor._width`` not worked out yet.
_UNKNOWN = -1


def _offsets(lengths: Any, offsets: Any, n_values: int, what: str) -> np.ndarray:
    if (lengths is None) == (offsets is None):
        raise InvalidArgumentError(f"{what}: give lengths or offsets (one of them)")
    if lengths is not None:
        ln = as_numpy(lengths).reshape(-1)
        if ln.size and (ln.dtype.kind not in "iu" or int(ln.min()) < 0):
            raise InvalidArgumentError(f"{what}: lengths must be integers >= 0")
        out = np.zeros(ln.size + 1, np.int64)
        np.cumsum(ln, out=out[1:])
    else:
        out = as_numpy(offsets).reshape(-1).astype(np.int64)
        if out.size == 0 or out[0] != 0 or (out.size > 1 and bool(np.any(out[1:] < out[:-1]))):
            raise InvalidArgumentError(
                f"{what}: offsets must start at 0 and never decrease, got {out[:8].tolist()}"
            )
    if int(out[-1]) != n_values:
        raise InvalidArgumentError(
            f"{what}: the bags hold {int(out[-1])} ids but {n_values} values were given"
        )
    return out


class JaggedTensor:
    """One feature over a batch: example ``i``'s bag is ``values[offsets[i]:offsets[i+1]]``,
    with ``weights`` (float, one per id) or None (every weight 1)."""

    __slots__ = ("values", "offsets", "weights", "_width")

    def __init__(self, values: Any, lengths: Any = None, *, offsets: Any = None, weights: Any = None) -> None:
        self.values = _ids(values, "JaggedTensor")
        self.offsets = _offsets(lengths, offsets, self.values.size, "JaggedTensor")
        self._width: int | None = _UNKNOWN
        self.weights: np.ndarray | None = None
        if weights is not None:
            w = as_numpy(weights).reshape(-1)
            if w.dtype.kind not in "fiu" or w.size != self.values.size:
                raise InvalidArgumentError(
                    f"JaggedTensor: weights must be {self.values.size} "
                    f"numbers (one per id), got {w.size} of {w.dtype}"
                )
            self.weights = w if w.dtype.kind == "f" else w.astype(np.float32)

    # -- constructors ------------------------------------------------------------------------
    @classmethod
    def from_row_splits(cls, values: Any, row_splits: Any, weights: Any = None) -> JaggedTensor:
        """As ``tf.RaggedTensor.from_row_splits``: ``row_splits`` are the offsets."""
        return cls(values, offsets=row_splits, weights=weights)

    @classmethod
    def from_lists(
        cls,
        bags: Iterable[Sequence[int]],
        weights: Iterable[Sequence[float]] | None = None,
    ) -> JaggedTensor:
        """From a list of bags (lists of ids), and optionally their weights alike."""
        bags = [list(b) for b in bags]
        flat = [i for b in bags for i in b]
        values = np.array(flat) if flat else np.zeros(0, np.int64)  # (ids as given: 1.5 is refused)
        w = None
        if weights is not None:
            per_bag = [list(x) for x in weights]
            if [len(x) for x in per_bag] != [len(b) for b in bags]:
                raise InvalidArgumentError(
                    "JaggedTensor.from_lists: weights must be a list per bag, as long as its bag"
                )
            w = np.array([x for b in per_bag for x in b], np.float32)
        return cls(values, [len(b) for b in bags], weights=w)

    @classmethod
    def from_dense(cls, ids: Any, weights: Any = None) -> JaggedTensor:
        """Every example's bag is its row of the 2-D ``ids`` (all bags as long)."""
        arr = as_numpy(ids)
        if arr.ndim != 2:
            raise InvalidArgumentError(f"JaggedTensor.from_dense: ids must be 2-D, got {arr.shape}")
        w = None
        if weights is not None:
            w = as_numpy(weights)
            if w.shape != arr.shape:
                raise InvalidArgumentError(
                    f"JaggedTensor.from_dense: weights must have the ids' shape {arr.shape}, got {w.shape}"
                )
            w = w.reshape(-1)
        n, width = arr.shape
        # Every bag ``width`` long: the offsets and the width are known, nothing to check or
        # sum (a batch's single-hot features come this way).
        jagged = cls.__new__(cls)
        jagged.values = _ids(arr.reshape(-1), "JaggedTensor.from_dense")
        jagged.offsets = np.arange(n + 1, dtype=np.int64) * width
        jagged._width = width if n else None  # noqa: SLF001 - this class's own
        jagged.weights = None
        if w is not None:
            if w.dtype.kind not in "fiu":
                raise InvalidArgumentError(f"JaggedTensor.from_dense: weights must be numbers, got {w.dtype}")
            jagged.weights = w if w.dtype.kind == "f" else w.astype(np.float32)
        return jagged

    @classmethod
    def from_sparse(cls, sp_ids: Any, sp_weights: Any = None) -> JaggedTensor:
        """From a 2-D :class:`SparseTensor` (or TF's) of ids, in row-major order, and optionally
        one of weights with the same indices: example ``i``'s bag is the values of row ``i``;
        a row with no entry is an empty bag."""
        indices, values, shape = _sparse_parts(sp_ids, "sp_ids")
        if len(shape) != 2:
            raise InvalidArgumentError(f"sp_ids must be 2-D, got dense_shape {list(shape)}")
        rows = indices[:, 0] if indices.size else np.zeros(0, np.int64)
        if rows.size and (
            bool(np.any(rows[1:] < rows[:-1])) or int(rows[-1]) >= shape[0] or int(rows[0]) < 0
        ):
            raise InvalidArgumentError(
                "sp_ids: indices must be in row-major order and within "
                "dense_shape (tf.sparse.reorder puts them in order)"
            )
        weights = None
        if sp_weights is not None:
            w_indices, weights, w_shape = _sparse_parts(sp_weights, "sp_weights")
            if (
                w_indices.shape != indices.shape
                or not np.array_equal(w_indices, indices)
                or list(w_shape) != list(shape)
            ):
                raise InvalidArgumentError("sp_weights must have the same indices and dense_shape as sp_ids")
        lengths = np.bincount(rows, minlength=int(shape[0]))
        return cls(values, lengths, weights=weights)

    # -- what it is --------------------------------------------------------------------------
    @property
    def lengths(self) -> np.ndarray:
        """Each bag's number of ids (int64, one per bag)."""
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return self.offsets.size - 1

    def width(self) -> int | None:
        """The length of every bag if all are as long (a single-hot feature: 1), else None."""
        if self._width == _UNKNOWN:
            n, size = len(self), self.values.size
            w = size // n if n and size % n == 0 else None
            if w is not None and not np.array_equal(self.offsets, np.arange(n + 1) * w):
                w = None
            self._width = w
        return self._width

    def segment_ids(self) -> np.ndarray:
        """The example of each id (``tf.RaggedTensor.value_rowids``)."""
        return np.repeat(np.arange(len(self), dtype=np.int64), self.lengths)

    def to_lists(self) -> list[list[int]]:
        """The bags as Python lists of ids."""
        o = self.offsets
        return [self.values[o[i] : o[i + 1]].tolist() for i in range(len(self))]

    def to_padded_dense(self, desired_length: int | None = None, padding_value: int = 0) -> np.ndarray:
        """``[bags, N]``: each bag's ids, cut to ``N`` (``desired_length``, or the longest
        bag's) keeping its first ids, or padded with ``padding_value`` (TorchRec's name; TF's
        ``RaggedTensor.to_tensor``): ids of one shape whatever the batch, as a compiled JAX
        step wants them (``pstrain.jax.lookup`` of them, the padding masked in the loss)."""
        lengths = self.lengths
        n = (int(lengths.max()) if lengths.size else 0) if desired_length is None else int(desired_length)
        if n < 0:
            raise InvalidArgumentError(f"to_padded_dense: desired_length must be 0 or more, got {n}")
        out = np.full((len(self), n), padding_value, self.values.dtype)
        position = np.arange(self.values.size) - np.repeat(self.offsets[:-1], lengths)
        kept = position < n
        out[self.segment_ids()[kept], position[kept]] = self.values[kept]
        return out

    def __repr__(self) -> str:
        w = "" if self.weights is None else ", weighted"
        return f"JaggedTensor({len(self)} bags, {self.values.size} ids{w})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, JaggedTensor):
            return NotImplemented
        if not (np.array_equal(self.values, other.values) and np.array_equal(self.offsets, other.offsets)):
            return False
        if self.weights is None or other.weights is None:
            return self.weights is None and other.weights is None
        return np.array_equal(self.weights, other.weights)

    __hash__ = None  # type: ignore[assignment]

    # -- rows --------------------------------------------------------------------------------
    def take(self, rows: Any) -> JaggedTensor:
        """The bags of examples ``rows`` (an int, a slice or integers), in that order."""
        return self._take(_rows(rows, len(self), "JaggedTensor"))

    def _take(self, idx: np.ndarray) -> JaggedTensor:
        """:meth:`take` of rows already checked: int64, contiguous, each in range."""
        out = JaggedTensor.__new__(JaggedTensor)
        w = self.width()
        if w is not None:  # bags all as long (single-hot): rows of a 2-D view
            out.values = _bags_of_width(self.values, w, idx)
            out.offsets = np.arange(idx.size + 1, dtype=np.int64) * w
            out.weights = None if self.weights is None else _bags_of_width(self.weights, w, idx)
            out._width = w  # noqa: SLF001 - this class's own
            return out
        out_offsets = np.empty(idx.size + 1, np.int64)
        out.values = take_bags(self.values, self.offsets, idx, out_offsets)
        out.offsets = out_offsets
        out.weights = (
            None if self.weights is None else take_bags(self.weights, self.offsets, idx, out_offsets)
        )
        out._width = _UNKNOWN  # noqa: SLF001
        return out

    def __getitem__(self, rows: Any) -> JaggedTensor:
        return self.take(rows)

    @staticmethod
    def concat_rows(parts: Sequence[JaggedTensor]) -> JaggedTensor:
        """The bags of ``parts`` one after the other (batches joined, as ``pstrain.data``
        batches them)."""
        if not parts:
            raise InvalidArgumentError("JaggedTensor.concat_rows needs at least one part")
        weighted = {p.weights is not None for p in parts}
        if len(weighted) != 1:
            raise InvalidArgumentError("JaggedTensor.concat_rows: some parts have weights, some not")
        values = np.concatenate([p.values for p in parts])
        lengths = np.concatenate([p.lengths for p in parts])
        weights = (
            np.concatenate([p.weights for p in parts if p.weights is not None]) if weighted.pop() else None
        )
        return JaggedTensor(values, lengths, weights=weights)


def _bags_of_width(flat: np.ndarray, width: int, idx: np.ndarray) -> np.ndarray:
    """Bags ``idx`` of ``flat`` (ids or weights), every bag ``width`` long: rows of a 2-D
    view (bags of none: no rows to view)."""
    return take_examples(flat.reshape(-1, width), idx).reshape(-1) if width else flat[:0]


class SparseTensor:
    """TF's ``SparseTensor``: ``values[k]`` sits at ``indices[k]`` of a ``dense_shape`` array.

    >>> sp = SparseTensor([[0, 0], [0, 1], [2, 0]], [5, 6, 7], dense_shape=[3, 2])
    >>> JaggedTensor.from_sparse(sp).to_lists()
    [[5, 6], [], [7]]
    """

    __slots__ = ("indices", "values", "dense_shape")

    def __init__(self, indices: Any, values: Any, dense_shape: Any) -> None:
        self.indices = as_numpy(indices).astype(np.int64).reshape(-1, len(as_numpy(dense_shape)) or 1)
        self.values = as_numpy(values).reshape(-1)
        self.dense_shape = as_numpy(dense_shape).astype(np.int64).reshape(-1)
        if self.indices.shape[0] != self.values.size:
            raise InvalidArgumentError(
                f"SparseTensor: {self.indices.shape[0]} indices for {self.values.size} values"
            )

    def __repr__(self) -> str:
        return f"SparseTensor({self.values.size} values, dense_shape={self.dense_shape.tolist()})"


def _sparse_parts(sp: Any, what: str) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    if not all(hasattr(sp, a) for a in ("indices", "values", "dense_shape")):
        raise InvalidArgumentError(
            f"{what} must be a SparseTensor (indices, values, dense_shape), got {type(sp).__name__}"
        )
    shape = tuple(int(d) for d in as_numpy(sp.dense_shape).reshape(-1))
    indices = as_numpy(sp.indices).astype(np.int64).reshape(-1, max(1, len(shape)))
    return indices, as_numpy(sp.values).reshape(-1), shape


def as_jagged(ids: Any, weights: Any = None, what: str = "ids") -> JaggedTensor:
    """``ids`` as a :class:`JaggedTensor`, with ``weights`` (the same kind as ``ids``, or
    None): a JaggedTensor (pstrain's, or TorchRec's), a SparseTensor (pstrain's or TF's), a
    RaggedTensor (TF's: ``values`` and ``row_splits``), a list of lists, or a 2-D array
    (every bag as long)."""
    if isinstance(ids, JaggedTensor):
        if weights is None:
            return ids
        return JaggedTensor(ids.values, offsets=ids.offsets, weights=_weights_of(weights, ids))
    if all(hasattr(ids, a) for a in ("indices", "values", "dense_shape")):
        return JaggedTensor.from_sparse(ids, weights)
    if callable(getattr(ids, "values", None)) and callable(getattr(ids, "offsets", None)):
        # TorchRec's JaggedTensor (or pstrain.torch's): its arrays are methods
        given = ids.weights_or_none() if weights is None and hasattr(ids, "weights_or_none") else weights
        return JaggedTensor(
            ids.values(), offsets=ids.offsets(), weights=None if given is None else as_numpy(given)
        )
    if hasattr(ids, "row_splits") and hasattr(ids, "values"):
        values = getattr(ids, "flat_values", ids.values)
        return JaggedTensor(
            values,
            offsets=as_numpy(ids.row_splits),
            weights=None
            if weights is None
            else as_numpy(getattr(weights, "flat_values", getattr(weights, "values", weights))),
        )
    if isinstance(ids, (list, tuple)) and all(isinstance(b, (list, tuple, np.ndarray)) for b in ids):
        return JaggedTensor.from_lists(ids, weights)
    arr = as_numpy(ids)
    if arr.ndim == 2:
        return JaggedTensor.from_dense(arr, weights)
    raise InvalidArgumentError(
        f"{what}: expected a JaggedTensor, a SparseTensor, a RaggedTensor, "
        f"a list of lists or a 2-D array, got {type(ids).__name__} "
        f"of shape {getattr(arr, 'shape', '?')}"
    )


def features_by_name(features: Any, what: str = "lookup") -> dict[str, JaggedTensor]:
    """A batch's features by name: a :class:`KeyedJaggedTensor`'s, TorchRec's (its
    ``to_dict()`` of ``JaggedTensor``\\ s), or a dict's (each :func:`as_jagged`)."""
    if isinstance(features, KeyedJaggedTensor):
        return features.to_dict()
    if isinstance(features, Mapping):
        return {str(k): as_jagged(v, what=f"feature {k!r}") for k, v in features.items()}
    if callable(getattr(features, "to_dict", None)) and callable(getattr(features, "keys", None)):
        return {str(k): as_jagged(v, what=f"feature {k!r}") for k, v in features.to_dict().items()}
    raise InvalidArgumentError(
        f"{what} takes a KeyedJaggedTensor (pstrain's or TorchRec's) or a dict of features, got "
        f"{type(features).__name__}"
    )


def _sliced_as_jagged(component: Any) -> JaggedTensor | None:
    """A dataset's SparseTensor or RaggedTensor component (pstrain's or TF's) as the
    JaggedTensor of its rows; None for anything else."""
    if all(hasattr(component, a) for a in ("indices", "values", "dense_shape")):
        return JaggedTensor.from_sparse(component)  # refuses a rank other than 2, by name
    if hasattr(component, "row_splits") and hasattr(component, "values"):
        return as_jagged(component, what="from_tensor_slices")
    return None


COMPONENT_CONVERTERS.append(_sliced_as_jagged)
BAGS.append(JaggedTensor)
SPARSE.append(SparseTensor)


def _weights_of(weights: Any, ids: JaggedTensor) -> np.ndarray:
    if isinstance(weights, JaggedTensor):
        if not np.array_equal(weights.offsets, ids.offsets):
            raise InvalidArgumentError("weights must have the same bags as the ids")
        return weights.values
    if hasattr(weights, "values") and not isinstance(weights, np.ndarray):
        return as_numpy(weights.values)
    return as_numpy(weights)


class KeyedJaggedTensor:
    """Many features of one batch, as TorchRec's ``KeyedJaggedTensor``: ``values`` holds each
    key's ids one key after the other, ``lengths`` (or ``offsets``) the bag lengths key-major
    (key 0's ``stride`` bags, then key 1's ...), ``weights`` one per id or None."""

    __slots__ = ("_keys", "_features", "_stride")

    def __init__(
        self,
        keys: Sequence[str],
        values: Any,
        lengths: Any = None,
        *,
        offsets: Any = None,
        weights: Any = None,
        stride: int | None = None,
    ) -> None:
        keys = [str(k) for k in keys]
        if len(set(keys)) != len(keys):
            raise InvalidArgumentError(f"KeyedJaggedTensor: keys repeat: {keys}")
        flat = JaggedTensor(values, lengths, offsets=offsets, weights=weights)
        n = len(flat)
        if keys and n % len(keys):
            raise InvalidArgumentError(
                f"KeyedJaggedTensor: {n} lengths are not a multiple of {len(keys)} keys"
            )
        b = n // len(keys) if keys else int(stride or 0)
        if stride is not None and keys and stride != b:
            raise InvalidArgumentError(
                f"KeyedJaggedTensor: stride {stride} but {n} lengths for {len(keys)} keys"
            )
        self._keys = keys
        self._stride = b
        self._features = {k: flat.take(np.arange(i * b, (i + 1) * b)) for i, k in enumerate(keys)}

    @classmethod
    def from_lengths_sync(
        cls, keys: Sequence[str], values: Any, lengths: Any, weights: Any = None, stride: int | None = None
    ) -> KeyedJaggedTensor:
        """TorchRec's constructor of the same name: bag ``lengths``, key-major."""
        return cls(keys, values, lengths, weights=weights, stride=stride)

    @classmethod
    def from_offsets_sync(
        cls, keys: Sequence[str], values: Any, offsets: Any, weights: Any = None, stride: int | None = None
    ) -> KeyedJaggedTensor:
        """TorchRec's constructor of the same name: bag ``offsets`` (one more than the bags)."""
        return cls(keys, values, offsets=offsets, weights=weights, stride=stride)

    @classmethod
    def from_jt_dict(cls, features: Mapping[str, JaggedTensor]) -> KeyedJaggedTensor:
        """From ``{key: JaggedTensor}`` (every feature with the same number of examples; a
        TorchRec ``JaggedTensor``, or ``pstrain.torch``'s, is taken as its arrays)."""
        features = {str(k): as_jagged(v, what=f"feature {k!r}") for k, v in features.items()}
        strides = {len(jt) for jt in features.values()}
        if len(strides) > 1:
            raise InvalidArgumentError(
                f"KeyedJaggedTensor: features of different batch sizes {sorted(strides)}"
            )
        out = cls.__new__(cls)  # this class's own constructor, without the flat arrays
        out._keys = [str(k) for k in features]  # noqa: SLF001
        out._stride = strides.pop() if strides else 0  # noqa: SLF001
        out._features = features  # noqa: SLF001
        return out

    def keys(self) -> list[str]:
        """The feature names, in order."""
        return list(self._keys)

    def stride(self) -> int:
        """The number of examples (the batch size)."""
        return self._stride

    def __len__(self) -> int:
        return self._stride

    def __getitem__(self, key: str) -> JaggedTensor:
        try:
            return self._features[key]
        except KeyError:
            raise InvalidArgumentError(
                f"KeyedJaggedTensor has no feature {key!r}; it has {self._keys}"
            ) from None

    def __contains__(self, key: object) -> bool:
        return key in self._features

    def to_dict(self) -> dict[str, JaggedTensor]:
        """``{feature: JaggedTensor}``, in the order of :meth:`keys`."""
        return dict(self._features)

    def values(self) -> np.ndarray:
        """Every feature's ids, one feature after the other (TorchRec's layout)."""
        if not self._keys:
            return np.zeros(0, np.int64)
        return np.concatenate([f.values for f in self._features.values()])

    def lengths(self) -> np.ndarray:
        """The bag lengths, feature-major."""
        if not self._keys:
            return np.zeros(0, np.int64)
        return np.concatenate([f.lengths for f in self._features.values()])

    def offsets(self) -> np.ndarray:
        """Where each bag starts in :meth:`values`, then the end (TorchRec's ``offsets()``)."""
        out = np.zeros(self.lengths().size + 1, np.int64)
        np.cumsum(self.lengths(), out=out[1:])
        return out

    def length_per_key(self) -> list[int]:
        """Each feature's number of ids (TorchRec's ``length_per_key()``)."""
        return [int(f.values.size) for f in self._features.values()]

    def offset_per_key(self) -> list[int]:
        """Where each feature's ids start in :meth:`values`, then the end (TorchRec's)."""
        return [0, *np.cumsum(self.length_per_key(), dtype=np.int64).tolist()]

    def weights(self) -> np.ndarray:
        """Every id's weight, feature-major; an error if no feature has weights (TorchRec's
        ``weights()``; :meth:`weights_or_none` returns None instead)."""
        w = self.weights_or_none()
        if w is None:
            raise InvalidArgumentError("this KeyedJaggedTensor has no weights")
        return w

    def weights_or_none(self) -> np.ndarray | None:
        """Every id's weight, feature-major (1 for a feature without weights), or None if no
        feature has weights."""
        feats = list(self._features.values())
        if all(f.weights is None for f in feats):
            return None
        return np.concatenate(
            [np.ones(f.values.size, np.float32) if f.weights is None else f.weights for f in feats]
        )

    def lengths_or_none(self) -> np.ndarray:
        """:meth:`lengths` (TorchRec's name; here never None)."""
        return self.lengths()

    def offsets_or_none(self) -> np.ndarray:
        """:meth:`offsets` (TorchRec's name; here never None)."""
        return self.offsets()

    def permute(self, indices: Sequence[int], indices_tensor: Any = None) -> KeyedJaggedTensor:
        """TorchRec's: the features ``keys()[i]`` for each ``i`` of ``indices``, in that order."""
        order = [int(i) for i in as_numpy(indices).reshape(-1)]
        if any(not 0 <= i < len(self._keys) for i in order):
            raise InvalidArgumentError(
                f"KeyedJaggedTensor.permute: indices must be in [0, {len(self._keys)}), got {order}"
            )
        return KeyedJaggedTensor.from_jt_dict({self._keys[i]: self._features[self._keys[i]] for i in order})

    def split(self, segments: Sequence[int]) -> list[KeyedJaggedTensor]:
        """TorchRec's: consecutive groups of ``segments[i]`` features each."""
        sizes = [int(n) for n in segments]
        if any(n < 0 for n in sizes) or sum(sizes) != len(self._keys):
            raise InvalidArgumentError(
                f"KeyedJaggedTensor.split: segments {sizes} do not add up to its {len(self._keys)} keys"
            )
        out, start = [], 0
        for n in sizes:
            keys = self._keys[start : start + n]
            part = KeyedJaggedTensor.from_jt_dict({k: self._features[k] for k in keys})
            part._stride = self._stride  # noqa: SLF001 - this class's own (a group of no keys too)
            out.append(part)
            start += n
        return out

    def to(self, device: Any = None, non_blocking: bool = False, dtype: Any = None) -> KeyedJaggedTensor:
        """TorchRec's (a training loop's ``batch.to(device)``): itself, on the CPU, where
        pstrain pools; another device is refused."""
        name = str(getattr(device, "type", device) or "cpu")
        if not name.startswith("cpu"):
            raise InvalidArgumentError(
                f"KeyedJaggedTensor.to({device!r}): pstrain pools on the worker's CPU (the rows come "
                "from the ps): move the pooled output to the device instead"
            )
        return self

    def pin_memory(self) -> KeyedJaggedTensor:
        """TorchRec's: itself (its arrays stay where they are)."""
        return self

    def take(self, rows: Any) -> KeyedJaggedTensor:
        """The examples ``rows`` of every feature (what ``pstrain.data`` batches with)."""
        idx = _rows(rows, self._stride, "KeyedJaggedTensor")  # checked once for every feature
        out = KeyedJaggedTensor.__new__(KeyedJaggedTensor)
        out._keys = list(self._keys)  # noqa: SLF001 - this class's own
        out._stride = idx.size  # noqa: SLF001
        out._features = {k: f._take(idx) for k, f in self._features.items()}  # noqa: SLF001
        return out

    @staticmethod
    def concat(kjt_list: Sequence[KeyedJaggedTensor]) -> KeyedJaggedTensor:
        """TorchRec's: the features of every part side by side (``keys()`` one part's after
        the other's), for the same examples: the parts' strides must agree and no key may
        come twice. Each feature keeps its weights (TorchRec refuses to mix weighted parts
        with unweighted ones; here a feature without weights weighs 1)."""
        parts = list(kjt_list)
        if not parts:
            raise InvalidArgumentError("KeyedJaggedTensor.concat needs at least one part")
        strides = [p.stride() for p in parts]
        if len(set(strides)) > 1:
            raise InvalidArgumentError(
                f"KeyedJaggedTensor.concat: the parts have strides {strides}; they must be the "
                "same examples (concat_rows joins batches)"
            )
        keys = [k for p in parts for k in p.keys()]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:
            raise InvalidArgumentError(f"KeyedJaggedTensor.concat: keys {twice} are in more than one part")
        out = KeyedJaggedTensor.from_jt_dict({k: p[k] for p in parts for k in p.keys()})
        out._stride = strides[0]  # noqa: SLF001 - this class's own (parts of no keys too)
        return out

    @staticmethod
    def concat_rows(parts: Sequence[KeyedJaggedTensor]) -> KeyedJaggedTensor:
        """The examples of ``parts`` one after the other (batches joined, as ``pstrain.data``
        batches them); every part has the same keys."""
        if not parts:
            raise InvalidArgumentError("KeyedJaggedTensor.concat_rows needs at least one part")
        keys = parts[0].keys()
        if any(p.keys() != keys for p in parts):
            raise InvalidArgumentError("KeyedJaggedTensor.concat_rows: parts with other keys")
        out = KeyedJaggedTensor.from_jt_dict(
            {k: JaggedTensor.concat_rows([p[k] for p in parts]) for k in keys}
        )
        out._stride = sum(p.stride() for p in parts)  # noqa: SLF001 - (parts of no keys too)
        return out

    def __repr__(self) -> str:
        return f"KeyedJaggedTensor(keys={self._keys}, stride={self._stride})"


class ExampleMajorBags:
    """A :class:`KeyedJaggedTensor`'s examples kept example by example: each example's bags
    of every feature side by side in one array, what ``Dataset.from_tensor_slices`` slices a
    KeyedJaggedTensor from. :meth:`take` gives the same KeyedJaggedTensor as the original's
    ``take``. A batch drawn at random (a shuffled dataset) then waits on a cache miss or two
    an example rather than two a bag of every feature: W8's 13 multi-hot features, 2,048
    examples drawn from a million, took 0.64 to 0.69 ms a batch kept so against 1.7 to 1.8
    feature by feature. Made by :meth:`of`, which copies the ids (and weights) once."""

    __slots__ = ("_keys", "_values", "_offsets", "_lengths", "_weights", "_weighted", "_widths")

    @classmethod
    def of(cls, kjt: KeyedJaggedTensor) -> ExampleMajorBags | KeyedJaggedTensor:
        """``kjt`` kept example by example; ``kjt`` itself where that would not pay or cannot
        hold it in one array: fewer than two features or no examples, or features whose ids
        (or weights) differ in dtype."""
        feats = [kjt[k] for k in kjt.keys()]
        if (
            len(feats) < 2
            or not kjt.stride()
            or len({f.values.dtype for f in feats}) != 1
            or feats[0].values.dtype.hasobject
            or len({f.weights.dtype for f in feats if f.weights is not None}) > 1
        ):
            return kjt
        lengths = np.empty((kjt.stride(), len(feats)), np.int32)  # (an example's bag of a feature)
        for i, f in enumerate(feats):
            bags = f.lengths
            if int(bags.max()) > np.iinfo(np.int32).max:
                return kjt
            lengths[:, i] = bags
        return cls(kjt, lengths)

    def __init__(self, kjt: KeyedJaggedTensor, lengths: np.ndarray) -> None:
        """(Through :meth:`of`, which says which ``kjt`` it can hold and gives its bags'
        ``lengths``, an example a row.)"""
        self._keys = kjt.keys()
        feats = [kjt[k] for k in self._keys]
        self._lengths = lengths
        self._offsets = np.zeros(kjt.stride() + 1, np.int64)
        np.cumsum(lengths.sum(1, dtype=np.int64), out=self._offsets[1:])
        self._values = self._interleaved([f.values for f in feats], feats, feats[0].values.dtype)
        self._weighted = [f.weights is not None for f in feats]
        self._weights: np.ndarray | None = None
        if any(self._weighted):
            dtype = next(f.weights.dtype for f in feats if f.weights is not None)
            ones = [np.ones(f.values.size, dtype) if f.weights is None else f.weights for f in feats]
            self._weights = self._interleaved(ones, feats, dtype)
        # a feature whose every bag is as long keeps that width in its batches (single-hot: 1)
        self._widths = [_UNKNOWN if f.width() is None else f.width() for f in feats]

    def _interleaved(self, arrays: list[np.ndarray], feats: list[JaggedTensor], dtype: Any) -> np.ndarray:
        """``arrays`` (one a feature, its bags those of ``feats``) example by example. (W8's
        million examples: about 1 s, most of it the first touch of the 213 MB made; laying
        them out a block of examples at a time, every feature's bags of it, did not change
        that.)"""
        out = np.empty(int(self._offsets[-1]), dtype)
        cursor = self._offsets[:-1].copy()
        for a, f in zip(arrays, feats):
            interleave_bags(np.ascontiguousarray(a, dtype), f.offsets, out, cursor)
        return out

    def __len__(self) -> int:
        return self._offsets.size - 1

    def take(self, rows: Any) -> KeyedJaggedTensor:
        """The examples ``rows``, as :meth:`KeyedJaggedTensor.take` gives them."""
        idx = _rows(rows, len(self), "KeyedJaggedTensor")
        out_offsets = np.empty((len(self._keys), idx.size + 1), np.int64)
        values = take_keyed_bags(self._values, self._offsets, self._lengths, idx, out_offsets)
        weights = (
            [None] * len(values)
            if self._weights is None
            else take_keyed_bags(self._weights, self._offsets, self._lengths, idx, np.empty_like(out_offsets))
        )
        features = {}
        for f, key in enumerate(self._keys):
            jt = JaggedTensor.__new__(JaggedTensor)
            jt.values = values[f]
            jt.offsets = out_offsets[f]
            jt.weights = weights[f] if self._weighted[f] else None
            jt._width = self._widths[f]  # noqa: SLF001 - this module's own
            features[key] = jt
        out = KeyedJaggedTensor.__new__(KeyedJaggedTensor)
        out._keys = list(self._keys)  # noqa: SLF001 - this module's own
        out._stride = idx.size  # noqa: SLF001
        out._features = features  # noqa: SLF001
        return out

    concat_rows = staticmethod(KeyedJaggedTensor.concat_rows)

    def __repr__(self) -> str:
        return f"ExampleMajorBags(keys={self._keys}, examples={len(self)})"


def _by_example(component: Any) -> Any:
    """A ``from_tensor_slices`` component kept as its rows are best taken: a
    KeyedJaggedTensor example by example (:class:`ExampleMajorBags`); None for others."""
    return ExampleMajorBags.of(component) if isinstance(component, KeyedJaggedTensor) else None


ROW_SOURCES.append(_by_example)

expose(globals(), "pstrain")
