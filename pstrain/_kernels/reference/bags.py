"""Bags in numpy: pooling rows into bags and back, and taking batches of bags and rows."""

from __future__ import annotations

import numpy as np

__all__ = [
    "bag_positions",
    "interleave_bags",
    "pool_bags",
    "shuffle_through",
    "take_bags",
    "take_fixed",
    "take_keyed_bags",
]


def bag_positions(offsets: np.ndarray, rows: np.ndarray, out_offsets: np.ndarray) -> np.ndarray:
    if out_offsets.size != rows.size + 1:
        raise ValueError("bag_positions: out_offsets is not one longer than rows")
    if rows.size and (rows.min() < 0 or rows.max() >= offsets.size - 1):
        raise IndexError("bag_positions: a bag outside the batch")
    starts, lengths = offsets[rows], offsets[rows + 1] - offsets[rows]
    out_offsets[0] = 0
    np.cumsum(lengths, out=out_offsets[1:])
    return np.arange(int(out_offsets[-1]), dtype=np.int64) - np.repeat(out_offsets[:-1] - starts, lengths)


def take_bags(
    values: np.ndarray, itemsize: int, offsets: np.ndarray, rows: np.ndarray, out_offsets: np.ndarray
) -> np.ndarray:
    if out_offsets.size != rows.size + 1:
        raise ValueError("take_bags: out_offsets is not one longer than rows")
    if itemsize <= 0 or values.size % itemsize:
        raise ValueError("take_bags: values are not a whole number of items")
    if rows.size and (rows.min() < 0 or rows.max() >= offsets.size - 1):
        raise IndexError("take_bags: a bag outside the batch")
    starts, ends = offsets[rows], offsets[rows + 1]
    if rows.size and (starts.min() < 0 or np.any(ends < starts) or ends.max() * itemsize > values.size):
        raise IndexError("take_bags: a bag's offsets outside its values")
    pos = bag_positions(offsets, rows, out_offsets)
    return values.reshape(-1, itemsize)[pos].reshape(-1)


def take_keyed_bags(
    values: np.ndarray,
    itemsize: int,
    offsets: np.ndarray,
    lengths: np.ndarray,
    rows: np.ndarray,
    out_offsets: np.ndarray,
    out_starts: np.ndarray,
) -> np.ndarray:
    features = lengths.shape[1]
    if out_offsets.shape != (features, rows.size + 1) or out_starts.shape != (features,):
        raise ValueError(
            "take_keyed_bags: out_offsets is not (features, rows + 1), or out_starts not one a feature"
        )
    if itemsize <= 0 or values.size % itemsize or lengths.shape[0] != offsets.size - 1:
        raise ValueError(
            "take_keyed_bags: values are not a whole number of items, or the lengths are not one "
            "row an example"
        )
    if rows.size and (rows.min() < 0 or rows.max() >= offsets.size - 1):
        raise IndexError("take_keyed_bags: an example outside the batch")
    got = lengths[rows].astype(np.int64)
    if rows.size and (
        got.min() < 0
        or offsets[rows].min() < 0
        or not np.array_equal(got.sum(1), offsets[rows + 1] - offsets[rows])
        or offsets[rows + 1].max() * itemsize > values.size
    ):
        raise IndexError("take_keyed_bags: an example's lengths do not match its offsets")
    out_offsets[:, 0] = 0
    np.cumsum(got.T, axis=1, out=out_offsets[:, 1:])
    out_starts[:] = np.cumsum(out_offsets[:, -1]) - out_offsets[:, -1]
    # each feature's bags start where the example's bags before it end
    within = offsets[rows][:, None] + np.cumsum(got, axis=1) - got  # (rows, features)
    items = values.reshape(-1, itemsize)
    parts = [np.zeros((0, itemsize), np.uint8)]
    for f in range(features):
        o = out_offsets[f]
        parts.append(items[np.repeat(within[:, f] - o[:-1], got[:, f]) + np.arange(o[-1])])
    return np.concatenate(parts).reshape(-1)


def interleave_bags(
    values: np.ndarray, itemsize: int, offsets: np.ndarray, out: np.ndarray, cursor: np.ndarray
) -> None:
    n = offsets.size - 1
    if cursor.size != n or itemsize <= 0 or values.size % itemsize or out.size % itemsize:
        raise ValueError(
            "interleave_bags: cursor is not one an example, or values or out are not a whole number of items"
        )
    sizes = np.diff(offsets)
    if n and (
        sizes.min() < 0
        or offsets.min() < 0
        or offsets.max() * itemsize > values.size
        or cursor.min() < 0
        or ((cursor + sizes) * itemsize).max() > out.size
    ):
        raise IndexError("interleave_bags: a bag outside its values or out")
    dst = np.repeat(cursor - offsets[:-1], sizes) + np.arange(offsets[0], offsets[-1])
    out.reshape(-1, itemsize)[dst] = values.reshape(-1, itemsize)[offsets[0] : offsets[-1]]
    cursor += sizes


def shuffle_through(buf: np.ndarray, incoming: np.ndarray, draws: np.ndarray, out: np.ndarray) -> None:
    if draws.shape[0] != incoming.shape[0] or out.shape[0] != incoming.shape[0]:
        raise ValueError("shuffle_through: incoming, draws and out differ in length")
    if incoming.size and buf.size == 0:
        raise ValueError("shuffle_through: an empty buffer")
    if incoming.size and not bool(np.all((draws >= 0.0) & (draws < 1.0))):
        raise ValueError("shuffle_through: a draw outside [0, 1)")
    size = buf.shape[0]
    for i, (x, d) in enumerate(zip(incoming.tolist(), draws.tolist())):
        k = int(d * size)
        out[i] = buf[k]
        buf[k] = x


def take_fixed(src: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    if out.shape != (rows.size, src.shape[1]):
        raise ValueError("take_fixed: out is not (len(rows), the rows' bytes)")
    if rows.size and (rows.min() < 0 or rows.max() >= src.shape[0]):
        raise IndexError("take_fixed: a row outside the array")
    np.take(src, rows, axis=0, out=out)


def pool_bags(
    out: np.ndarray,
    offsets: np.ndarray,
    src: np.ndarray,
    idx: np.ndarray,
    scale: np.ndarray,
    out_col: int = 0,
    src_col: int = 0,
    width: int = -1,
    scatter: bool = False,
) -> None:
    n = idx.size
    width = out.shape[1] if width < 0 else width
    if (
        (scale.size and scale.size != n)
        or offsets.size < 1
        or min(out_col, src_col) < 0
        or out_col + width > out.shape[1]
        or src_col + width > src.shape[1]
    ):
        raise ValueError("pool_bags: no offsets, scale not one per id, or the columns are outside out or src")
    bags, rows = (src.shape[0], out.shape[0]) if scatter else (out.shape[0], src.shape[0])
    used = int(offsets[-1])
    if (
        offsets.size - 1 > bags
        or offsets[0] != 0
        or used > n
        or (np.diff(offsets) < 0).any()
        or (used and (idx[:used].min() < 0 or idx[:used].max() >= rows))
    ):
        raise IndexError("pool_bags: a bag or a row outside out or src")
    seg = np.repeat(np.arange(offsets.size - 1), np.diff(offsets))
    ids = idx[:used]
    if scatter:
        seg, ids = ids, seg
    part = src[ids, src_col : src_col + width]
    np.add.at(out[:, out_col : out_col + width], seg, part if not scale.size else scale[:used, None] * part)
