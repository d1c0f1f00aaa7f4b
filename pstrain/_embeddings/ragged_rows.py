"""TF's row lookups of ragged ids: ``tf.nn.embedding_lookup(table, ragged_ids)`` gives a
RaggedTensor of rows, a sequence of rows per example (a user's last clicks, a query's
terms), which a sequence model pads or attends over.

:func:`embedding_lookup` is ``pstrain.nn.embedding_lookup``: ids of a fixed shape go to
the variables' lookup as before; bags of ids (a :class:`~pstrain.JaggedTensor`, or a
RaggedTensor, TF's or one with ``values`` and ``row_splits``) come back as
:class:`RaggedRows`, each id's row in the bags' order. ``with_gradient=True`` gives the way
back, from the gradient of the rows (flat, as ``values``) or of their padded
``to_tensor()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._base.errors import InvalidArgumentError
from .._base.exports import expose
from .._variables.arrays import IndexedSlices
from .._variables.sharding import LookupGradient, embedding_lookup as _lookup
from .jagged import JaggedTensor, as_jagged

__all__ = ["RaggedRows", "embedding_lookup"]


class RaggedRows:
    """What a lookup of bags of ids gives: TF's RaggedTensor of rows. ``values`` (also
    ``flat_values``) holds each id's row, ``[ids, *row_shape]``, and example ``i``'s are
    ``values[row_splits[i]:row_splits[i + 1]]``."""

    __slots__ = ("values", "row_splits")

    def __init__(self, values: np.ndarray, row_splits: np.ndarray) -> None:
        self.values, self.row_splits = values, row_splits

    @property
    def flat_values(self) -> np.ndarray:
        """``values`` (TF's name for the innermost values)."""
        return self.values

    @property
    def shape(self) -> tuple[int | None, ...]:
        """``(examples, None, *row_shape)``, as TF's."""
        return (self.nrows(), None, *self.values.shape[1:])

    def nrows(self) -> int:
        """The number of examples."""
        return int(self.row_splits.size) - 1

    def __len__(self) -> int:
        return self.nrows()

    def row_lengths(self) -> np.ndarray:
        """Each example's number of rows."""
        return np.diff(self.row_splits)

    def to_list(self) -> list[list[Any]]:
        """Each example's rows as nested lists."""
        return [self.values[a:b].tolist() for a, b in zip(self.row_splits[:-1], self.row_splits[1:])]

    def to_tensor(self, default_value: Any = None, shape: Sequence[int | None] | None = None) -> np.ndarray:
        """``[examples, N, *row_shape]``: each example's rows, padded with ``default_value``
        (0) to ``N``, the longest example's count, or cut to ``shape[1]`` if given, keeping
        each example's first rows (TF's ``to_tensor``)."""
        width = self._width(shape)
        out = np.full(
            (self.nrows(), width, *self.values.shape[1:]),
            0 if default_value is None else default_value,
            self.values.dtype,
        )
        example, position = self._places()
        kept = position < width
        out[example[kept], position[kept]] = self.values[kept]
        return out

    def _width(self, shape: Sequence[int | None] | None) -> int:
        lengths = self.row_lengths()
        longest = int(lengths.max()) if lengths.size else 0
        if shape is None:
            return longest
        given = list(shape)
        if len(given) != 2 + self.values.ndim - 1:
            raise InvalidArgumentError(
                f"to_tensor: shape must have {self.values.ndim + 1} dimensions, got {given}"
            )
        if given[0] not in (None, self.nrows()) or any(
            g not in (None, d) for g, d in zip(given[2:], self.values.shape[1:])
        ):
            raise InvalidArgumentError(
                f"to_tensor: shape {given} does not fit rows of shape {list(self.shape)}: only the "
                "second dimension (the rows kept per example) may be chosen"
            )
        if given[1] is None:
            return longest
        if int(given[1]) < 0:
            raise InvalidArgumentError(f"to_tensor: shape[1] must be 0 or more, got {given[1]}")
        return int(given[1])

    def _places(self) -> tuple[np.ndarray, np.ndarray]:
        """Each value's example and its position in it."""
        lengths = self.row_lengths()
        example = np.repeat(np.arange(self.nrows()), lengths)
        position = np.arange(self.values.shape[0]) - np.repeat(self.row_splits[:-1], lengths)
        return example, position

    def __repr__(self) -> str:
        return f"RaggedRows(values={self.values.shape}, nrows={self.nrows()})"


class RaggedLookupGradient:
    """The way back from a lookup of bags (``with_gradient=True``): ``gradient(upstream)``
    takes the gradient of the loss by the rows, flat (``values``' shape, or a
    :class:`RaggedRows` of it) or padded (``to_tensor()``'s: a row cut off gets none), and
    gives the table's, as sparse rows."""

    __slots__ = ("rows", "flat")

    def __init__(self, rows: RaggedRows, flat: LookupGradient) -> None:
        self.rows, self.flat = rows, flat

    def __call__(self, upstream: Any) -> IndexedSlices:
        if isinstance(upstream, RaggedRows):
            upstream = upstream.values
        d = np.asarray(upstream)
        values = self.rows.values
        if d.ndim == values.ndim + 1 and d.shape[0] == self.rows.nrows() and d.shape[2:] == values.shape[1:]:
            example, position = self.rows._places()  # noqa: SLF001 - this module's own
            kept = position < d.shape[1]
            flat = np.zeros(values.shape, d.dtype)
            flat[kept] = d[example[kept], position[kept]]
            d = flat
        return self.flat(d)


def _is_ragged(ids: Any) -> bool:
    return isinstance(ids, JaggedTensor) or (hasattr(ids, "row_splits") and hasattr(ids, "values"))


async def embedding_lookup(
    params: Any,
    ids: Any,
    max_norm: float | None = None,
    name: str | None = None,
    *,
    training: bool = True,
    with_gradient: bool = False,
) -> Any:
    """Rows ``ids`` of ``params`` (TF's ``tf.nn.embedding_lookup``): for ids of a fixed
    shape, an array of shape ``ids.shape + params.shape[1:]``; for bags of ids (a
    :class:`~pstrain.JaggedTensor` or a RaggedTensor), :class:`RaggedRows`, as TF gives a
    RaggedTensor. ``max_norm``: rows whose L2 norm is larger come back scaled down to it;
    ``name`` is TF's and unused. Ids are deduplicated first; each ps holding a needed part
    gets one request. ``training=False`` (evaluation, serving): a dynamic table admits no
    id. ``with_gradient=True``: ``(rows, gradient)``, ``gradient(upstream)`` the table's
    gradient as sparse rows (what TF's ``tape.gradient`` gives), from the gradient of the
    rows (for bags: flat or padded as ``to_tensor()`` pads them)."""
    if not _is_ragged(ids):
        if all(hasattr(ids, a) for a in ("indices", "values", "dense_shape")):
            raise InvalidArgumentError(
                "embedding_lookup takes ids of a fixed shape or bags of ids (a JaggedTensor or "
                "RaggedTensor), not a SparseTensor (TF refuses one too): pool its bags with "
                "embedding_lookup_sparse, or give JaggedTensor.from_sparse(ids)"
            )
        return await _lookup(params, ids, max_norm, name, training=training, with_gradient=with_gradient)
    bags = as_jagged(ids)
    if bags.weights is not None:
        raise InvalidArgumentError(
            "embedding_lookup: the bags carry weights, which a lookup of each id's row has no "
            "use for: pool them with embedding_lookup_sparse, or give the bags without weights"
        )
    got = await _lookup(params, bags.values, max_norm, name, training=training, with_gradient=with_gradient)
    if not with_gradient:
        return RaggedRows(got, bags.offsets.copy())
    rows = RaggedRows(got[0], bags.offsets.copy())
    return rows, RaggedLookupGradient(rows, got[1])


expose(globals(), "pstrain.nn")
