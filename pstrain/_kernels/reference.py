"""The table kernels in numpy: the reference the compiled ones are tested against, bit for bit.

Same signatures and results as :mod:`pstrain._kernels.compiled` (only where an index puts an
id may differ: both probe linearly from the id's hash, but the vectorised insert settles
contended slots in another order). Each operation takes a whole batch and probes it with one
numpy pass per probe step over the ids still looking, then a short Python loop for the few
long probes left, so it is a fair numpy implementation, not a strawman.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

__all__ = [
    "absent",
    "adagrad_rows",
    "aligned_allocations",
    "argsort_stable",
    "bag_positions",
    "compact_delete",
    "compact_get",
    "compact_insert",
    "count_sightings",
    "crc32c",
    "create_rows",
    "gather_rows",
    "index_delete",
    "index_get",
    "index_insert",
    "index_locate",
    "index_refind",
    "initial_rows",
    "io_uring_reads",
    "keep_changed",
    "mix64",
    "parse_examples",
    "pick_victims",
    "pool_bags",
    "pread_records",
    "put_rows",
    "rows_after",
    "rowwise_adagrad_rows",
    "same_ids",
    "sgd_rows",
    "take_bags",
    "take_fixed",
    "tfrecord_split",
    "shard_ids",
    "siphash24",
    "stamp_rows",
    "unique_first",
    "unique_in_span",
]

_EMPTY = -1  # an index slot's value when it holds no id
_SCALAR = 48  # ids left probing below which a Python loop beats another numpy pass


def mix64(x: Any) -> np.ndarray:
    """splitmix64's finalizer on uint64 (wrapping), elementwise."""
    x = np.asarray(x, np.uint64).copy()
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def _high(a: np.ndarray, b: int) -> np.ndarray:
    """The high 64 bits of ``a * b`` (uint64 each, 128-bit product), elementwise."""
    low32 = np.uint64(0xFFFFFFFF)
    s32 = np.uint64(32)
    a_lo, a_hi = a & low32, a >> s32
    b_lo, b_hi = np.uint64(b & 0xFFFFFFFF), np.uint64(b >> 32)
    with np.errstate(over="ignore"):
        lo_lo, hi_lo, lo_hi = a_lo * b_lo, a_hi * b_lo, a_lo * b_hi
        cross = (lo_lo >> s32) + (hi_lo & low32) + lo_hi
        return (hi_lo >> s32) + (cross >> s32) + a_hi * b_hi


def home(ids: np.ndarray, size: int) -> np.ndarray:
    """Each id's first slot in an index of ``size`` slots (as the compiled kernels' own)."""
    return _high(mix64(np.asarray(ids, np.int64).view(np.uint64)), size)


def _step(pos: np.ndarray, size: int) -> np.ndarray:
    """The slots after ``pos``, round."""
    pos = pos + np.uint64(1)
    pos[pos == np.uint64(size)] = 0
    return pos


def _find(keys: np.ndarray, vals: np.ndarray, empty: Any, size: int, ids: np.ndarray) -> np.ndarray:
    """The slot holding each id, -1 where none does (``vals`` is ``empty`` where a slot
    holds none)."""
    found = np.full(ids.size, -1, np.int64)
    pos = home(ids, size)
    todo = np.arange(ids.size)
    while todo.size > _SCALAR:
        p = pos[todo]
        v = vals[p]
        hit = (v != empty) & (keys[p] == ids[todo])
        found[todo[hit]] = p[hit]
        going = ~hit & (v != empty)  # past other ids
        todo = todo[going]
        pos[todo] = _step(p[going], size)
    for i in todo.tolist():  # the long probes' tail: a few ids, cheaper one at a time
        key, q = int(ids[i]), int(pos[i])
        while True:
            v_q = vals[q]
            if v_q == empty:
                break
            if keys[q] == key:
                found[i] = q
                break
            q = q + 1 if q + 1 < size else 0
    return found


def index_get(slots: np.ndarray, size: int, ids: np.ndarray, out: np.ndarray) -> None:
    found = _find(slots[:, 0], slots[:, 1], _EMPTY, size, ids)
    hit = found >= 0
    out[:] = -1
    out[hit] = slots[found[hit], 1]


def index_refind(slots: np.ndarray, size: int, ids: np.ndarray, pos: np.ndarray) -> None:
    if pos.size != ids.size:
        raise ValueError(f"index_refind: {pos.size} rows for {ids.size} ids")
    where, which = absent(ids, pos)
    found = np.empty(which.size, np.int64)
    index_get(slots, size, which, found)
    pos[where] = found


