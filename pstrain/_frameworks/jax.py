"""JAX closures with automatic gradients, on variables that live on the ps.

Write a loss function over a pytree of parameters; never a gradient::

    import pstrain.jax as pjax

    def loss_fn(params, dense_x, y):            # plain JAX: params hold jax arrays
        x = jnp.concatenate([params["emb"].reshape(len(y), -1), dense_x], axis=1)
        z = jax.nn.relu(x @ params["w1"] + params["b1"]) @ params["w2"]
        return optax_style_log_loss(z, y)

    grad_fn = pjax.value_and_grad(loss_fn)

    async def step(iterator):                   # scheduled on a worker
        ids, dense_x, y = next(iterator)
        params = {"emb": pjax.lookup(model.table, ids), "w1": model.w1, ...}
        loss, grads = await grad_fn(params, dense_x, y)
        await optimizer.apply_gradients(grads)
        return loss

* A leaf that is a pstrain ``Variable`` or ``ShardedVariable`` is read whole:
  every such leaf in one request per ps.
* A leaf ``lookup(table, ids)`` is an embedding lookup: the batch's ids are
  deduplicated, only those rows are gathered from the table's shards, and
  the loss sees an array of shape ``ids.shape + (dim,)``. Its gradient goes
  back as :class:`~pstrain.IndexedSlices` over the unique ids (duplicate ids
  summed by the differentiation itself): only looked-up rows travel, both ways.
* The gradient function is ``jax.jit(jax.value_and_grad(...))``, compiled once
  per worker process and input shapes, and reused by every later closure. The
  unique rows are padded to the batch's id count, so the shapes (and the
  compiled code) do not change from batch to batch.
* A leaf ``pooled_lookup(table, bags, combiner)`` is a pooled (multi-hot) lookup: the
  loss sees ``[bags, dim]``; the rows and ids it is computed from are padded to powers of
  two, so bags of new lengths do not compile anew for every batch.
* The result is ``(loss, grads_and_vars)`` (``((loss, aux), ...)`` with
  ``has_aux=True``), ready for ``await optimizer.apply_gradients(grads)``.

:func:`variables_from` turns a pytree of arrays (an equinox or flax model's
parameters, say) into the same pytree of pstrain variables, inside
``strategy.scope()``, named by their paths.

Needs the ``jax`` extra: ``pip install 'pstrain[jax]'``.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from .._base.exports import expose

try:
    import jax
    import jax.numpy as jnp
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError("pstrain.jax needs JAX: pip install 'pstrain[jax]'") from exc

from .._base.errors import InvalidArgumentError
from .._embeddings.jagged import as_jagged
from .._embeddings.pooling import Bags
from .._kernels.batches import distinct
from .._variables.arrays import IndexedSlices, VariableBase
from .._variables.batched import read_variables
from .._variables.dynamic import DynamicEmbedding
from .._variables.sharding import ShardedVariable, combine_gradients, embedding_lookup
from .._variables.variables import Variable

__all__ = [
    "Lookup",
    "PooledLookup",
    "ValueAndGrad",
    "lookup",
    "pooled_lookup",
    "value_and_grad",
    "variables_from",
]


class Lookup:
    """Rows ``ids`` of ``table`` as a leaf of a parameter tree (see :func:`lookup`)."""

    __slots__ = ("table", "ids", "training")

    def __init__(
        self, table: Variable | ShardedVariable | DynamicEmbedding, ids: Any, training: bool = True
    ) -> None:
        if not (
            isinstance(table, DynamicEmbedding)
            or (isinstance(table, (Variable, ShardedVariable)) and len(table.shape) == 2)
        ):
            raise InvalidArgumentError(
                "lookup() needs a 2-D pstrain variable or a DynamicEmbedding (an embedding table)"
            )
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise InvalidArgumentError(f"lookup ids must be integers, got {ids.dtype}")
        self.table = table
        self.ids = ids
        self.training = bool(training)

    def __repr__(self) -> str:
        return f"lookup({self.table.name!r}, ids of shape {self.ids.shape})"


def lookup(
    table: Variable | ShardedVariable | DynamicEmbedding, ids: Any, *, training: bool = True
) -> Lookup:
    """A parameter-tree leaf that the loss sees as ``table[ids]`` (shape ``ids.shape + (dim,)``).

    ``training=False`` (evaluation, serving): a dynamic table admits no id and counts no
    sighting. A table looked up by several leaves gets one combined gradient."""
    return Lookup(table, ids, training)


class PooledLookup:
    """Each bag of ``bags`` pooled from ``table``'s rows, as a leaf (see :func:`pooled_lookup`)."""

    __slots__ = ("table", "bags", "training")

    def __init__(
        self,
        table: Variable | ShardedVariable | DynamicEmbedding,
        ids: Any,
        combiner: str = "sum",
        weights: Any = None,
        training: bool = True,
    ) -> None:
        if not (
            isinstance(table, DynamicEmbedding)
            or (isinstance(table, (Variable, ShardedVariable)) and len(table.shape) == 2)
        ):
            raise InvalidArgumentError(
                "pooled_lookup() needs a 2-D pstrain variable or a DynamicEmbedding (an embedding table)"
            )
        self.table = table
        self.bags = Bags(as_jagged(ids, weights, "pooled_lookup ids"), combiner, np.float32)
        self.training = bool(training)

    def __repr__(self) -> str:
        return f"pooled_lookup({self.table.name!r}, {self.bags.n} bags)"


