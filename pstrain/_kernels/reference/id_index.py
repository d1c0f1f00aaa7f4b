"""The id index in numpy: open addressing with linear probing from each id's hash, a batch at a
time (one numpy pass per probe step over the ids still looking, a short Python loop for the
few long probes left), and the compact index's and the sightings' counts."""

from __future__ import annotations

from typing import Any

import numpy as np

from .rows import positions_checked

__all__ = [
    "absent",
    "compact_delete",
    "compact_get",
    "compact_insert",
    "count_sightings",
    "home",
    "index_delete",
    "index_get",
    "index_insert",
    "index_locate",
    "index_refind",
    "mix64",
    "same_ids",
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


def _rows_distinct(pos: np.ndarray, mark: np.ndarray) -> bool:
    found = pos[positions_checked("index_locate", mark, pos, "table")]
    return bool(np.unique(found).size == found.size)
