"""The scatter updates of TF's variables on numpy rows, the same on a ps and locally:
``scatter_add``, ``scatter_sub``, ``scatter_mul``, ``scatter_div``, ``scatter_min``,
``scatter_max`` and ``scatter_update``. Repeated ids all apply, as TF applies them (their
sum, product, minimum ...); ``scatter_update`` of a repeated id keeps its last row.

>>> a = np.ones((3, 2))
>>> scatter(a, np.array([0, 0, 2]), np.full((3, 2), 2.0), "scatter_mul")
>>> a[:, 0].tolist()
[4.0, 1.0, 2.0]
"""

from __future__ import annotations

import numpy as np

from ..._base.errors import InvalidArgumentError

#: The numpy ufunc each accumulating scatter applies at its rows.
_UFUNCS = {
    "scatter_add": np.add,
    "scatter_sub": np.subtract,
    "scatter_mul": np.multiply,
    "scatter_div": np.divide,
    "scatter_min": np.minimum,
    "scatter_max": np.maximum,
}

KINDS = (*_UFUNCS, "scatter_update")


def check(kind: str, dtype: np.dtype, name: str) -> None:
    """Refuse, before anything changes, a scatter a variable of ``dtype`` cannot take."""
    if kind == "scatter_div" and dtype.kind not in "fc":
        raise InvalidArgumentError(
            f"scatter_div of variable {name!r}: its dtype {dtype} is not floating point "
            "(divide the rows and scatter_update them)"
        )


def scatter(array: np.ndarray, idx: np.ndarray, values: np.ndarray, kind: str) -> None:
    """Apply ``kind`` of ``values`` at rows ``idx`` of ``array`` in place (checked first)."""
    if kind == "scatter_update":
        array[idx] = values
        return
    _UFUNCS[kind].at(array, idx, values)