def pooled_lookup(
    table: Variable | ShardedVariable | DynamicEmbedding,
    ids: Any,
    combiner: str = "sum",
    weights: Any = None,
    *,
    training: bool = True,
) -> PooledLookup:
    """A parameter-tree leaf that the loss sees as ``[bags, dim]``: each bag of ``ids`` (a
    :class:`~pstrain.JaggedTensor`, a SparseTensor, a list of lists ...) pooled from
    ``table``'s rows by ``combiner`` (``"sum"``, ``"mean"``, ``"sqrtn"``, TF's), with
    ``weights`` per id or None. Only the bags' distinct rows are gathered; their gradient
    goes back as IndexedSlices. The arrays the compiled function sees are padded to powers
    of two, so bags of new lengths reuse it (a compilation per size class, not per batch)."""
    return PooledLookup(table, ids, combiner, weights, training)


def _bucket(n: int) -> int:
    """The padded size of ``n`` rows or ids: the next power of two, at least 8."""
    return max(8, 1 << max(0, int(n) - 1).bit_length())


def _is_leaf(x: Any) -> bool:
    return isinstance(x, (VariableBase, Lookup, PooledLookup))


class ValueAndGrad:
    """``jax.value_and_grad(loss_fn)`` over pstrain variables; see the module's docstring."""

    def __init__(self, loss_fn: Callable[..., Any], has_aux: bool = False) -> None:
        if not callable(loss_fn):
            raise InvalidArgumentError("value_and_grad needs a loss function")
        self.loss_fn = loss_fn
        self.has_aux = has_aux
        self._compiled: dict[Any, Callable[..., Any]] = {}
        self.compilations = 0  # traces (compilations) in this process

    def _function(self, treedef: Any, kinds: tuple[str, ...]) -> Callable[..., Any]:
        key = (treedef, kinds)
        fn = self._compiled.get(key)
        if fn is None:
            loss_fn = self.loss_fn

            def loss(
                dense: list[Any],
                rows: list[Any],
                pooled_rows: list[Any],
                inverses: list[Any],
                pooled_index: list[Any],
                *args: Any,
            ) -> Any:
                self.compilations += 1  # Python runs here only while jax traces (compiles)
                dense_it, rows_it = iter(dense), iter(zip(rows, inverses))
                pooled_it = iter(zip(pooled_rows, pooled_index))
                leaves = []
                for kind in kinds:
                    if kind == "v":
                        leaves.append(next(dense_it))
                    elif kind == "l":
                        r, inv = next(rows_it)
                        leaves.append(jnp.take(r, inv, axis=0))
                    else:  # padding ids have a scale of 0: they add nothing, and get nothing
                        r, (inv, seg, scale, bags) = next(pooled_it)
                        n = bags.shape[0]  # (a batch of no bags sums into one, cut off: the way
                        # back gathers from the sums, which JAX cannot do from none)
                        summed = jax.ops.segment_sum(
                            jnp.take(r, inv, axis=0) * scale[:, None], seg, num_segments=max(n, 1)
                        )
                        leaves.append(summed[:n])
                return loss_fn(jax.tree_util.tree_unflatten(treedef, leaves), *args)

            fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=self.has_aux))
            self._compiled[key] = fn
        return fn

    async def __call__(self, params: Any, *args: Any) -> tuple[Any, list[tuple[Any, Any]]]:
        leaves, treedef = jax.tree_util.tree_flatten(params, is_leaf=_is_leaf)
        variables = [x for x in leaves if isinstance(x, VariableBase)]
        lookups = [x for x in leaves if isinstance(x, Lookup)]
        pools = [x for x in leaves if isinstance(x, PooledLookup)]
        if len(variables) + len(lookups) + len(pools) != len(leaves):
            bad = next(x for x in leaves if not _is_leaf(x))
            raise InvalidArgumentError(
                f"value_and_grad: a parameter leaf is a {type(bad).__name__}; "
                "leaves must be pstrain variables or lookup(table, ids)"
            )
        uniques = [distinct(np.asarray(lk.ids).reshape(-1), sorted=True) for lk in lookups]
        dense, *gathered = await asyncio.gather(
            read_variables(variables),
            *(embedding_lookup(lk.table, u, training=lk.training) for lk, (u, _) in zip(lookups, uniques)),
            *(embedding_lookup(p.table, p.bags.unique, training=p.training) for p in pools),
        )
        pool_rows_got = gathered[len(lookups) :]
        gathered = gathered[: len(lookups)]
        pooled_rows, pooled_index = [], []
        for p, got in zip(pools, pool_rows_got):
            b = p.bags
            padded = np.zeros((_bucket(b.unique.size), p.table.shape[1]), np.float32)
            padded[: b.unique.size] = got
            n = _bucket(b.inverse.size)
            inv, seg, scale = np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, np.float32)
            inv[: b.inverse.size], seg[: b.inverse.size], scale[: b.inverse.size] = (
                b.inverse,
                b.segments,
                b.scale,
            )
            pooled_rows.append(padded)
            pooled_index.append((inv, seg, scale, np.zeros(b.n, np.int8)))
        rows = []
        for lk, (u, _), got in zip(lookups, uniques, gathered):
            padded = np.zeros((max(lk.ids.size, 1), lk.table.shape[1]), got.dtype)
            padded[: u.size] = got  # a fixed shape: compiled once whatever the batch's duplicates
            rows.append(padded)
        inverses = [inv.reshape(lk.ids.shape).astype(np.int32) for lk, (_, inv) in zip(lookups, uniques)]
        kinds = tuple(
            "v" if isinstance(x, VariableBase) else "l" if isinstance(x, Lookup) else "p" for x in leaves
        )
        fn = self._function(treedef, kinds)
        value, (g_dense, g_rows, g_pooled) = fn(dense, rows, pooled_rows, inverses, pooled_index, *args)
        grads: list[tuple[Any, Any]] = [(np.asarray(g), v) for g, v in zip(g_dense, variables)]
        for lk, (u, _), g in zip(lookups, uniques, g_rows):
            grads.append((IndexedSlices(np.asarray(g)[: u.size], u), lk.table))
        for p, g in zip(pools, g_pooled):
            u = p.bags.unique
            grads.append((IndexedSlices(np.asarray(g)[: u.size], u), p.table))
        grads = combine_gradients(grads)  # a table looked up twice: one gradient
        if self.has_aux:
            loss, aux = value
            return (float(loss), jax.tree_util.tree_map(np.asarray, aux)), grads
        return float(value), grads