def absent(ids: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if ids.size != pos.size:
        raise ValueError(f"absent: {pos.size} rows for {ids.size} ids")
    where = np.flatnonzero(pos < 0)
    return where, ids[where]


def same_ids(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.array_equal(a, b))


def index_locate(slots: np.ndarray, size: int, ids: np.ndarray, out: np.ndarray, mark: np.ndarray) -> bool:
    index_get(slots, size, ids, out[: ids.size])
    if not _rows_distinct(out[: ids.size], mark):
        return False
    missing = ids[out[: ids.size] < 0]
    return bool(np.unique(missing).size == missing.size)


def index_insert(slots: np.ndarray, size: int, ids: np.ndarray, rows: np.ndarray) -> None:
    if rows.size != ids.size:
        raise ValueError(f"index_insert: {ids.size} ids but {rows.size} rows")
    if rows.size and rows.min() < 0:
        raise ValueError(f"index_insert: row {int(rows.min())}: rows are at least 0")
    _insert(slots[:, 0], slots[:, 1], _EMPTY, size, ids, rows)


def _insert(
    keys: np.ndarray, vals: np.ndarray, empty: Any, size: int, ids: np.ndarray, rows: np.ndarray
) -> None:
    pos = home(ids, size)
    todo = np.arange(ids.size)
    while todo.size > _SCALAR:
        p = pos[todo]
        cand = np.flatnonzero(vals[p] == empty)
        # Of the ids that reach the same free slot now, one takes it: each writes its
        # position into the free slot's (unused) key, and the one that reads it back won.
        pc = p[cand]
        keys[pc] = cand
        won = np.zeros(todo.size, bool)
        won[cand[keys[pc] == cand]] = True
        w = p[won]
        keys[w] = ids[todo[won]]
        vals[w] = rows[todo[won]]
        todo = todo[~won]
        pos[todo] = _step(p[~won], size)
    for i in todo.tolist():  # the long probes' tail, one at a time
        q = int(pos[i])
        while vals[q] != empty:
            q = q + 1 if q + 1 < size else 0
        keys[q], vals[q] = ids[i], rows[i]


def index_delete(slots: np.ndarray, size: int, ids: np.ndarray, out: np.ndarray) -> int:
    """No tombstone, as in C, but vectorised: the found slots are emptied, then every id
    after a hole in its run (up to the next empty slot) is inserted again. Where ids land
    may differ from the C loop's; what each id maps to does not."""
    return _delete(slots[:, 0], slots[:, 1], _EMPTY, size, ids, out)


def _delete(
    keys: np.ndarray, vals: np.ndarray, empty: Any, size: int, ids: np.ndarray, out: np.ndarray
) -> int:
    found = _find(keys, vals, empty, size, ids)
    hit = found >= 0
    gone = found[hit]
    out[: ids.size] = -1
    out[: ids.size][hit] = vals[gone]
    if not gone.size:
        return 0
    start = int(np.flatnonzero(vals == empty)[0])  # a run never wraps past an empty slot
    vals[gone] = empty
    order = np.roll(np.arange(vals.size), -start)
    run = np.cumsum(vals[order] == empty)  # each empty slot starts a new run
    behind = np.zeros(run[-1] + 1, bool)
    behind[run[np.argsort(order)[gone]]] = True  # the runs that now start at a hole
    moved = order[behind[run] & (vals[order] != empty)]
    again_ids, again_rows = keys[moved].copy(), vals[moved].copy()
    vals[moved] = empty
    _insert(keys, vals, empty, size, again_ids, again_rows)
    return int(gone.size)


_EMPTY32 = np.uint32(0xFFFFFFFF)  # a compact index's value where a slot holds no id


def _check_compact(keys: np.ndarray, vals: np.ndarray, size: int) -> None:
    if keys.size != size or vals.size != size or not size:
        raise ValueError(f"a compact index's ids and values are {size} each, got {keys.size} and {vals.size}")


def compact_get(keys: np.ndarray, vals: np.ndarray, size: int, ids: np.ndarray, out: np.ndarray) -> None:
    _check_compact(keys, vals, size)
    found = _find(keys, vals, _EMPTY32, size, ids)
    hit = found >= 0
    out[: ids.size] = -1
    out[: ids.size][hit] = vals[found[hit]]


def compact_insert(keys: np.ndarray, vals: np.ndarray, size: int, ids: np.ndarray, rows: np.ndarray) -> None:
    _check_compact(keys, vals, size)
    if rows.size != ids.size:
        raise ValueError(f"compact_insert: {ids.size} ids but {rows.size} rows")
    if rows.size and (rows.min() < 0 or rows.max() >= int(_EMPTY32)):
        raise ValueError(f"compact_insert: rows are 0 to {int(_EMPTY32) - 1}")
    _insert(keys, vals, _EMPTY32, size, ids, rows)


def compact_delete(keys: np.ndarray, vals: np.ndarray, size: int, ids: np.ndarray, out: np.ndarray) -> int:
    _check_compact(keys, vals, size)
    return _delete(keys, vals, _EMPTY32, size, ids, out)


def count_sightings(
    slots: np.ndarray,
    size: int,
    counts: np.ndarray,
    owners: np.ndarray,
    ids: np.ndarray,
    where: np.ndarray,
    admitted: np.ndarray,
    threshold: int,
    next_slot: int,
    room: int,
) -> tuple[int, int, int, int]:
    if (
        where.size < ids.size
        or admitted.size < ids.size
        or next_slot < 0
        or room < 0
        or next_slot + min(room, ids.size) > counts.size
    ):
        raise ValueError(
            "count_sightings: where or admitted shorter than the ids, or no room in "
            f"counts (next slot {next_slot} + room {room} of {counts.size})"
        )
    found = np.empty(ids.size, np.int64)
    index_get(slots, size, ids, found)
    seen = found >= 0
    count = np.ones(ids.size, np.int64)
    count[seen] += counts[found[seen]]
    yes = count >= threshold
    new = ~yes & ~seen
    done = ids.size
    if np.count_nonzero(new) > room:  # stop before the id that would be one more
        done = int(np.flatnonzero(new)[room])
    yes, seen, new, found, count = yes[:done], seen[:done], new[:done], found[:done], count[:done]
    chosen = where[:done][yes]
    admitted[: chosen.size] = chosen
    gone = yes & seen
    index_delete(slots, size, ids[:done][gone], np.empty(int(np.count_nonzero(gone)), np.int64))
    counts[found[gone]] = 0
    again = ~yes & seen
    counts[found[again]] = count[again]
    fresh = ids[:done][new]
    at = np.arange(next_slot, next_slot + fresh.size, dtype=np.int64)
    index_insert(slots, size, fresh, at)
    counts[at] = 1
    owners[at] = fresh
    return done, int(fresh.size), int(np.count_nonzero(gone)), int(chosen.size)


def _checked(name: str, var: np.ndarray, rows: np.ndarray, what: str = "variable") -> np.ndarray:
    """Which of ``rows`` exist (not -1); raises if one is past ``var``'s end."""
    if rows.size and rows.max() >= var.shape[0]:
        raise IndexError(f"{name}: a row past the {what}'s end")
    return rows >= 0


def sgd_rows(var: np.ndarray, rows: np.ndarray, g: np.ndarray, lr: float) -> None:
    keep = _checked("sgd_rows", var, rows)
    r, gr = rows[keep], g[keep]
    var[r] -= var.dtype.type(lr) * gr


def adagrad_rows(
    var: np.ndarray, acc: np.ndarray, rows: np.ndarray, g: np.ndarray, lr: float, eps: float
) -> None:
    keep = _checked("adagrad_rows", var, rows)
    r, gr = rows[keep], g[keep]
    a = acc[r] + gr * gr
    acc[r] = a
    var[r] -= var.dtype.type(lr) * gr / np.sqrt(a + var.dtype.type(eps))


def rowwise_adagrad_rows(
    var: np.ndarray, acc: np.ndarray, rows: np.ndarray, g: np.ndarray, lr: float, eps: float
) -> None:
    if acc.shape[0] < var.shape[0] or acc.shape[1] not in (1, var.shape[1]):
        raise ValueError("rowwise_adagrad_rows: acc is not one column, or var's width, per row")
    keep = _checked("rowwise_adagrad_rows", var, rows)
    r, gr = rows[keep], g[keep]
    t = var.dtype.type
    mean_sq = np.zeros(r.size, var.dtype)
    for j in range(var.shape[1]):  # in column order, as the compiled loop adds them
        mean_sq += gr[:, j] * gr[:, j]
    mean_sq /= t(var.shape[1])
    a = acc[r, 0] + mean_sq
    acc[r] = a[:, None]
    var[r] -= (t(lr) / (np.sqrt(a) + t(eps)))[:, None] * gr


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


def gather_rows(
    table: np.ndarray,
    pos: np.ndarray,
    out: np.ndarray,
    default: float,
    last_seen: np.ndarray | None = None,
    freq: np.ndarray | None = None,
    clock: int = 0,
) -> None:
    if out.shape != (pos.size, table.shape[1]):
        raise ValueError("gather_rows: out is not (len(pos), dim)")
    if any(a is not None and a.size < table.shape[0] for a in (last_seen, freq)):
        raise ValueError("gather_rows: last_seen or freq shorter than the table")
    found = _checked("gather_rows", table, pos, "table")
    out[found] = table[pos[found]]
    out[~found] = default
    if last_seen is not None:
        last_seen[pos[found]] = clock
    if freq is not None:
        freq[pos[found]] += 1


def put_rows(out: np.ndarray, rows: np.ndarray, values: np.ndarray, add: bool = False) -> None:
    if values.shape != (rows.size, out.shape[1]):
        raise ValueError("put_rows: values are not (len(rows), dim)")
    keep = _checked("put_rows", out, rows, "array")
    if add:
        np.add.at(out, rows[keep], values[keep])
    else:
        out[rows[keep]] = values[keep]


def ascending_rows(rows: np.ndarray, n: int, out: np.ndarray | None = None) -> tuple[int, bool]:
    if out is not None and out.shape[0] != rows.shape[0]:
        raise ValueError("ascending_rows: out is not as long as rows")
    wide = rows.astype(np.int64)
    outside = np.flatnonzero((wide < 0) | (wide >= n))
    bad = int(outside[0]) if outside.size else -1
    seen = wide if bad < 0 else wide[:bad]
    if out is not None:
        out[: seen.size] = seen
    return bad, bool(np.all(seen[1:] > seen[:-1]))


def stamp_rows(epochs: np.ndarray, pos: np.ndarray, epoch: int) -> int:
    hit = pos[_checked("stamp_rows", epochs, pos, "table")]
    epochs[hit] = epoch
    return int(hit.size)


def _rows_distinct(pos: np.ndarray, mark: np.ndarray) -> bool:
    found = pos[_checked("index_locate", mark, pos, "table")]
    return bool(np.unique(found).size == found.size)


def pick_victims(
    key: np.ndarray,
    live: np.ndarray,
    protect: np.ndarray,
    mark: np.ndarray,
    used: int,
    n: int,
    low: int = 0,
    high: int = -1,
) -> np.ndarray:
    # ``low`` and ``high`` only spare the compiled kernel a pass: the answer is the same
    limit = min(used, key.size, live.size, mark.size)
    if protect.size and (protect.min() < 0 or protect.max() >= limit):
        raise IndexError("pick_victims: a protected row past the table's end")
    eligible = live[:limit].astype(bool)
    eligible[protect] = False
    rows = np.flatnonzero(eligible)
    n = max(0, min(n, rows.size))
    if n == rows.size:
        return rows
    k = key[rows]
    if n == 0:
        return rows[:0]
    threshold = np.partition(k, n - 1)[n - 1]
    take = k < threshold
    take[np.flatnonzero(k == threshold)[: n - int(np.count_nonzero(take))]] = True
    return rows[take]


def rows_after(
    epochs: np.ndarray, since: int, live: np.ndarray | None = None, until: int | None = None
) -> np.ndarray:
    if live is not None and live.size < epochs.size:
        raise ValueError(f"rows_after: {live.size} live flags for {epochs.size} rows")
    after = epochs.astype(np.int64) > since
    if until is not None:
        after &= epochs.astype(np.int64) <= until
    if live is not None:
        after &= live[: epochs.size].astype(bool)
    return np.flatnonzero(after)


def keep_changed(
    rows: np.ndarray,
    epochs: np.ndarray,
    since: int,
    mark: int,
    taken: int,
    array: np.ndarray,
    kept_rows: np.ndarray,
    kept_values: np.ndarray,
    start: int,
) -> int:
    n = rows.size
    if array.shape[0] > epochs.shape[0]:
        raise ValueError(f"keep_changed: {epochs.shape[0]} epochs for {array.shape[0]} rows")
    if kept_values.shape[1:] != array.shape[1:]:
        raise ValueError("keep_changed: kept_values is not (capacity, dim)")
    if start < 0 or kept_rows.shape[0] - start < n or kept_values.shape[0] - start < n:
        raise ValueError(f"keep_changed: no room for {n} rows from {start}")
    if n > 1 and not bool(np.all(rows[1:] > rows[:-1])):
        return -1
    r = rows[(rows >= max(taken, 0)) & (rows < array.shape[0])]
    e = epochs[r].astype(np.int64)
    r = r[(e > since) & (e <= mark)]
    kept_rows[start : start + r.size] = r
    kept_values[start : start + r.size] = array[r]
    return int(r.size)


def unique_first(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sorted_ids, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    order = np.argsort(first)  # the distinct ids by where they first occur
    rank = np.empty(order.size, np.int64)
    rank[order] = np.arange(order.size)
    return sorted_ids[order], rank[inverse.reshape(-1)]


def unique_in_span(ids: np.ndarray, low: int, span: int) -> tuple[np.ndarray, np.ndarray]:
    if span < 1 or span > 1 << 40:
        raise ValueError("unique_in_span: span must be 1 to 2**40")
    if ids.size and (int(ids.min()) < low or int(ids.max()) - low >= span):  # (Python ints: no wrap)
        raise IndexError("unique_in_span: an id outside the span")
    unique, inverse = np.unique(ids, return_inverse=True)
    return unique.astype(np.int64), inverse.reshape(-1).astype(np.int64)


def argsort_stable(values: np.ndarray, unsigned: bool = False) -> np.ndarray:
    return np.argsort(values.view(np.uint64) if unsigned else values, kind="stable").astype(np.int64)


def shard_ids(ids: np.ndarray, num_shards: int, salt: int) -> np.ndarray:
    if num_shards < 1:
        raise ValueError("shard_ids: num_shards must be at least 1")
    with np.errstate(over="ignore"):
        h = mix64(ids.view(np.uint64) ^ np.uint64(salt))
    return (h % np.uint64(num_shards)).astype(np.int64)


def initial_rows(
    ids: np.ndarray, seed: int, golden: int, salt: int, low: float, high: float, out: np.ndarray
) -> None:
    u = ids.view(np.uint64).reshape(-1, 1)
    cols = np.arange(out.shape[1], dtype=np.uint64).reshape(1, -1)
    with np.errstate(over="ignore"):
        key = mix64(u * np.uint64(golden) ^ mix64(np.uint64(seed) + cols * np.uint64(salt)))
    unit = (key >> np.uint64(11)).astype(np.float64) * 2.0**-53
    out[...] = low + (high - low) * unit


def create_rows(
    rows: np.ndarray,
    new_ids: np.ndarray,
    values: np.ndarray,
    slots: tuple[np.ndarray, ...],
    inits: tuple[float, ...],
    ids: np.ndarray,
    live: np.ndarray,
    last_seen: np.ndarray,
    freq: np.ndarray,
    epochs: np.ndarray,
    lookups: int,
    epoch: int,
    seed: int,
    golden: int,
    salt: int,
    low: float,
    high: float,
) -> None:
    n = rows.size
    if new_ids.size != n or len(inits) != len(slots) or any(s.shape != values.shape for s in slots):
        raise ValueError(
            f"create_rows: {n} rows for {new_ids.size} ids, {len(slots)} slots for "
            f"{len(inits)} initial values, or a slot not shaped as the rows"
        )
    limit = min(a.shape[0] for a in (values, ids, live, last_seen, freq, epochs))
    if n and not (rows.min() >= 0 and rows.max() < limit):
        raise IndexError("create_rows: a row outside the table")
    out = np.empty((n, values.shape[1]), values.dtype)
    initial_rows(new_ids, seed, golden, salt, low, high, out)
    values[rows] = out
    for arr, init in zip(slots, inits):
        arr[rows] = init
    ids[rows] = new_ids
    live[rows] = 1
    last_seen[rows] = lookups
    freq[rows] = 0
    epochs[rows] = epoch


def aligned_allocations() -> None:
    """numpy's own allocator stays (the compiled module's puts rows on cache lines; the
    reference needs no build)."""
    return None


def io_uring_reads() -> bool:
    """The numpy kernels read records by ``os.preadv``, never through io_uring."""
    return False


def pread_records(fd: int, records: np.ndarray, width: int, out: np.ndarray, offset: int = 0) -> int:
    if out.shape[0] < records.size or out.shape[1] != width:
        raise ValueError("pread_records: out must be (records, width)")
    if offset < 0:
        raise ValueError("pread_records: offset must be at least 0")
    n = records.size
    breaks = np.flatnonzero(np.diff(records) != 1) + 1
    for lo, hi in zip([0, *breaks.tolist()], [*breaks.tolist(), n]):
        if lo >= hi:
            continue
        want = (hi - lo) * width
        try:
            got = os.preadv(fd, [out[lo:hi].data], offset + int(records[lo]) * width)
        except OSError as exc:
            return exc.errno or -1
        if got != want:
            return -1
    return 0


# -- strings: FarmHash's Fingerprint64 (farmhashna::Hash64), in Python integers -----------------
_M64 = (1 << 64) - 1
_FH_K0, _FH_K1, _FH_K2 = 0xC3A5C85C97CB3127, 0xB492B66FBE98F273, 0x9AE16A3B2F90404F


def _fh_rot(v: int, s: int) -> int:
    return v if s == 0 else ((v >> s) | (v << (64 - s))) & _M64


def _fh_h16(u: int, v: int, mul: int) -> int:
    a = ((u ^ v) * mul) & _M64
    a ^= a >> 47
    b = ((v ^ a) * mul) & _M64
    b ^= b >> 47
    return (b * mul) & _M64


def _fh_weak32(s: bytes, i: int, a: int, b: int) -> tuple[int, int]:
    w, x, y, z = (int.from_bytes(s[j : j + 8], "little") for j in range(i, i + 32, 8))
    a = (a + w) & _M64
    b = _fh_rot((b + a + z) & _M64, 21)
    c = a
    a = (a + x + y) & _M64
    b = (b + _fh_rot(a, 44)) & _M64
    return (a + z) & _M64, (b + c) & _M64


def _fingerprint(s: bytes) -> int:
    n, k0, k1, k2, m = len(s), _FH_K0, _FH_K1, _FH_K2, _M64

    def f64(i: int) -> int:
        return int.from_bytes(s[i : i + 8], "little")

    def f32(i: int) -> int:
        return int.from_bytes(s[i : i + 4], "little")

    mul = (k2 + n * 2) & m
    if n <= 16:
        if n >= 8:
            a, b = (f64(0) + k2) & m, f64(n - 8)
            return _fh_h16((_fh_rot(b, 37) * mul + a) & m, ((_fh_rot(a, 25) + b) * mul) & m, mul)
        if n >= 4:
            return _fh_h16((n + (f32(0) << 3)) & m, f32(n - 4), mul)
        if n > 0:
            y, z = s[0] + (s[n >> 1] << 8), n + (s[n - 1] << 2)
            v = ((y * k2) ^ (z * k0)) & m
            return ((v ^ (v >> 47)) * k2) & m
        return k2
    a, b, c, d = (
        (f64(0) * (k1 if n <= 32 else k2)) & m,
        f64(8),
        (f64(n - 8) * mul) & m,
        (f64(n - 16) * k2) & m,
    )
    y = (_fh_rot((a + b) & m, 43) + _fh_rot(c, 30) + d) & m
    if n <= 32:
        return _fh_h16(y, (a + _fh_rot((b + k2) & m, 18) + c) & m, mul)
    if n <= 64:
        z = _fh_h16(y, (a + _fh_rot((b + k2) & m, 18) + c) & m, mul)
        e, f = (f64(16) * mul) & m, f64(24)
        g, h = ((y + f64(n - 32)) * mul) & m, ((z + f64(n - 24)) * mul) & m
        return _fh_h16(
            (_fh_rot((e + f) & m, 43) + _fh_rot(g, 30) + h) & m, (e + _fh_rot((f + a) & m, 18) + g) & m, mul
        )
    x, y = 81, (81 * k1 + 113) & m
    z = (((y * k2 + 113) & m) ^ (((y * k2 + 113) & m) >> 47)) * k2 & m
    v0 = v1 = w0 = w1 = 0
    x = (x * k2 + f64(0)) & m
    end, i = ((n - 1) // 64) * 64, 0
    while True:
        x = (_fh_rot((x + y + v0 + f64(i + 8)) & m, 37) * k1) & m
        y = (_fh_rot((y + v1 + f64(i + 48)) & m, 42) * k1) & m
        x ^= w1
        y = (y + v0 + f64(i + 40)) & m
        z = (_fh_rot((z + w0) & m, 33) * k1) & m
        v0, v1 = _fh_weak32(s, i, (v1 * k1) & m, (x + w0) & m)
        w0, w1 = _fh_weak32(s, i + 32, (z + w1) & m, (y + f64(i + 16)) & m)
        z, x = x, z
        i += 64
        if i == end:
            break
    mul = (k1 + ((z & 0xFF) << 1)) & m
    i = end + ((n - 1) & 63) - 63
    w0 = (w0 + ((n - 1) & 63)) & m
    v0 = (v0 + w0) & m
    w0 = (w0 + v0) & m
    x = (_fh_rot((x + y + v0 + f64(i + 8)) & m, 37) * mul) & m
    y = (_fh_rot((y + v1 + f64(i + 48)) & m, 42) * mul) & m
    x ^= (w1 * 9) & m
    y = (y + v0 * 9 + f64(i + 40)) & m
    z = (_fh_rot((z + w0) & m, 33) * mul) & m
    v0, v1 = _fh_weak32(s, i, (v1 * mul) & m, (x + w0) & m)
    w0, w1 = _fh_weak32(s, i + 32, (z + w1) & m, (y + f64(i + 16)) & m)
    z, x = x, z
    return _fh_h16((_fh_h16(v0, w0, mul) + (y ^ (y >> 47)) * k0 + z) & m, (_fh_h16(v1, w1, mul) + x) & m, mul)


def _strings_checked(data: np.ndarray, offsets: np.ndarray, what: str) -> int:
    n = offsets.shape[0] - 1
    if n < 0:
        raise ValueError(f"{what}: offsets must hold at least one number")
    if n and (int(offsets[0]) < 0 or np.any(np.diff(offsets) < 0) or int(offsets[-1]) > data.shape[0]):
        raise ValueError(f"{what}: offsets outside the data or decreasing")
    return n


def fingerprint64(data: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    n = _strings_checked(data, offsets, "fingerprint64")
    raw = data.tobytes()
    return np.array([_fingerprint(raw[offsets[i] : offsets[i + 1]]) for i in range(n)], np.uint64)


def _sipround(v: list[int]) -> None:
    v[0] = (v[0] + v[1]) & _M64
    v[1] = _rotl64(v[1], 13) ^ v[0]
    v[0] = _rotl64(v[0], 32)
    v[2] = (v[2] + v[3]) & _M64
    v[3] = _rotl64(v[3], 16) ^ v[2]
    v[0] = (v[0] + v[3]) & _M64
    v[3] = _rotl64(v[3], 21) ^ v[0]
    v[2] = (v[2] + v[1]) & _M64
    v[1] = _rotl64(v[1], 17) ^ v[2]
    v[2] = _rotl64(v[2], 32)


def _rotl64(v: int, s: int) -> int:
    return ((v << s) | (v >> (64 - s))) & _M64


def _siphash(raw: bytes, k0: int, k1: int) -> int:
    v = [k0 ^ 0x736F6D6570736575, k1 ^ 0x646F72616E646F6D, k0 ^ 0x6C7967656E657261, k1 ^ 0x7465646279746573]
    whole = len(raw) - len(raw) % 8
    for i in range(0, whole, 8):
        m = int.from_bytes(raw[i : i + 8], "little")
        v[3] ^= m
        _sipround(v)
        _sipround(v)
        v[0] ^= m
    last = ((len(raw) & 0xFF) << 56) | int.from_bytes(raw[whole:], "little")
    v[3] ^= last
    _sipround(v)
    _sipround(v)
    v[0] ^= last
    v[2] ^= 0xFF
    for _ in range(4):
        _sipround(v)
    return v[0] ^ v[1] ^ v[2] ^ v[3]


def siphash24(data: np.ndarray, offsets: np.ndarray, k0: int, k1: int) -> np.ndarray:
    n = _strings_checked(data, offsets, "siphash24")
    raw = data.tobytes()
    return np.array(
        [_siphash(raw[offsets[i] : offsets[i + 1]], int(k0), int(k1)) for i in range(n)], np.uint64
    )


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        table.append(c)
    return table


_CRC32C = _crc32c_table()


def crc32c(data: np.ndarray, crc: int = 0) -> int:
    c = crc ^ 0xFFFFFFFF
    for b in data.tobytes():
        c = _CRC32C[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


_LIST_NAMES = {1: "bytes_list", 2: "float_list", 3: "int64_list"}


class _Cut(Exception):
    pass


def _varint_at(data: bytes, i: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= end or shift > 63:
            raise _Cut
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value & ((1 << 64) - 1), i
        shift += 7


def _fields(data: bytes, start: int, end: int) -> list[tuple[int, int, Any]]:
    """``(field, wire type, value)`` of a message: a varint's number, a delimited field's
    ``(start, end)``, a fixed one's bytes."""
    out: list[tuple[int, int, Any]] = []
    i = start
    while i < end:
        tag, i = _varint_at(data, i, end)
        field, wire = tag >> 3, tag & 7
        v: Any
        if wire == 0:
            v, i = _varint_at(data, i, end)
        elif wire == 2:
            n, i = _varint_at(data, i, end)
            if n > end - i:
                raise _Cut
            v, i = (i, i + n), i + n
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            if i + size > end:
                raise _Cut
            v, i = data[i : i + size], i + size
        else:
            raise _Cut
        out.append((field, wire, v))
    return out


def parse_examples(
    records: list[bytes], keys: dict[bytes, int], kinds: bytes
) -> tuple[list[np.ndarray], np.ndarray]:
    nf = len(kinds)
    if any(kind not in b"bfi" for kind in kinds):
        raise ValueError(f"parse_examples: kinds must be b (bytes), f (float32) or i (int64), got {kinds!r}")
    counts = np.full((nf, len(records)), -1, np.int64)
    values: list[list[Any]] = [[] for _ in range(nf)]
    for r, record in enumerate(records):
        per: dict[int, list[Any]] = {}
        try:
            for field, wire, span in _fields(record, 0, len(record)):
                if field != 1 or wire != 2:
                    continue
                for efield, ewire, entry in _fields(record, *span):
                    if efield != 1 or ewire != 2:
                        continue
                    key, value = (entry[0], entry[0]), (entry[0], entry[0])
                    for kfield, kwire, part in _fields(record, *entry):
                        if kwire == 2 and kfield == 1:
                            key = part
                        elif kwire == 2 and kfield == 2:
                            value = part
                    f = keys.get(record[key[0] : key[1]])
                    if f is None:
                        continue
                    kind, lst = 0, (value[0], value[0])
                    for vfield, vwire, part in _fields(record, *value):
                        if 1 <= vfield <= 3 and vwire == 2:
                            kind, lst = vfield, part
                    want = {ord("b"): 1, ord("f"): 2, ord("i"): 3}[kinds[f]]
                    if kind and kind != want:
                        name = record[key[0] : key[1]].decode("utf-8", "replace")
                        raise ValueError(
                            f"record {r}, feature {name!r}: data types don't match: it holds "
                            f"{_LIST_NAMES[kind]}, the spec asks for {_LIST_NAMES[want]}"
                        )
                    per.pop(f, None)  # the last of a key wins
                    if not kind:
                        continue
                    got: list[Any] = []
                    for lfield, lwire, part in _fields(record, *lst):
                        if lfield != 1:
                            continue
                        if want == 1 and lwire == 2:
                            got.append(record[part[0] : part[1]])
                        elif want == 3 and lwire == 0:
                            got.append(part)
                        elif want == 2 and lwire == 5:
                            got.append(part)
                        elif lwire == 2 and want == 2:
                            if (part[1] - part[0]) % 4:
                                raise _Cut
                            raw = record[part[0] : part[1]]
                            got.extend(raw[k : k + 4] for k in range(0, len(raw), 4))
                        elif lwire == 2 and want == 3:
                            i = part[0]
                            while i < part[1]:
                                v, i = _varint_at(record, i, part[1])
                                got.append(v)
                        elif want != 1:
                            raise _Cut
                    per[f] = got
        except _Cut:
            raise ValueError(f"record {r} is not a tf.train.Example (a field is cut or of no kind)") from None
        for f, got in per.items():
            counts[f, r] = len(got)
            values[f].extend(got)
    out: list[np.ndarray] = []
    for f in range(nf):
        if kinds[f] == ord("b"):
            arr = np.empty(len(values[f]), object)
            arr[:] = values[f]
        elif kinds[f] == ord("f"):
            arr = np.frombuffer(b"".join(values[f]), np.float32).copy()
        else:
            arr = np.array(values[f], np.uint64).view(np.int64) if values[f] else np.zeros(0, np.int64)
        out.append(arr)
    return out, counts


def _masked_crc(data: bytes) -> int:
    crc = crc32c(np.frombuffer(data, np.uint8))
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord_split(buf: np.ndarray) -> tuple[list[bytes], int, int, int, int]:
    raw, at = buf.tobytes(), 0
    records: list[bytes] = []
    while len(raw) - at >= 12:
        length = int.from_bytes(raw[at : at + 8], "little")
        if _masked_crc(raw[at : at + 8]) != int.from_bytes(raw[at + 8 : at + 12], "little"):
            return records, at, 1, at, 0
        if length > len(raw) - at - 16:
            return records, at, 0, at, length + 16 - (len(raw) - at)
        data = raw[at + 12 : at + 12 + length]
        if _masked_crc(data) != int.from_bytes(raw[at + 12 + length : at + 16 + length], "little"):
            return records, at, 2, at, 0
        records.append(data)
        at += 16 + length
    return records, at, 0, at, 0
