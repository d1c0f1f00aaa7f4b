"""A batch's distinct ids and the per-id sums of its rows, on the kernels chosen
(:data:`~pstrain._kernels.KERNELS`): what a client merging a sparse gradient's duplicate
rows, a ps merging a request's, and :mod:`pstrain.math` all do. No checks of the caller's
input here beyond the kernels' own: the callers check it, each with its own errors.

>>> import numpy as np
>>> distinct(np.array([7, 3, 7, 9]), sorted=True)
(array([3, 7, 9]), array([1, 0, 1, 2]))
>>> merge_duplicates(np.array([7, 3, 7]), np.array([[1.0], [2.0], [4.0]]))
(array([3, 7]), array([[2.],
       [5.]]))
"""

from __future__ import annotations

import importlib
import math

import numpy as np

from . import FLOAT_DTYPES, KERNELS, reference


def _vectorized_sort() -> bool:
    """Whether numpy sorts 64-bit integers with its AVX-512 kernels on this CPU: there, 13,312
    of them take 46 µs; without them (AVX2 and older) 420 µs, more than a hash pass for the
    distinct ids and a radix sort of those take together (about 215)."""
    try:  # (numpy's own table of the CPU's features; where it keeps it may move)
        features = importlib.import_module("numpy._core._multiarray_umath").__cpu_features__
    except (ImportError, AttributeError):  # (then the other way: never wrong, only slower)
        return False
    return bool(features.get("AVX512_SKX"))


#: How a sorted ``distinct`` of ids past the bitmap's span finds them: a packed sort by
#: numpy (:func:`~pstrain._kernels.compiled.unique_sorted`) where numpy's sort of 64-bit
#: integers is vectorized (0.4x the other way's time on W6's batches), else the distinct
#: ids by a hash pass, then their radix sort (:func:`~pstrain._kernels.compiled.argsort_stable`).
PACKED_SORT = _vectorized_sort()

#: A sorted ``distinct`` of ids spanning fewer than this many values per id marks them in
#: a bitmap of the span (:func:`~pstrain._kernels.compiled.unique_in_span`), not a sort.
#: Against the packed sort, measured on 2,048 and 8,192 ids (W8's batch sizes) spread
#: evenly over their span, the bitmap took 0.55x its time at 4 values an id and 0.88x at
#: 64; at 128 as long for 2,048 ids and 1.8x as long for 8,192, whose bits no longer stay
#: in the nearest cache. Against the hash pass and radix sort, on W8's 26 features (2,048
#: or about 8,200 ids a batch), the bitmap took half the time up to 35 values an id, broke
#: even about 120 and took 1.5x as long at 490.
SPAN_PER_ID = 64 if PACKED_SORT else 128

__all__ = [
    "ascending_rows",
    "distinct",
    "merge_duplicates",
    "sum_into",
    "interleave_bags",
    "take_bags",
    "take_examples",
    "take_keyed_bags",
    "take_rows",
]


def distinct(ids: np.ndarray, *, sorted: bool = False) -> tuple[np.ndarray, np.ndarray]:  # noqa: A002
    """``(distinct ids, each id's position among them)`` of 1-D ``ids``, in the order they
    first occur, or ascending (``sorted``: ``np.unique``'s result with ``return_inverse``,
    bit for bit). Integers of at most 64 bits take the C hash kernel, or sorted, the C bitmap
    within a span of ``SPAN_PER_ID`` values an id and past it the sort ``PACKED_SORT``
    chooses; other elements numpy's sort."""
    if ids.size < 2:
        return ids.copy(), np.arange(ids.size)
    if ids.dtype.kind not in "iu" or ids.dtype.itemsize > 8:
        if bool(np.all(ids[1:] > ids[:-1])):
            return ids.copy(), np.arange(ids.size)  # already distinct and ascending
        if not sorted:
            return reference.unique_first(ids)
        found, inverse = np.unique(ids, return_inverse=True)
        return found, inverse.reshape(-1).astype(np.int64, copy=False)
    unsigned = ids.dtype.kind == "u" and ids.dtype.itemsize == 8  # (either byte order)
    if unsigned:  # (as int64 for the kernels, which read them as uint64)
        wide = np.ascontiguousarray(ids, np.uint64).view(np.int64)
    else:
        wide = np.ascontiguousarray(ids, np.int64)
    low, high, ascending = KERNELS.id_span(wide, unsigned)
    if ascending:  # already distinct and ascending (both orders)
        return ids.copy(), np.arange(ids.size)
    if sorted:
        if high - low < SPAN_PER_ID * ids.size and high < 2**63:  # (uint64 above: order differs)
            found_wide, inverse = KERNELS.unique_in_span(wide, low, high - low + 1)
            return found_wide.astype(ids.dtype, copy=False), inverse
        if PACKED_SORT:
            found_wide, idx = KERNELS.unique_sorted(wide, unsigned, (low, high))
        else:
            found_wide, first = KERNELS.unique_first(wide)
            order = KERNELS.argsort_stable(found_wide, unsigned)  # (distinct: any sort does)
            rank = np.empty(order.size, np.int64)
            rank[order] = np.arange(order.size)
            found_wide, idx = found_wide[order], rank[first]
    else:
        found_wide, idx = KERNELS.unique_first(wide)
    found = (found_wide.view(np.uint64) if unsigned else found_wide).astype(ids.dtype, copy=False)
    return found, idx


