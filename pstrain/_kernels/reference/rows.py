"""Rows in numpy: gathers and puts, row order, change stamps, the coldest rows, the rows
changed since a mark and where a tier's rows on disk lie."""

from __future__ import annotations

import numpy as np

__all__ = [
    "ascending_rows",
    "decode_places",
    "gather_rows",
    "keep_changed",
    "mark_bits",
    "pick_victims",
    "positions_checked",
    "put_rows",
    "rows_after",
    "stamp_rows",
]


def positions_checked(name: str, var: np.ndarray, rows: np.ndarray, what: str = "variable") -> np.ndarray:
    """Which of ``rows`` exist (not -1); raises if one is past ``var``'s end."""
    if rows.size and rows.max() >= var.shape[0]:
        raise IndexError(f"{name}: a row past the {what}'s end")
    return rows >= 0


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
    found = positions_checked("gather_rows", table, pos, "table")
    out[found] = table[pos[found]]
    out[~found] = default
    if last_seen is not None:
        last_seen[pos[found]] = clock
    if freq is not None:
        freq[pos[found]] += 1


def put_rows(out: np.ndarray, rows: np.ndarray, values: np.ndarray, add: bool = False) -> None:
    if values.shape != (rows.size, out.shape[1]):
        raise ValueError("put_rows: values are not (len(rows), dim)")
    keep = positions_checked("put_rows", out, rows, "array")
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
    hit = pos[positions_checked("stamp_rows", epochs, pos, "table")]
    epochs[hit] = epoch
    return int(hit.size)


def flag_rows(bits: np.ndarray, pos: np.ndarray, rows: int) -> int:
    if bits.shape[0] != (rows + 7) // 8:
        raise ValueError(f"flag_rows: {bits.shape[0]} bytes of bits for {rows} rows")
    if pos.size and pos.max() >= rows:
        raise IndexError("flag_rows: a row past the table's end")
    hit = pos[pos >= 0]
    np.bitwise_or.at(bits, hit >> 3, (1 << (hit & 7)).astype(np.uint8))
    return int(hit.size)


def stamp_flagged(bits: np.ndarray, epochs: np.ndarray, epoch: int) -> int:
    if bits.shape[0] != (epochs.shape[0] + 7) // 8:
        raise ValueError(f"stamp_flagged: {bits.shape[0]} bytes of bits for {epochs.shape[0]} rows")
    flagged = np.flatnonzero(np.unpackbits(bits, bitorder="little")[: epochs.shape[0]])
    epochs[flagged] = epoch
    bits[:] = 0
    return int(flagged.size)


def pick_victims(
    key: np.ndarray,
    live: np.ndarray,
    protect: np.ndarray,
    mark: np.ndarray,
    used: int,
    n: int,
    low: int = 0,
    high: int = -1,
    tiebreak: np.ndarray | None = None,
) -> np.ndarray:
    # ``low`` and ``high`` only spare the compiled kernel a pass: the answer is the same
    limit = min(used, key.size, live.size, mark.size)
    if tiebreak is not None and tiebreak.size < limit:
        raise ValueError("pick_victims: tiebreak is shorter than the rows it orders")
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
    tied = np.flatnonzero(k == threshold)
    if tiebreak is not None:  # the tied rows of smallest tiebreak first (then the lowest)
        tied = tied[np.argsort(tiebreak[rows[tied]], kind="stable")]
    take[tied[: n - int(np.count_nonzero(take))]] = True
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


def decode_places(codes: np.ndarray, bits: int, numbers: np.ndarray, firsts: np.ndarray) -> np.ndarray:
    if not 0 < bits < 32:
        raise ValueError(f"decode_places: bits must be in 1..31, got {bits}")
    if firsts.shape[0] != numbers.shape[0]:
        raise ValueError("decode_places: numbers and firsts differ in length")
    out = np.full(codes.shape, -1, np.int64)
    used = codes != np.uint32(0xFFFFFFFF)
    handles = (codes[used] >> np.uint32(bits)).astype(np.int64)
    if handles.size and handles.max() >= numbers.size:
        raise IndexError("decode_places: a code whose handle was never given")
    records = firsts[handles] + (codes[used] & np.uint32((1 << bits) - 1)).astype(np.int64)
    out[used] = (numbers[handles] << 32) | records
    return out


def mark_bits(bits: np.ndarray, slots: np.ndarray, on: np.ndarray) -> None:
    n = slots.size
    if on.size and on.size != n:
        raise ValueError(f"mark_bits: {n} slots but {on.size} answers")
    if n and (slots.min() < 0 or (slots.max() >> 3) >= bits.size):
        raise IndexError("mark_bits: a slot past the bits")
    byte, bit = slots >> 3, np.left_shift(1, slots & 7).astype(np.uint8)
    np.bitwise_and.at(bits, byte, ~bit)
    if on.size:
        set_ = on.astype(bool)
        np.bitwise_or.at(bits, byte[set_], bit[set_])