#: One compiled gradient function per loss function and process (closures reuse it).
_CACHE: weakref.WeakKeyDictionary[Callable[..., Any], dict[bool, ValueAndGrad]] = weakref.WeakKeyDictionary()


def value_and_grad(loss_fn: Callable[..., Any], has_aux: bool = False) -> ValueAndGrad:
    """The value-and-gradient function of ``loss_fn(params, *args)`` over pstrain variables;
    the same object for the same ``loss_fn`` in a process, so its compilation is reused."""
    try:
        per_fn = _CACHE.setdefault(loss_fn, {})
    except TypeError:  # not weak-referenceable: no cache
        return ValueAndGrad(loss_fn, has_aux)
    found = per_fn.get(has_aux)
    if found is None:
        found = per_fn[has_aux] = ValueAndGrad(loss_fn, has_aux)
    return found


def variables_from(tree: Any, name: str = "params", trainable: bool = True) -> Any:
    """The pytree ``tree`` with each array leaf replaced by a pstrain ``Variable`` holding it
    (call inside ``strategy.scope()`` to place them on the ps), named ``name/<path>``."""

    def make(path: Any, leaf: Any) -> Any:
        if leaf is None:
            return None
        key = jax.tree_util.keystr(path, simple=True, separator="/")
        return Variable(np.asarray(leaf), name=f"{name}/{key}" if key else name, trainable=trainable)

    return jax.tree_util.tree_map_with_path(make, tree)


expose(globals(), "pstrain.jax")
