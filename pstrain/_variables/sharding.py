"""Sharded variables: one logical variable split by rows over several ps.

A ``variable_partitioner`` given to the strategy (``partitioners.py``)
decides how many parts a variable gets along axis 0; :func:`plan_parts` lays
them out in TF's "div" layout (the first ``n % k`` parts get one extra row).
The placement names them ``<name>/part_<i>`` and places them with its shared
round-robin counter; each part is initialised on its own ps (an initializer
is called with the part's shape and offset, a value is sliced).

:func:`embedding_lookup` gathers rows from every part in parallel, one request
per ps, after deduplicating the ids, so only the rows needed travel.
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._base.context import must_await
from .._base.errors import InvalidArgumentError
from .._base.exports import expose
from .._formats.messages.operations import RowRead, SparseRead
from .._kernels.batches import distinct
from .arrays import IndexedSlices, VariableBase, to_array
from .batched import ensure_created, read_variables
from .routing import routed
from .variables import Variable

if TYPE_CHECKING:
    from .._transport.channels import Channel

__all__ = ["LookupGradient", "ShardedVariable", "compact_ids", "div_sizes", "embedding_lookup", "plan_parts"]


def div_sizes(n: int, k: int) -> list[int]:
    """TF's "div" layout: the first ``n % k`` parts get one extra row."""
    base, extra = divmod(n, k)
    return [base + 1 if i < extra else base for i in range(k)]


def plan_parts(
    partitioner: Any, name: str, shape: tuple[int, ...], dtype: np.dtype
) -> list[tuple[int, int]] | None:
    """``(offset, rows)`` of each part ``partitioner`` asks for (None: keep it whole)."""
    try:
        parts = partitioner(tuple(shape), dtype)
    except InvalidArgumentError:
        raise
    except Exception as exc:
        raise InvalidArgumentError(f"variable_partitioner failed for {name!r}: {exc}") from exc
    if (
        not isinstance(parts, (list, tuple))
        or not parts
        or len(parts) != len(shape)
        or not all(isinstance(p, (int, np.integer)) for p in parts)
        or parts[0] < 1
        or any(p != 1 for p in parts[1:])
    ):
        raise InvalidArgumentError(
            f"variable_partitioner must return one count per axis with a positive first element "
            f"and 1 elsewhere; got {parts!r} for {name!r} of shape {shape}"
        )
    k = min(int(parts[0]), shape[0])
    if k <= 1:
        return None
    out = []
    offset = 0
    for size in div_sizes(shape[0], k):
        out.append((offset, size))
        offset += size
    return out


