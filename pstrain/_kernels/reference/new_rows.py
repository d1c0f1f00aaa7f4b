"""New rows in numpy: a table's initial rows, made the same wherever they are made."""

from __future__ import annotations

import numpy as np

from .id_index import mix64

__all__ = ["as_created", "create_rows", "initial_rows"]


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


def as_created(
    rows: np.ndarray,
    ids: np.ndarray,
    values: np.ndarray,
    slots: tuple[np.ndarray, ...],
    inits: tuple[float, ...],
    freq: np.ndarray,
    seed: int,
    golden: int,
    salt: int,
    low: float,
    high: float,
    out: np.ndarray,
) -> None:
    n = rows.size
    if ids.size != n or out.size != n or len(inits) != len(slots):
        raise ValueError(
            f"as_created: {n} rows for {ids.size} ids and {out.size} answers, "
            f"{len(slots)} slots for {len(inits)} initial values"
        )
    if any(s.shape != values.shape for s in slots):
        raise ValueError("as_created: a slot not shaped as the rows")
    limit = min(values.shape[0], freq.shape[0])
    if n and not (rows.min() >= 0 and rows.max() < limit):
        raise IndexError("as_created: a row outside the table")
    made = np.empty((n, values.shape[1]), values.dtype)
    initial_rows(ids, seed, golden, salt, low, high, made)
    bits = np.dtype(f"u{values.dtype.itemsize}")  # compared bit for bit (-0.0 is not 0.0)
    same = freq[rows] == 0
    same &= (values[rows].view(bits) == made.view(bits)).all(axis=1)
    for arr, init in zip(slots, inits):
        same &= (arr[rows].view(bits) == np.array(init, values.dtype).view(bits)).all(axis=1)
    out[:] = same
