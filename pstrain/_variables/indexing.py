"""``await variable[index]``: numpy's indexing of a variable that lives on the ps, reading
only the rows the index needs (one part of a sharded variable if it needs one).

TF's ``ShardedVariable.__getitem__`` and ``tf.Variable.__getitem__`` give numpy's result of
the whole array; the read is an ``await`` here, as every read is. The first component of
the index picks the rows (an integer, a slice, integers, or a mask of booleans over the
rows); the rest applies to them. An index that does not start with the rows (``...``,
``None``) reads the whole variable first.

>>> rows_for((slice(1, 3), 0), (5, 2))[0].tolist()
[1, 2]
>>> rows_for(([4, 1, 4],), (5, 2))
(array([1, 4]), (array([1, 0, 1]),))
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._base.errors import InvalidArgumentError


def rows_for(index: Any, shape: tuple[int, ...]) -> tuple[np.ndarray | None, tuple[Any, ...]]:
    """``(rows, rest)``: the rows ``index`` reads from a value of ``shape`` (ascending,
    distinct; None: every row, the index as given), and the index to apply to those rows
    to get numpy's ``value[index]``."""
    parts = index if isinstance(index, tuple) else (index,)
    if not shape or not parts or parts[0] is Ellipsis or parts[0] is None:
        return None, parts
    first, rest, n = parts[0], parts[1:], shape[0]
    if isinstance(first, slice):
        return np.arange(n, dtype=np.int64)[first], (slice(None), *rest)
    given = np.asarray(first)
    if given.dtype == np.bool_:
        if given.shape != (n,):
            raise IndexError(f"a boolean index of shape {given.shape} for {n} rows")
        return np.flatnonzero(given).astype(np.int64), (slice(None), *rest)
    if given.dtype.kind not in "iu" and not (given.size == 0 and given.dtype.kind == "f"):
        raise InvalidArgumentError(
            f"a variable is indexed by integers, slices, booleans, ... and None; got {given.dtype}"
        )
    ids = given.astype(np.int64)
    if ids.size and (int(ids.min()) < -n or int(ids.max()) >= n):
        bad = int(ids[(ids < -n) | (ids >= n)].reshape(-1)[0])
        raise IndexError(f"index {bad} is out of bounds for axis 0 with size {n}")
    ids = np.where(ids < 0, ids + n, ids)
    if ids.ndim == 0:
        return ids.reshape(1), (0, *rest)
    rows, inverse = np.unique(ids, return_inverse=True)
    return rows, (inverse.reshape(ids.shape), *rest)
