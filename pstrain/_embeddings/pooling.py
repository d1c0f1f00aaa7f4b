"""Pooled lookups: each example's bag of rows combined into one row, and the way back.

A :class:`Bags` is one feature's batch made ready to pool: the distinct ids to look up,
and for each id of each bag its bag, its row among the distinct ones and its factor (its
weight, divided by the bag's total weight for ``"mean"`` or by the root of the sum of the
squared weights for ``"sqrtn"``, as TF divides: no number for a bag of total 0 gives 0).
:meth:`Bags.pool` sums the factored rows into bags and :meth:`Bags.backward` sends a bag's
gradient back to its rows (summed per distinct id), both by one compiled loop over the
bags (``pool_bags``).

:func:`embedding_lookup_sparse` and :func:`safe_embedding_lookup_sparse` are TF's, on
pstrain's tables (fixed, sharded or dynamic), with TF's rules: combiners ``"sum"``,
``"mean"`` (the default) and ``"sqrtn"``; the first returns as many rows as the last
non-empty bag (TF's segment sum), the safe one as many as the batch, drops ids below 0
(and, unless the combiner is ``"sum"``, ids of weight 0 or less) and gives an empty bag
``default_id``'s row, or zeros.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._base.errors import InvalidArgumentError
from .._kernels import FLOAT_DTYPES, KERNELS, reference
from .._kernels.batches import distinct
from .._variables.arrays import IndexedSlices
from .._variables.dynamic import DynamicEmbedding
from .._variables.sharding import LookupGradient, check_gradient_params, clip_by_norm, embedding_lookup
from .jagged import JaggedTensor, SparseTensor, as_jagged, as_numpy

__all__ = ["COMBINERS", "Bags", "embedding_lookup_sparse", "safe_embedding_lookup_sparse"]

#: TF's combiners.
COMBINERS = ("sum", "mean", "sqrtn")


def check_combiner(combiner: Any) -> str:
    if combiner is None:
        return "mean"  # TF's default
    if combiner not in COMBINERS:
        raise InvalidArgumentError(f"combiner must be one of 'mean', 'sqrtn' or 'sum', got {combiner!r}")
    return str(combiner)


def _pool(
    out: np.ndarray,
    offsets: np.ndarray,
    src: np.ndarray,
    idx: np.ndarray,
    factors: np.ndarray,
    out_col: int,
    src_col: int,
    width: int,
    scatter: bool,
) -> None:
    """Bag ``b`` is ``idx[offsets[b]:offsets[b+1]]``: ``out[b, cols] += factor * src[idx,
    cols]`` (``scatter``: ``out[idx, cols] += factor * src[b, cols]``), by the compiled loop
    for float rows (``src`` as ``out``'s dtype, contiguous); ``factors`` empty: all 1."""
    kernels = KERNELS if out.dtype in FLOAT_DTYPES and out.flags.c_contiguous else reference
    kernels.pool_bags(
        out,
        offsets,
        np.ascontiguousarray(src, out.dtype),
        idx,
        np.ascontiguousarray(factors, out.dtype),
        out_col,
        src_col,
        width,
        scatter,
    )


class Bags:
    """One feature's bags, ready to pool: ``unique`` are the ids to look up (ascending: a
    sharded table's parts are runs of them, and their gradients go as sorted, unique rows);
    ``n`` bags come out, bag ``b`` the ids ``offsets[b]:offsets[b+1]``, each id's row
    ``inverse[i]`` of ``unique`` and its factor ``scale[i]``. ``dtype``: the rows' (the
    factors are computed in it)."""

    __slots__ = ("unique", "inverse", "offsets", "factors", "n", "combiner")

    def __init__(
        self, jagged: JaggedTensor, combiner: str = "sum", dtype: Any = np.float32, n: int | None = None
    ) -> None:
        self.combiner = check_combiner(combiner)
        self.n = len(jagged) if n is None else n
        self.unique, self.inverse = distinct(jagged.values, sorted=True)
        self.inverse = np.ascontiguousarray(self.inverse, np.int64)
        self.offsets, self.factors = _bags_of(jagged, self.n, self.combiner, np.dtype(dtype))

    @property
    def segments(self) -> np.ndarray:
        """Each id's bag (``tf.RaggedTensor.value_rowids``)."""
        return np.repeat(np.arange(self.n, dtype=np.int64), np.diff(self.offsets))

    @property
    def scale(self) -> np.ndarray:
        """Each id's factor in its bag's combination."""
        return (
            self.factors
            if self.factors.size or not self.inverse.size
            else np.ones(self.inverse.size, self.factors.dtype)
        )

    @classmethod
    def sharing(
        cls, jaggeds: list[JaggedTensor], combiner: str, dtype: Any, n: int
    ) -> tuple[np.ndarray, list[Bags]]:
        """The distinct ids of several features of one table (ascending), and each
        feature's bags, pointing into them."""
        if len(jaggeds) == 1:
            b = cls(jaggeds[0], combiner, dtype, n=n)
            return b.unique, [b]
        unique, inverse = distinct(np.concatenate([j.values for j in jaggeds]), sorted=True)
        out = []
        start = 0
        for j in jaggeds:
            b = cls.__new__(cls)
            b.combiner, b.n, b.unique = check_combiner(combiner), n, unique
            b.inverse = np.ascontiguousarray(inverse[start : start + j.values.size], np.int64)
            b.offsets, b.factors = _bags_of(j, n, b.combiner, np.dtype(dtype))
            start += j.values.size
            out.append(b)
        return unique, out

    def pool(self, rows: np.ndarray, out: np.ndarray | None = None, column: int = 0) -> np.ndarray:
        """``[n, dim]``: each bag's combined row, from the rows of ``unique`` (in order);
        with ``out``, added into its columns from ``column`` on (and ``out`` returned)."""
        rows = np.asarray(rows)
        if rows.ndim != 2 or rows.shape[0] != self.unique.size:
            raise InvalidArgumentError(f"pool: expected {self.unique.size} rows, got shape {rows.shape}")
        if out is None:
            dtype = rows.dtype if rows.dtype in FLOAT_DTYPES else np.float32
            out = np.zeros((self.n, rows.shape[1]), dtype)
        _pool(out, self.offsets, rows, self.inverse, self.factors, column, 0, rows.shape[1], False)
        return out

    def gradient(self, d_pooled: np.ndarray) -> IndexedSlices:
        """:meth:`backward` of a gradient of the pooled rows of any leading shape (a safe
        lookup's keeps its SparseTensor's batch shape)."""
        return self.backward(d_pooled.reshape(self.n, d_pooled.shape[-1]))  # (no bags: -1 unknowable)

    def backward(
        self, d_pooled: np.ndarray, out: np.ndarray | None = None, column: int = 0, dim: int | None = None
    ) -> IndexedSlices:
        """The gradient of the rows of ``unique`` (summed over their bags) from the gradient
        of the pooled output (its columns from ``column`` on, ``dim`` of them: all by
        default), as sparse rows of the table; with ``out``, added into it."""
        d = np.asarray(d_pooled)
        dim = d.shape[1] - column if dim is None else dim
        if d.ndim != 2 or d.shape[0] != self.n or column + dim > d.shape[1]:
            raise InvalidArgumentError(f"backward: expected a gradient of {self.n} rows, got {d.shape}")
        if out is None:
            dtype = d.dtype if d.dtype in FLOAT_DTYPES else np.float32
            out = np.zeros((self.unique.size, dim), dtype)
        _pool(out, self.offsets, d, self.inverse, self.factors, 0, column, dim, True)
        return IndexedSlices(out, self.unique)


def _bags_of(jagged: JaggedTensor, n: int, combiner: str, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The offsets of ``n`` bags (``jagged``'s, cut or padded with empty ones) and the ids'
    factors (empty when all are 1: sums of unweighted bags skip the products)."""
    o = jagged.offsets
    offsets = o[: n + 1] if n < o.size else np.r_[o, np.full(n + 1 - o.size, o[-1])]
    return offsets, _factors(jagged, combiner, dtype)


def _factors(jagged: JaggedTensor, combiner: str, dtype: np.dtype) -> np.ndarray:
    """Each id's factor in its bag's combination (TF's: weight, weight / total, weight /
    sqrt(sum of squares); a total of 0 gives 0, as ``div_no_nan``); empty for a sum of
    unweighted bags (every factor 1)."""
    if combiner == "sum" and jagged.weights is None:
        return np.zeros(0, dtype)
    w = np.ones(jagged.values.size, dtype) if jagged.weights is None else jagged.weights.astype(dtype)
    if combiner == "sum":
        return w
    n = len(jagged)
    segments = jagged.segment_ids()
    if combiner == "mean":
        total = np.bincount(segments, weights=w, minlength=n).astype(dtype)
    else:
        total = np.sqrt(np.bincount(segments, weights=w * w, minlength=n)).astype(dtype)
    per_id = total[segments]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(per_id != 0, w / np.where(per_id != 0, per_id, 1), 0).astype(dtype)


async def _rows(params: Any, ids: np.ndarray, training: bool) -> np.ndarray:
    return np.asarray(await embedding_lookup(params, ids, training=training))


def _check_weights(jagged: JaggedTensor, what: str) -> None:
    if jagged.weights is not None and jagged.weights.dtype.kind != "f":
        raise InvalidArgumentError(f"{what}: weights must be floats, got {jagged.weights.dtype}")


async def embedding_lookup_sparse(
    params: Any,
    sp_ids: Any,
    sp_weights: Any = None,
    combiner: str | None = None,
    max_norm: float | None = None,
    name: str | None = None,
    allow_fast_lookup: bool = False,
    *,
    training: bool = True,
    with_gradient: bool = False,
) -> Any:
    """TF's ``tf.nn.embedding_lookup_sparse`` (``name`` and ``allow_fast_lookup`` are TF's,
    accepted and unused): each row of ``sp_ids`` (a SparseTensor, a
    RaggedTensor, a :class:`~pstrain.JaggedTensor` ...) is a bag of ids into ``params`` (a
    variable, a sharded one or a dynamic table), combined with ``sp_weights`` (the same
    kind, or None: all 1) by ``combiner``. As TF, the result has a row per bag up to the
    last that is not empty (empty bags before it give zeros); ids must be in range.
    ``max_norm``: rows whose L2 norm is larger are scaled down to it before combining.
    ``with_gradient=True``: ``(pooled, gradient)``, ``gradient(upstream)`` the table's
    gradient as sparse rows (what TF's ``tape.gradient`` gives: ``optimizer.apply_gradients`` takes it).

    >>> import asyncio
    >>> from pstrain import Variable, SparseTensor
    >>> params = Variable([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
    >>> sp = SparseTensor([[0, 0], [0, 1], [1, 0], [2, 0]], [0, 1, 3, 2], dense_shape=(3, 2))
    >>> asyncio.run(embedding_lookup_sparse(params, sp, None, combiner="sum")).tolist()
    [[4.0, 6.0], [7.0, 8.0], [5.0, 6.0]]
    """
    combiner = check_combiner(combiner)
    jagged = as_jagged(sp_ids, sp_weights, "sp_ids")
    _check_weights(jagged, "sp_weights")
    lengths = jagged.lengths
    nonempty = np.flatnonzero(lengths)
    n = int(nonempty[-1]) + 1 if nonempty.size else 0
    bags = Bags(jagged, combiner, _dtype_of(params), n=n)
    check_gradient_params(params, with_gradient)
    rows = await _rows(params, bags.unique, training)
    pooled = bags.pool(_clipped(rows, max_norm))
    return (pooled, LookupGradient(pooled.shape, rows, max_norm, bags.gradient)) if with_gradient else pooled


async def safe_embedding_lookup_sparse(
    embedding_weights: Any,
    sparse_ids: Any,
    sparse_weights: Any = None,
    combiner: str = "mean",
    default_id: int | None = None,
    max_norm: float | None = None,
    name: str | None = None,
    allow_fast_lookup: bool = False,
    *,
    training: bool = True,
    with_gradient: bool = False,
) -> Any:
    """TF's ``tf.nn.safe_embedding_lookup_sparse`` (``name``, ``allow_fast_lookup`` and
    ``with_gradient`` as in :func:`embedding_lookup_sparse`): as
    :func:`embedding_lookup_sparse`, but
    ids below 0 are dropped (and, unless ``combiner`` is ``"sum"``, ids whose weight is 0
    or less), a bag left empty gives ``default_id``'s row (None: zeros), and the result
    has a row per example: ``dense_shape[:-1] + (dim,)`` for a SparseTensor of any rank.
    On a :class:`~pstrain.DynamicEmbedding` every id is a valid key, negative ones too
    (its ids are raw 64-bit keys, hashes among them): none is dropped for its sign, as
    TensorFlow Recommenders-Addons' dynamic version keeps them.

    >>> import asyncio
    >>> from pstrain import Variable, SparseTensor
    >>> params = Variable([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    >>> sp = SparseTensor([[0, 0], [0, 1], [2, 0]], [0, -1, 2], dense_shape=(3, 2))
    >>> asyncio.run(safe_embedding_lookup_sparse(params, sp)).tolist()
    [[1.0, 2.0], [0.0, 0.0], [5.0, 6.0]]
    """
    combiner = check_combiner(combiner)
    batch_shape: tuple[int, ...] | None = None
    if all(hasattr(sparse_ids, a) for a in ("indices", "values", "dense_shape")):
        shape = tuple(int(d) for d in as_numpy(sparse_ids.dense_shape).reshape(-1))
        if len(shape) < 2:
            raise InvalidArgumentError(f"sparse_ids must be at least 2-D, got dense_shape {list(shape)}")
        if len(shape) > 2:  # TF: the leading dimensions are the batch, flattened then restored
            batch_shape = shape[:-1]
            sparse_ids = _flattened(sparse_ids, shape)
            if sparse_weights is not None:
                sparse_weights = _flattened(sparse_weights, shape)
    jagged = as_jagged(sparse_ids, sparse_weights, "sparse_ids")
    _check_weights(jagged, "sparse_weights")
    jagged = _pruned(
        jagged, prune_ids=not isinstance(embedding_weights, DynamicEmbedding), prune_weights=combiner != "sum"
    )
    empty = jagged.lengths == 0
    if default_id is not None and bool(empty.any()):
        jagged = _filled(jagged, empty, int(default_id))
    bags = Bags(jagged, combiner, _dtype_of(embedding_weights))
    check_gradient_params(embedding_weights, with_gradient)
    rows = await _rows(embedding_weights, bags.unique, training)
    out = bags.pool(_clipped(rows, max_norm))
    if batch_shape is not None:
        out = out.reshape(batch_shape + out.shape[1:])
    return (out, LookupGradient(out.shape, rows, max_norm, bags.gradient)) if with_gradient else out


def _dtype_of(params: Any) -> np.dtype:
    if isinstance(params, (list, tuple)) and params:
        params = params[0]
    dtype = getattr(params, "dtype", np.float32)
    return np.dtype(dtype) if np.dtype(dtype) in FLOAT_DTYPES else np.dtype(np.float32)


def _clipped(rows: np.ndarray, max_norm: float | None) -> np.ndarray:
    return rows if max_norm is None else clip_by_norm(rows, max_norm)


def _flattened(sp: Any, shape: tuple[int, ...]) -> SparseTensor:
    indices = as_numpy(sp.indices).astype(np.int64).reshape(-1, len(shape))
    rows = (
        np.ravel_multi_index(tuple(indices[:, :-1].T), shape[:-1]) if indices.size else np.zeros(0, np.int64)
    )
    flat = np.stack([rows, indices[:, -1]], axis=1) if indices.size else np.zeros((0, 2), np.int64)
    order = np.argsort(rows, kind="stable")
    return SparseTensor(
        flat[order], as_numpy(sp.values).reshape(-1)[order], [int(np.prod(shape[:-1])), shape[-1]]
    )


def _pruned(jagged: JaggedTensor, prune_ids: bool, prune_weights: bool) -> JaggedTensor:
    """Without ids below 0 when ``prune_ids`` (and weights of 0 or less when
    ``prune_weights``), as TF's ``_prune_invalid_ids`` and ``_prune_invalid_weights``."""
    signed = prune_ids and jagged.values.dtype.kind == "i"
    keep = jagged.values >= 0 if signed else np.ones(jagged.values.size, bool)
    if prune_weights and jagged.weights is not None:
        keep &= jagged.weights > 0
    if keep.all():
        return jagged
    lengths = np.bincount(jagged.segment_ids()[keep], minlength=len(jagged))
    w = None if jagged.weights is None else jagged.weights[keep]
    return JaggedTensor(jagged.values[keep], lengths, weights=w)


def _filled(jagged: JaggedTensor, empty: np.ndarray, default_id: int) -> JaggedTensor:
    """Every empty bag holding ``default_id`` (weight 1), as TF's ``sparse_fill_empty_rows``."""
    lengths = jagged.lengths + empty
    n_values = int(lengths.sum())
    offsets = np.zeros(lengths.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    filled_at = offsets[:-1][empty]
    kept = np.ones(n_values, bool)
    kept[filled_at] = False
    values = np.empty(n_values, jagged.values.dtype)
    values[kept] = jagged.values
    values[filled_at] = default_id
    weights = None
    if jagged.weights is not None:
        weights = np.empty(n_values, jagged.weights.dtype)
        weights[kept] = jagged.weights
        weights[filled_at] = 1
    return JaggedTensor(values, lengths, weights=weights)
