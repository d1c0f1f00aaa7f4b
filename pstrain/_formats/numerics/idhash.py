"""Hashes of raw 64-bit ids: which ps holds an id, and an id's initial row.

Both are pure functions of the id (and a seed), computed the same way on the
coordinator, the workers and the ps: a retried closure sees the same row, and
a checkpoint restored into a different number of ps re-routes every id by
:func:`shard_of` alone.

>>> ids = np.array([0, 1, -1, 2**62], np.int64)
>>> shard_of(ids, 3).tolist() == shard_of(ids.copy(), 3).tolist()
True
>>> rows = initial_rows(ids, 4, np.dtype("float32"), seed=7, low=-0.05, high=0.05)
>>> again = initial_rows(ids, 4, np.dtype("float32"), 7, -0.05, 0.05)
>>> rows.shape, bool(np.all(np.abs(rows) <= 0.05)), bool(np.all(rows == again))
((4, 4), True, True)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..._kernels import KERNELS, reference
from ..._kernels.reference import mix64

__all__ = ["Shard", "in_slices", "initial_rows", "mix64", "row_hash", "shard_of", "unit_uniform"]

#: A ps's part of a table: its shard of ``num_shards``, or the slices of ``num_shards`` it holds.
Shard = int | Sequence[int]

_GOLDEN = 0x9E3779B97F4A7C15  # an id's multiplier in its initial row's hash
_SALT = 0x2545F4914F6CDD1D  # mixed into an id's shard, and into each column of its initial row


def _as_u64(ids: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(ids, np.int64).view(np.uint64)


def shard_of(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """The shard (ps) of each int64 id: a hash of the id modulo ``num_shards``."""
    return KERNELS.shard_ids(np.ascontiguousarray(ids, np.int64), int(num_shards), _SALT)


#: Ids :func:`in_slices` hashes at a time (a restore's base: tens of millions of them).
SLICE_BLOCK = 1 << 20


def in_slices(ids: np.ndarray, num_slices: int, owned: Shard) -> np.ndarray:
    """Which ids fall in slice(s) ``owned`` of the hash space cut in ``num_slices``
    (``shard_of(ids, num_slices)``): a ps's part of a table, one shard or the slices a
    move gave it.

    >>> ids = np.arange(-50, 50, dtype=np.int64)
    >>> bool(np.all(in_slices(ids, 4, 1) == in_slices(ids, 8, [1, 5])))
    True
    """
    ids = np.ascontiguousarray(ids, np.int64)
    mask = np.zeros(num_slices, bool)
    mask[np.asarray(owned, np.int64)] = True
    out = np.empty(ids.shape, bool)
    for lo in range(0, ids.size, SLICE_BLOCK):  # (no array of every id's shard at once)
        out[lo : lo + SLICE_BLOCK] = mask[shard_of(ids[lo : lo + SLICE_BLOCK], num_slices)]
    return out


def unit_uniform(ids: np.ndarray, salt: int) -> np.ndarray:
    """A number in [0, 1) per id, a pure function of (id, salt)."""
    with np.errstate(over="ignore"):
        h = mix64(_as_u64(ids) ^ mix64(np.uint64(salt & 0xFFFFFFFFFFFFFFFF)))
    return (h >> np.uint64(11)).astype(np.float64) * 2.0**-53


def row_hash(seed: int) -> tuple[int, int, int]:
    """The constants of :func:`initial_rows`'s formula for ``seed``, as the table kernels
    take them: (seed as uint64, the ids' multiplier, the columns' salt)."""
    return seed & 0xFFFFFFFFFFFFFFFF, _GOLDEN, _SALT


def initial_rows(
    ids: np.ndarray, dim: int, dtype: np.dtype, seed: int, low: float, high: float
) -> np.ndarray:
    """Each id's initial row: uniform in [low, high), from (id, seed, column) alone."""
    wide = np.ascontiguousarray(ids, np.int64).reshape(-1)
    # the formula in float64, cast once: what a table's create_rows kernel writes, bit for bit
    out = np.empty((wide.size, dim), np.float64)
    reference.initial_rows(wide, *row_hash(seed), float(low), float(high), out)
    return out.astype(dtype, copy=False)