class ShardedVariable(VariableBase):
    """A variable split by rows into parts that live on different ps.

    Reads concatenate the parts; ``assign*`` split a full value by the parts'
    offsets; row operations route global row ids to the part that holds them.

    >>> sv = ShardedVariable([Variable(np.zeros((2, 3)), name="w/part_0"),
    ...                       Variable(np.ones((1, 3)), name="w/part_1")])
    >>> sv.name, sv.shape, [v.name for v in sv.variables]
    ('w', (3, 3), ['w/part_0', 'w/part_1'])
    """

    __slots__ = ("_variables", "_name", "_offsets", "_shape", "__weakref__")

    def __init__(self, variables: Sequence[Variable], name: str | None = None) -> None:
        if (
            not isinstance(variables, (list, tuple))
            or not variables
            or not all(isinstance(v, Variable) for v in variables)
        ):
            raise TypeError(
                f"ShardedVariable variables should be a non-empty list of Variables, got {variables!r}"
            )
        if len({v.dtype for v in variables}) != 1:
            raise InvalidArgumentError("ShardedVariable parts must have the same dtype")
        if len({v.shape[1:] for v in variables}) != 1 or any(not v.shape for v in variables):
            raise InvalidArgumentError(
                "ShardedVariable parts must have the same shapes except for the first axis"
            )
        self._variables = list(variables)
        self._name = name or variables[0].name.rsplit("/part_", 1)[0]
        sizes = [v.shape[0] for v in variables]
        self._offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._shape = (int(self._offsets[-1]),) + variables[0].shape[1:]

    # -- properties ----------------------------------------------------------------------------
    @property
    def variables(self) -> list[Variable]:
        """The parts, in row order (each a :class:`Variable` on its ps)."""
        return list(self._variables)

    @property
    def name(self) -> str:
        """The name of the whole variable."""
        return self._name

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the whole variable (the parts' rows added up)."""
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        """The element type."""
        return self._variables[0].dtype

    @property
    def trainable(self) -> bool:
        """Whether ``trainable_variables`` lists its parts."""
        return self._variables[0].trainable

    @property
    def offsets(self) -> np.ndarray:
        """Row offset of each part, then the total row count."""
        return self._offsets.copy()

    def __repr__(self) -> str:
        return (
            f"<pstrain.ShardedVariable {self._name!r} shape={self._shape} dtype={self.dtype} "
            f"parts={len(self._variables)}>"
        )

    # -- reads and writes ----------------------------------------------------------------------
    @must_await
    async def read_value(self) -> np.ndarray:
        """The whole value: every part read (one request per ps) and concatenated."""
        return np.concatenate(await read_variables(self._variables), axis=0)

    @must_await
    async def numpy(self) -> np.ndarray:
        """The whole value as a numpy array (as :meth:`read_value`)."""
        return await self.read_value()

    def _split(self, value: Any, what: str) -> list[np.ndarray]:
        arr = to_array(value, self.dtype, f"{what} of variable {self._name!r}")
        if arr.shape != self._shape:
            raise InvalidArgumentError(
                f"{what} of variable {self._name!r}: value has shape {arr.shape}, expected {self._shape}"
            )
        o = self._offsets
        return [arr[o[i] : o[i + 1]] for i in range(len(self._variables))]

    async def _each(self, op: str, value: Any) -> ShardedVariable:
        pieces = self._split(value, op)
        await asyncio.gather(*(getattr(v, op)(p) for v, p in zip(self._variables, pieces)))
        return self

    @must_await
    async def assign(self, value: Any) -> ShardedVariable:
        """Set the whole value (each part its rows)."""
        return await self._each("assign", value)

    @must_await
    async def assign_add(self, delta: Any) -> ShardedVariable:
        """Add ``delta`` (the whole variable's shape) to the value."""
        return await self._each("assign_add", delta)

    @must_await
    async def assign_sub(self, delta: Any) -> ShardedVariable:
        """Subtract ``delta`` (the whole variable's shape) from the value."""
        return await self._each("assign_sub", delta)

    def route(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(part index, row within the part) of each global row id."""
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self._shape[0]):
            bad = ids[(ids < 0) | (ids >= self._shape[0])].reshape(-1)[0]
            raise InvalidArgumentError(
                f"variable {self._name!r}: row id {int(bad)} out of range [0, {self._shape[0]})"
            )
        part = np.searchsorted(self._offsets[1:], ids, side="right")
        return part, ids - self._offsets[part]

    @must_await
    async def sparse_read(self, indices: Any) -> np.ndarray:
        """Rows ``indices`` of the whole variable, each read from the part that holds it."""
        return await embedding_lookup(self, indices)

    async def _scatter(self, op: str, delta: IndexedSlices) -> ShardedVariable:
        if not isinstance(delta, IndexedSlices):
            raise InvalidArgumentError(f"{op} takes an IndexedSlices, got {type(delta).__name__}")
        idx = np.asarray(delta.indices)
        if idx.ndim != 1:
            raise InvalidArgumentError(f"{op}: indices must be 1-D, got shape {idx.shape}")
        part, local = self.route(idx)
        values = np.asarray(delta.values)
        calls = []
        for p in np.unique(part):
            mask = part == p
            calls.append(getattr(self._variables[p], op)(IndexedSlices(values[mask], local[mask])))
        await asyncio.gather(*calls)
        return self

    @must_await
    async def scatter_add(self, sparse_delta: IndexedSlices) -> ShardedVariable:
        """Add the rows of ``sparse_delta`` (an :class:`IndexedSlices` in whole-variable rows)."""
        return await self._scatter("scatter_add", sparse_delta)

    @must_await
    async def scatter_sub(self, sparse_delta: IndexedSlices) -> ShardedVariable:
        """Subtract the rows of ``sparse_delta`` (an :class:`IndexedSlices` in whole-variable rows)."""
        return await self._scatter("scatter_sub", sparse_delta)

    @must_await
    async def scatter_update(self, sparse_delta: IndexedSlices) -> ShardedVariable:
        """Set the rows of ``sparse_delta`` (an :class:`IndexedSlices` in whole-variable rows)."""
        return await self._scatter("scatter_update", sparse_delta)

    @must_await
    async def scatter_mul(self, sparse_delta: IndexedSlices) -> ShardedVariable:
        """Multiply the rows of ``sparse_delta`` (whole-variable rows) in."""
        return await self._scatter("scatter_mul", sparse_delta)

    @must_await
    async def scatter_div(self, sparse_delta: IndexedSlices) -> ShardedVariable:
        """Divide by the rows of ``sparse_delta`` (whole-variable rows)."""
        return await self._scatter("scatter_div", sparse_delta)

    @must_await
    async def scatter_min(self, sparse_delta: IndexedSlices) -> ShardedVariable:
        """The element-wise minimum with the rows of ``sparse_delta`` (whole-variable rows)."""
        return await self._scatter("scatter_min", sparse_delta)

    @must_await
    async def scatter_max(self, sparse_delta: IndexedSlices) -> ShardedVariable:
        """The element-wise maximum with the rows of ``sparse_delta`` (whole-variable rows)."""
        return await self._scatter("scatter_max", sparse_delta)

    @must_await
    async def batch_scatter_update(self, sparse_delta: IndexedSlices) -> ShardedVariable:
        """TF's ``batch_scatter_update``: :meth:`scatter_update` (an :class:`IndexedSlices`
        holds 1-D row ids, no batch dimensions)."""
        return await self._scatter("scatter_update", sparse_delta)


def compact_ids(ids: np.ndarray) -> np.ndarray:
    """Row ids as int32 when they fit (half the bytes on the wire), else unchanged."""
    if ids.dtype.itemsize > 4 and (ids.size == 0 or (int(ids.max()) < 2**31 and int(ids.min()) >= 0)):
        return ids.astype(np.int32)
    return ids


def _as_parts(params: Any) -> tuple[list[Variable], np.ndarray, str]:
    if isinstance(params, ShardedVariable):
        return params.variables, params.offsets, params.name
    if isinstance(params, Variable):
        return [params], np.array([0, params.shape[0] if params.shape else 0]), params.name
    if isinstance(params, (list, tuple)) and params and all(isinstance(v, Variable) for v in params):
        sizes = [v.shape[0] for v in params]
        return list(params), np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64), params[0].name
    raise InvalidArgumentError(
        "embedding_lookup takes a Variable, a list of Variables or a "
        f"ShardedVariable, got {type(params).__name__}"
    )


async def embedding_lookup(
    params: Any,
    ids: Any,
    max_norm: float | None = None,
    name: str | None = None,
    *,
    training: bool = True,
    with_gradient: bool = False,
) -> Any:
    """Rows ``ids`` of ``params``: shape ``ids.shape + params.shape[1:]`` (TF's
    ``tf.nn.embedding_lookup``; ``max_norm``: rows whose L2 norm is larger come back scaled
    down to it; ``name`` is TF's and unused).

    Ids are deduplicated first; each ps holding a needed part gets one request
    (all concurrently) carrying only the rows it must send. ``training=False``
    (evaluation, serving) changes nothing: a dynamic table admits no id and
    counts no sighting (fixed tables never change on a lookup). ``with_gradient=True``:
    ``(rows, gradient)``, ``gradient(upstream)`` the table's gradient as sparse rows
    (what TF's ``tape.gradient`` gives: ``optimizer.apply_gradients`` takes it).

    >>> table = Variable(np.arange(6.0).reshape(3, 2))
    >>> asyncio.run(embedding_lookup(table, [[2, 0]])).tolist()
    [[[4.0, 5.0], [0.0, 1.0]]]
    """
    check_gradient_params(params, with_gradient)
    rows = await _rows_of(params, ids, training)
    out = rows if max_norm is None else clip_by_norm(rows, max_norm, rows.ndim - np.ndim(ids))
    if not with_gradient:
        return out
    return out, LookupGradient(out.shape, rows, max_norm, functools.partial(_each_row, np.asarray(ids)))


def check_gradient_params(params: Any, with_gradient: bool) -> None:
    """A lookup's gradient is one table's rows: a list of tables (TF's partitioned
    ``params``) has none to give."""
    if with_gradient and isinstance(params, (list, tuple)):
        raise InvalidArgumentError(
            "with_gradient: the lookup's gradient is one table's rows; give a variable, a "
            "sharded variable or a dynamic table rather than a list of them"
        )


class LookupGradient:
    """The way back from a lookup's output to its table (``with_gradient=True``):
    ``gradient(upstream)``, with ``upstream`` the gradient of the loss by the output (its
    shape), is the table's gradient as sparse rows: what TF's ``tape.gradient(loss,
    table)`` gives, and what ``optimizer.apply_gradients([(gradient(upstream), table)])``
    takes, through ``max_norm``'s clipping too. ``backward`` takes ``upstream`` to the
    gradient by ``rows`` (the rows looked up, before clipping), as sparse rows in their
    order: for :func:`embedding_lookup`, each id's (an id looked up twice is in it twice,
    as in TF's; ``apply_gradients`` sums them); for a pooled lookup, the bags'."""

    __slots__ = ("shape", "rows", "max_norm", "backward")

    def __init__(
        self,
        shape: tuple[int, ...],
        rows: np.ndarray,
        max_norm: float | None,
        backward: Callable[[np.ndarray], IndexedSlices],
    ) -> None:
        self.shape, self.rows, self.max_norm, self.backward = shape, rows, max_norm, backward

    def __call__(self, upstream: Any) -> IndexedSlices:
        d = np.asarray(upstream)
        if d.shape != self.shape:
            raise InvalidArgumentError(
                f"the lookup's gradient takes the gradient of its output, of shape {self.shape}, "
                f"got {d.shape}"
            )
        grad = self.backward(d)
        if self.max_norm is None:
            return grad
        shape = grad.values.shape  # (a row's own shape after the first axis: a matrix too)
        n, width = shape[0], math.prod(shape[1:])
        rows = self.rows.reshape(n, width)
        back = clip_by_norm_backward(rows, grad.values.reshape(n, width), self.max_norm)
        return IndexedSlices(back.reshape(shape), grad.indices)


def _each_row(ids: np.ndarray, upstream: np.ndarray) -> IndexedSlices:
    """:func:`embedding_lookup`'s backward: each looked-up id's row of ``upstream``."""
    flat = ids.reshape(-1)  # (the row's own shape spelled out: no ids leave -1 unknowable)
    return IndexedSlices(upstream.reshape((flat.size, *upstream.shape[ids.ndim :])), flat)


def clip_by_norm(rows: np.ndarray, max_norm: float, row_ndim: int = 1) -> np.ndarray:
    """``rows`` (each its last ``row_ndim`` axes: a table's row) with each row whose L2 norm
    exceeds ``max_norm`` scaled down to it, as TF's lookups clip (over the whole row, a
    matrix too)."""
    if not max_norm > 0:
        raise InvalidArgumentError(f"max_norm must be a positive number, got {max_norm!r}")
    lead = rows.shape[: rows.ndim - row_ndim]
    flat = rows.reshape((*lead, math.prod(rows.shape[rows.ndim - row_ndim :])))
    norms = np.sqrt(np.einsum("...i,...i->...", flat, flat))
    factor = np.where(norms > max_norm, max_norm / np.where(norms > 0, norms, 1), 1)
    return (flat * factor[..., None].astype(rows.dtype)).reshape(rows.shape)


def clip_by_norm_backward(rows: np.ndarray, grad: np.ndarray, max_norm: float) -> np.ndarray:
    """The gradient by ``rows`` (each a row) of ``clip_by_norm(rows, max_norm)``, given its
    gradient ``grad``: unchanged where a row was not clipped; ``max_norm / n * (g - r
    (r.g) / n^2)`` where it was (its norm ``n`` past ``max_norm``), as TF differentiates
    ``clip_by_norm``."""
    r = rows.astype(np.float64)
    norms = np.sqrt(np.einsum("ij,ij->i", r, r))
    clipped = norms > max_norm
    out = grad.astype(np.float64, copy=True)
    if clipped.any():
        n, g, rc = norms[clipped, None], out[clipped], r[clipped]
        out[clipped] = max_norm / n * (g - rc * np.einsum("ij,ij->i", rc, g)[:, None] / (n * n))
    return out.astype(grad.dtype)


async def _rows_of(params: Any, ids: Any, training: bool) -> np.ndarray:
    if getattr(params, "dynamic_table", False):  # a DynamicEmbedding: rows by raw id
        rows: np.ndarray = await params.lookup(ids, training=training)
        return rows
    parts, offsets, name = _as_parts(params)
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu":
        raise InvalidArgumentError(f"embedding_lookup ids must be integers, got {ids.dtype}")
    total = int(offsets[-1])
    flat = ids.reshape(-1)
    if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= total):
        bad = flat[(flat < 0) | (flat >= total)][0]
        raise InvalidArgumentError(f"embedding_lookup on {name!r}: id {int(bad)} out of range [0, {total})")
    unique, inverse = distinct(flat, sorted=True)
    tail = parts[0].shape[1:]
    rows = np.empty((unique.size,) + tail, parts[0].dtype)
    part = np.searchsorted(offsets[1:], unique, side="right")
    local: list[tuple[int, np.ndarray]] = []
    placed: list[tuple[int, np.ndarray]] = []
    for p in np.unique(part):
        positions = np.nonzero(part == p)[0]
        v = parts[int(p)]
        (local if v.ps_index is None else placed).append((int(p), positions))
    for p, positions in local:
        rows[positions] = await parts[p].sparse_read(unique[positions] - offsets[p])
    if not placed:
        return rows[inverse].reshape(ids.shape + tail)
    await ensure_created(parts[p] for p, _ in placed)

    async def fetch(channel: Channel, group: list[tuple[int, np.ndarray]]) -> None:
        reads = [
            RowRead(name=parts[p].key, indices=compact_ids(unique[positions] - offsets[p]))
            for p, positions in group
        ]
        reply = await channel.request(SparseRead(reads=reads))
        for (_, positions), values in zip(group, reply.values):
            rows[positions] = values

    await routed(parts[placed[0][0]].channels(), placed, lambda g: parts[g[0]].channel(), fetch)
    if unique.size == flat.size and np.array_equal(unique, flat):  # distinct, ascending ids
        return rows.reshape(ids.shape + tail)
    return rows[inverse].reshape(ids.shape + tail)


def combine_gradients(grads_and_vars: Sequence[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """One gradient per variable: sparse gradients of the same table (a table looked up
    twice in one model) are concatenated, dense ones summed; the order of first sight is
    kept. The ps sums the rows of repeated ids.

    >>> v = Variable(np.zeros((4, 2)))
    >>> [(g, _)] = combine_gradients([(IndexedSlices(np.ones((1, 2)), [1]), v),
    ...                               (IndexedSlices(np.ones((2, 2)), [1, 3]), v)])
    >>> g.indices.tolist(), float(g.values.sum())
    ([1, 1, 3], 6.0)
    """
    merged: dict[int, list[Any]] = {}
    for grad, var in grads_and_vars:
        seen = merged.get(id(var))
        if seen is None:
            merged[id(var)] = [grad, var]
        elif isinstance(grad, IndexedSlices) and isinstance(seen[0], IndexedSlices):
            seen[0] = IndexedSlices(
                np.concatenate([seen[0].values, grad.values]),
                np.concatenate([seen[0].indices, grad.indices]),
                seen[0].dense_shape,
            )
        elif grad is None or seen[0] is None:
            seen[0] = grad if seen[0] is None else seen[0]
        else:
            seen[0] = _dense(seen[0], var) + _dense(grad, var)
    return [(g, v) for g, v in merged.values()]


def _dense(grad: Any, var: Any) -> np.ndarray:
    if not isinstance(grad, IndexedSlices):
        return np.asarray(grad)
    if var.shape is None or None in var.shape:
        raise InvalidArgumentError(
            f"a dense and a sparse gradient for {var.name!r}, a dynamic table: give it sparse gradients only"
        )
    out = np.zeros(var.shape, grad.values.dtype)
    np.add.at(out, grad.indices, grad.values)
    return out


expose(globals(), "pstrain", ["ShardedVariable", "embedding_lookup"])