def sum_into(out: np.ndarray, segments: np.ndarray, values: np.ndarray) -> None:
    """``out[segments[i]] += values[i]`` in order, skipping negative segments (rows of any
    shape; C loops for float32 and float64, numpy's ``np.add.at`` otherwise)."""
    width = math.prod(out.shape[1:])
    kernels = KERNELS if out.dtype in FLOAT_DTYPES else reference
    kernels.put_rows(
        out.reshape(out.shape[0], width),
        np.ascontiguousarray(segments, np.int64),
        np.ascontiguousarray(values, out.dtype).reshape(segments.size, width),
        True,
    )


def merge_duplicates(
    ids: np.ndarray,
    values: np.ndarray,
    *,
    sorted: bool = True,  # noqa: A002
) -> tuple[np.ndarray, np.ndarray]:
    """``(distinct ids ascending, the sum of each one's rows of values, in order)``: a sparse
    gradient's rows with repeated ids merged, as ``np.unique`` then ``np.add.at`` give them.
    ``sorted=False``: the distinct ids in the order they first occur (no sort)."""
    unique, inverse = distinct(ids, sorted=sorted)
    if unique.size == ids.size:  # only reordered, or not even that
        if not sorted:
            return unique, values
        summed = np.empty_like(values)
        summed[inverse] = values
        return unique, summed
    summed = np.zeros((unique.size,) + values.shape[1:], values.dtype)
    sum_into(summed, inverse, values)
    return unique, summed


def ascending_rows(rows: np.ndarray, n: int) -> tuple[np.ndarray, int, bool]:
    """1-D integer ``rows`` as int64 (themselves if they are), the position of the first
    outside ``[0, n)`` (-1: none) and whether they ascend strictly, in one pass."""
    if rows.dtype not in (np.int32, np.int64) or not rows.flags.c_contiguous:
        rows = np.ascontiguousarray(rows, np.int64)  # (an id past int64 becomes negative: outside)
    if rows.dtype == np.int64:
        bad, up = KERNELS.ascending_rows(rows, n)
        return rows, bad, up
    out = np.empty(rows.size, np.int64)
    bad, up = KERNELS.ascending_rows(rows, n, out)
    return out, bad, up


def take_rows(array: np.ndarray, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``array[rows]`` (rows in range, checked by the caller), into ``out`` if given: float
    rows by the compiled gather (C, without the GIL, the next rows' memory asked for ahead),
    other dtypes by ``np.take``."""
    if out is None:
        out = np.empty((*np.shape(rows), *array.shape[1:]), array.dtype)
    if array.dtype in FLOAT_DTYPES and array.ndim >= 1 and array.flags.c_contiguous:
        width = math.prod(array.shape[1:])
        flat = np.ascontiguousarray(rows, np.int64).reshape(-1)
        KERNELS.gather_rows(array.reshape(array.shape[0], width), flat, out.reshape(flat.size, width), 0.0)
    else:
        np.take(array, rows, axis=0, out=out)
    return out


def take_examples(array: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``array[rows]`` along the first axis (``rows``: int64, contiguous, each in range, as
    the caller checked), for any dtype: a dataset's batch of one of its arrays, each example
    one copy, the next examples' memory asked for ahead (rows of a number or none: numpy's
    own indexing). What numpy's fancy indexing gives."""
    width = array.itemsize * math.prod(array.shape[1:])
    if width <= 8 or not array.flags.c_contiguous or array.dtype.hasobject:
        return array[rows]  # (numbers one by one: numpy's own loop is as fast)
    out = np.empty((rows.size, *array.shape[1:]), array.dtype)
    KERNELS.take_fixed(
        array.reshape(-1).view(np.uint8).reshape(array.shape[0], width),
        rows,
        out.reshape(-1).view(np.uint8).reshape(rows.size, width),
    )
    return out


def take_bags(
    values: np.ndarray, offsets: np.ndarray, rows: np.ndarray, out_offsets: np.ndarray
) -> np.ndarray:
    """The values of bags ``rows`` of a jagged batch, end to end (``offsets``: where each bag
    starts, then the end; their offsets go into ``out_offsets``), each bag one copy."""
    if not values.flags.c_contiguous or values.dtype.hasobject or values.ndim != 1:
        return values[KERNELS.bag_positions(offsets, rows, out_offsets)]
    got = KERNELS.take_bags(values.view(np.uint8), values.itemsize, offsets, rows, out_offsets)
    return got.view(values.dtype)


def take_keyed_bags(
    values: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, rows: np.ndarray, out_offsets: np.ndarray
) -> list[np.ndarray]:
    """Examples ``rows`` of features kept example by example (``values`` 1-D and contiguous,
    example ``r``'s bags from ``offsets[r]``, ``lengths[r, f]`` ids of feature ``f``), feature
    by feature: each feature's ids (views of one array), its bag offsets (from 0) into its
    row of ``out_offsets``."""
    starts = np.empty(lengths.shape[1], np.int64)
    got = KERNELS.take_keyed_bags(
        values.view(np.uint8), values.itemsize, offsets, lengths, rows, out_offsets, starts
    ).view(values.dtype)
    return [got[s : s + n] for s, n in zip(starts.tolist(), out_offsets[:, -1].tolist())]


def interleave_bags(values: np.ndarray, offsets: np.ndarray, out: np.ndarray, cursor: np.ndarray) -> None:
    """One feature's bags (``values`` 1-D and contiguous, bag ``b`` from ``offsets[b]``) into
    ``out``, of the same dtype, bag ``b`` at ``cursor[b]``, which moves past it."""
    KERNELS.interleave_bags(values.view(np.uint8), values.itemsize, offsets, out.view(np.uint8), cursor)
