"""A collection of embedding tables, as a ranking model has: a table per feature (or one
table serving several features), each feature a bag of ids per example, pooled.

Each :class:`~pstrain.TableConfig` gives a table's rows, width, features, combiner, initializer and
(optionally) its own optimizer. :class:`EmbeddingCollection`, built in
``strategy.scope()``, places the tables with :func:`~pstrain._embeddings.planner.plan_tables`
(``collection.plan`` prints it) and creates them. Then each step:

* ``pooled = await collection.lookup(features, read=dense_variables)`` sends **one request
  per ps**: the rows every feature needs from every table there (ids deduplicated per
  table, across the features that share it), and the dense variables it holds, whole.
  Dynamic tables (``num_embeddings=None``) go in the same request (``dyn/lookup_many``).
* ``pooled.values[feature]`` is ``[batch, dim]``; ``pooled.concat()`` joins them in the
  collection's feature order; ``pooled.read`` are the dense variables' values.
* ``pooled.gradients(d)`` turns the gradient of the pooled output into one sparse
  gradient per table (rows of its distinct ids), and ``collection.apply_gradients``
  sends every table's and the dense variables' in **one request per ps** (one per
  optimizer, if tables have their own).

Pooling happens on the worker: ``benchmarks/pooling_placement.py`` measured it against
pooling on the ps (see docs/ranking-models.md).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .._base.context import must_await
from .._base.errors import InvalidArgumentError, ProtocolError
from .._base.exports import expose
from .._formats.messages.operations import LookupTables, PackedRows, RowRead, SparseRead, most_alike
from .._kernels.batches import take_rows
from .._training.module import Module
from .._training.optimizers import apply_together
from .._training.step_order import read_in_order
from .._variables.arrays import IndexedSlices, current_creator
from .._variables.batched import ensure_created
from .._variables.dynamic import DynamicEmbedding, TableLookups
from .._variables.placement import Placement
from .._variables.routing import routed
from .._variables.sharding import ShardedVariable, compact_ids
from .._variables.variables import Variable
from .config import TableConfig
from .jagged import JaggedTensor, KeyedJaggedTensor, features_by_name
from .planner import DEFAULT_SHARD_ROWS, TablePlan, plan_tables
from .pooling import Bags

logger = logging.getLogger("pstrain.embeddings")

__all__ = ["EmbeddingCollection", "GatheredRows", "PooledEmbeddings"]


class EmbeddingCollection(Module):
    """Many tables, each looked up by its features (see the module's docstring). Create it
    in ``strategy.scope()`` (outside one, its tables are local arrays: a model on one
    process, with nothing to send). ``shard_rows``: tables with more rows are row-sharded
    over every ps."""

    def __init__(
        self, tables: Sequence[TableConfig], *, shard_rows: int = DEFAULT_SHARD_ROWS, name: str = "embeddings"
    ) -> None:
        super().__init__(name)
        tables = list(tables)
        if not tables or not all(isinstance(t, TableConfig) for t in tables):
            raise InvalidArgumentError("EmbeddingCollection takes a non-empty list of TableConfig")
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            twice = next(n for i, n in enumerate(names) if n in names[:i])
            raise InvalidArgumentError(f"EmbeddingCollection: two tables are named {twice!r}")
        self.configs = {t.name: t for t in tables}
        #: Each table's own optimizer (``TableConfig(optimizer=...)``), by table name: what a
        #: checkpoint of the collection reaches them by, so it holds their slots and step
        #: counts with the tables (``<collection path>/optimizers/<table>``).
        self.optimizers = {t.name: t.optimizer for t in tables if t.optimizer is not None}
        #: feature -> the name of its table, in the collection's feature order
        self.feature_tables: dict[str, str] = {}
        for t in tables:
            for f in t.feature_names:
                if f in self.feature_tables:
                    raise InvalidArgumentError(
                        f"feature {f!r} looks up two tables: {self.feature_tables[f]!r} and {t.name!r}"
                    )
                self.feature_tables[f] = t.name
        placement = current_creator()
        on_ps = isinstance(placement, Placement) and placement.channels is not None
        active = list(placement.active) if on_ps else [0]  # type: ignore[union-attr]
        self.plan: TablePlan = plan_tables(tables, len(active), shard_rows)
        self.tables: dict[str, Variable | ShardedVariable | DynamicEmbedding] = {}
        for t in tables:
            self.tables[t.name] = self._create(t, placement if on_ps else None, active, name)
        if on_ps:
            logger.info("embedding tables placed:\n%s", self.plan)

    def _create(
        self, t: TableConfig, placement: Any, active: list[int], prefix: str
    ) -> Variable | ShardedVariable | DynamicEmbedding:
        key = f"{prefix}/{t.name}"
        if t.num_embeddings is None:
            if placement is None:
                raise InvalidArgumentError(
                    f"table {t.name!r} is dynamic (num_embeddings=None): "
                    "it lives on the ps; create the collection in "
                    "strategy.scope()"
                )
            return DynamicEmbedding(t.embedding_dim, t.dtype, name=key, initializer=t.initializer)
        shape = (t.num_embeddings, t.embedding_dim)
        if placement is None:
            return Variable(t.initializer(shape, t.dtype), name=key)
        where = [active[k] for k in self.plan[t.name].ps]
        return placement.create_row_sharded(t.initializer, key, shape, t.dtype, where)

    # -- what it holds -----------------------------------------------------------------------
    @property
    def feature_names(self) -> list[str]:
        """Every feature, in the order :meth:`PooledEmbeddings.concat` joins them."""
        return list(self.feature_tables)

    @property
    def output_dim(self) -> int:
        """The width of ``pooled.concat()``: the features' tables' widths, summed."""
        return sum(self.configs[t].embedding_dim for t in self.feature_tables.values())

    def __repr__(self) -> str:
        return (
            f"<pstrain.EmbeddingCollection {len(self.configs)} tables, {len(self.feature_tables)} features>"
        )

    # -- a step ------------------------------------------------------------------------------
    def _features_of(self, features: Any) -> dict[str, JaggedTensor]:
        given = features_by_name(features)
        missing = [f for f in self.feature_tables if f not in given]
        if missing:
            raise InvalidArgumentError(
                f"lookup: features {missing} are missing (the batch has {sorted(given)})"
            )
        sizes = {len(given[f]) for f in self.feature_tables}
        if len(sizes) != 1:
            raise InvalidArgumentError(f"lookup: the features have different batch sizes {sorted(sizes)}")
        return {f: given[f] for f in self.feature_tables}

    @must_await
    async def lookup(
        self,
        features: KeyedJaggedTensor | Mapping[str, Any],
        *,
        read: Iterable[Any] = (),
        training: bool = True,
    ) -> PooledEmbeddings:
        """Every feature's pooled rows for the batch ``features`` (a KeyedJaggedTensor or
        ``{feature: bags}``), and the variables ``read`` (whole), in one request per ps.
        ``training=False`` (evaluation, serving): dynamic tables admit no id."""
        gathered = await self.gather(features, read=read, training=training)
        batch = gathered.batch
        columns = self._columns()
        dtypes = {self.configs[t].dtype for t in self.feature_tables.values()}
        out = np.zeros((batch, self.output_dim), dtypes.pop() if len(dtypes) == 1 else np.float64)
        for name, (_, named_bags) in gathered.bags.items():
            for feature, b in named_bags:
                b.pool(gathered.rows[name], out, columns[feature])
        return PooledEmbeddings(self, out, columns, gathered.read, gathered.bags)

    @must_await
    async def gather(
        self,
        features: KeyedJaggedTensor | Mapping[str, Any],
        *,
        read: Iterable[Any] = (),
        training: bool = True,
    ) -> GatheredRows:
        """The distinct rows each table holds for the batch, unpooled (what a framework
        adapter pools itself), and the variables ``read``: one request per ps, as
        :meth:`lookup`."""
        feats = self._features_of(features)
        dense = list(read)
        for v in dense:
            if not isinstance(v, (Variable, ShardedVariable)):
                raise InvalidArgumentError(f"lookup(read=...) takes variables, got {type(v).__name__}")
        batch = len(next(iter(feats.values())))
        per_table: dict[str, tuple[np.ndarray, list[tuple[str, Bags]]]] = {}
        for name, config in self.configs.items():
            jaggeds = [feats[f] for f in config.feature_names]
            # ascending: each part's rows are one run, and the gradients go as sorted, unique
            # rows (which neither the optimizer nor the ps sorts again)
            unique, bags = Bags.sharing(jaggeds, config.combiner, config.dtype, batch)
            low, high = (int(unique[0]), int(unique[-1])) if unique.size else (0, 0)  # (ascending)
            if config.num_embeddings is not None and (low < 0 or high >= config.num_embeddings):
                bad = low if low < 0 else high
                feature = next(
                    f
                    for f, j in zip(config.feature_names, jaggeds)
                    if j.values.size and bool(np.any(j.values == bad))
                )
                raise InvalidArgumentError(
                    f"feature {feature!r}: id {bad} is out of range "
                    f"[0, {config.num_embeddings}) of table {name!r}"
                )
            per_table[name] = (unique, list(zip(config.feature_names, bags)))
        rows = {
            name: np.empty((u.size, self.configs[name].embedding_dim), self.configs[name].dtype)
            for name, (u, _) in per_table.items()
        }
        values: list[Any] = [None] * len(dense)
        if training:  # after this worker's previous step's update (step_order.py)
            await read_in_order()
        await self._gather(per_table, rows, dense, values, training)
        return GatheredRows(batch, rows, per_table, values, feats)

    def _columns(self) -> dict[str, int]:
        """The first column of each feature's pooled rows in ``pooled.concat()``."""
        columns, start = {}, 0
        for f, t in self.feature_tables.items():
            columns[f] = start
            start += self.configs[t].embedding_dim
        return columns

    async def _gather(
        self,
        per_table: dict[str, tuple[np.ndarray, list[tuple[str, Bags]]]],
        rows: dict[str, np.ndarray],
        dense: list[Any],
        values: list[Any],
        training: bool,
    ) -> None:
        # items: ("rows", table, part variable, first, end, offset) and ("whole", i, part, j)
        items: list[tuple[Any, ...]] = []
        dynamic = []
        for name, (unique, _) in per_table.items():
            table = self.tables[name]
            if isinstance(table, DynamicEmbedding):
                dynamic.append((name, table, unique))
                continue
            parts, offsets = _parts(table)
            bounds = np.searchsorted(unique, offsets) if len(parts) > 1 else [0, unique.size]
            for p, part in enumerate(parts):
                lo, hi = int(bounds[p]), int(bounds[p + 1])
                if hi > lo:
                    items.append(("rows", name, part, lo, hi, int(offsets[p])))
        for i, v in enumerate(dense):
            parts = v.variables if isinstance(v, ShardedVariable) else [v]
            values[i] = [None] * len(parts)
            for j, part in enumerate(parts):
                items.append(("whole", i, part, j))
        local: list[tuple[Any, ...]] = []
        placed: list[tuple[Any, ...]] = []
        for it in items:  # (ps_index reads the placement map: once an item)
            (local if it[2].ps_index is None else placed).append(it)
        for it in local:
            self._put(it, rows, values, _read_local(it, per_table))
        await ensure_created(it[2] for it in placed)
        # the dynamic tables' lookups go in the same request per ps as the other reads
        tables = TableLookups([(table, unique) for _, table, unique in dynamic], training)
        work: list[tuple[Any, ...]] = [("table", *x) for x in tables.items()] + placed

        def channel_of(it: tuple[Any, ...]) -> Any:
            return tables.channel_of(it[1:]) if it[0] == "table" else it[2].channel()

        def resplit(group: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
            return [
                y
                for it in group
                for y in ([("table", *x) for x in tables.resplit(it[1:])] if it[0] == "table" else [it])
            ]

        def ids_of(it: tuple[Any, ...]) -> np.ndarray:
            return compact_ids(per_table[it[1]][0][it[3] : it[4]] - it[5])

        async def fetch(channel: Any, group: list[tuple[Any, ...]]) -> None:
            looked = [it[1:] for it in group if it[0] == "table"]
            # the rows of the table parts alike (the most of them) go packed, unless with
            # dynamic tables' lookups (dyn/lookup_many takes reads one by one)
            rows_of_parts = [it for it in group if it[0] == "rows"]
            packed = [] if looked else most_alike(rows_of_parts, lambda it: (it[2].dtype, it[2].shape[1:]))
            chosen = {id(it) for it in packed}
            one_by_one = [it for it in group if it[0] != "table" and id(it) not in chosen]
            reads = [
                RowRead(name=it[2].key, indices=ids_of(it) if it[0] == "rows" else None) for it in one_by_one
            ]
            if looked:
                ps = looked[0][1]
                entries, merged = await tables.entries(ps, looked)
                reply = await tables.send(
                    channel,
                    ps,
                    LookupTables(lookups=entries, reads=reads or None, train=tables.training),
                    merged,
                )
                tables.put(merged, reply.values[: len(entries)])
                got = reply.values[len(entries) :]
            else:
                rows_packed = (
                    PackedRows.of([(it[2].key, ids_of(it), None) for it in packed]) if packed else None
                )
                got = (await channel.request(SparseRead(reads=reads or None, packed=rows_packed))).values
            if packed:
                total = sum(it[4] - it[3] for it in packed)
                rows_read, start = np.asarray(got[-1]) if got else np.zeros(0), 0
                if len(got) != len(reads) + 1 or rows_read.shape[:1] != (total,):
                    raise ProtocolError(
                        f"malformed reply to vars/sparse_read from {channel.task}: {len(got)} values "
                        f"for {len(reads)} reads and {total} packed rows"
                    )
                for it in packed:
                    self._put(it, rows, values, rows_read[start : start + it[4] - it[3]])
                    start += it[4] - it[3]
            for it, value in zip(one_by_one, got):
                self._put(it, rows, values, value)

        if work:
            await routed(
                placed[0][2].channels() if placed else tables.pool(), work, channel_of, fetch, resplit
            )
        for (name, _, _), table_rows in zip(dynamic, tables.out):
            rows[name][...] = table_rows
        for i, v in enumerate(dense):
            pieces = values[i]
            values[i] = np.concatenate(pieces, axis=0) if isinstance(v, ShardedVariable) else pieces[0]

    @staticmethod
    def _put(item: tuple[Any, ...], rows: dict[str, np.ndarray], values: list[Any], value: Any) -> None:
        if item[0] == "rows":
            mine = rows[item[1]]
            if (  # a table's rows from one part: the reply's array itself (a view of its body)
                item[3] == 0
                and item[4] == mine.shape[0]
                and isinstance(value, np.ndarray)
                and value.shape == mine.shape
                and value.dtype == mine.dtype
                and value.flags.writeable
                and value.flags.c_contiguous
            ):
                rows[item[1]] = value
            else:
                mine[item[3] : item[4]] = value
        else:
            values[item[1]][item[3]] = np.asarray(value)

    @must_await
    async def apply_gradients(self, grads_and_vars: Iterable[tuple[Any, Any]], optimizer: Any = None) -> None:
        """Apply the tables' gradients (``pooled.gradients(d)``) and any others: each table's
        with its own optimizer if its config names one, everything else with ``optimizer``,
        one request per ps for all of them (``apply_together``)."""
        groups: dict[int, tuple[Any, list[tuple[Any, Any]]]] = {}
        owners = {id(v): self.configs[name].optimizer for name, v in self.tables.items()}
        for pair in grads_and_vars:
            opt = owners.get(id(pair[1])) or optimizer
            if opt is None:
                raise InvalidArgumentError(
                    f"apply_gradients: no optimizer for "
                    f"{getattr(pair[1], 'name', pair[1])!r} (give one, or "
                    "one in its table's TableConfig)"
                )
            groups.setdefault(id(opt), (opt, []))[1].append(pair)
        await apply_together(list(groups.values()))


def _parts(table: Variable | ShardedVariable) -> tuple[list[Variable], np.ndarray]:
    if isinstance(table, ShardedVariable):
        return table.variables, table.offsets
    return [table], np.array([0, table.shape[0]], np.int64)


def _read_local(item: tuple[Any, ...], per_table: dict[str, Any]) -> np.ndarray:
    """What ``item`` reads, from a variable with no ps (a collection outside a strategy)."""
    part = item[2]
    if item[0] == "whole":
        return np.asarray(part.local_array()).copy()
    local = per_table[item[1]][0][item[3] : item[4]] - item[5]
    return take_rows(part.local_array(), np.asarray(local, np.int64))


class GatheredRows:
    """One step's rows before pooling: ``rows[table]`` are the rows of ``bags[table][0]``
    (its distinct ids, ascending); ``bags[table][1]`` pairs each of its features with its
    bags (each bag's rows among them, and each id's factor); ``read`` the dense variables' values;
    ``features`` the batch's features by name."""

    __slots__ = ("batch", "rows", "bags", "read", "features")

    def __init__(
        self,
        batch: int,
        rows: dict[str, np.ndarray],
        bags: dict[str, tuple[np.ndarray, list[tuple[str, Bags]]]],
        read: list[np.ndarray],
        features: dict[str, JaggedTensor],
    ) -> None:
        self.batch, self.rows, self.bags, self.read, self.features = batch, rows, bags, read, features


class PooledEmbeddings:
    """One step's pooled lookups: ``values[feature]`` (``[batch, dim]``), :meth:`concat`
    (them side by side), ``read`` (the dense variables asked for), and the way back
    (:meth:`gradients`)."""

    def __init__(
        self,
        collection: EmbeddingCollection,
        pooled: np.ndarray,
        columns: dict[str, int],
        read: list[np.ndarray],
        bags: dict[str, tuple[np.ndarray, list[tuple[str, Bags]]]],
    ) -> None:
        self.collection = collection
        self._pooled = pooled
        self._columns = columns
        self.read = read
        self._bags = bags

    @property
    def values(self) -> dict[str, np.ndarray]:
        """Each feature's pooled rows, ``[batch, dim]`` (views of :meth:`concat`)."""
        return {f: self._pooled[:, c : c + self._dim(f)] for f, c in self._columns.items()}

    def _dim(self, feature: str) -> int:
        return self.collection.configs[self.collection.feature_tables[feature]].embedding_dim

    def concat(self) -> np.ndarray:
        """``[batch, collection.output_dim]``: the features' pooled rows side by side, in
        the collection's feature order (no copy)."""
        return self._pooled

    def gradients(self, d_pooled: np.ndarray | Mapping[str, np.ndarray]) -> list[tuple[IndexedSlices, Any]]:
        """``[(gradient, table), ...]``, one per table: the gradient of its distinct rows
        from the gradient of the pooled output (``[batch, output_dim]`` as :meth:`concat`
        lays it out, or ``{feature: [batch, dim]}``)."""
        d = self._joined(d_pooled)
        out = []
        for name, (unique, bags) in self._bags.items():
            config = self.collection.configs[name]
            grad = np.zeros((unique.size, config.embedding_dim), config.dtype)
            for feature, b in bags:
                b.backward(d, grad, self._columns[feature], config.embedding_dim)
            out.append((IndexedSlices(grad, unique), self.collection.tables[name]))
        return out

    def _joined(self, d: np.ndarray | Mapping[str, np.ndarray]) -> np.ndarray:
        shape = self._pooled.shape
        if isinstance(d, Mapping):
            missing = [f for f in self._columns if f not in d]
            if missing:
                raise InvalidArgumentError(f"gradients: no gradient for features {missing}")
            joined = np.empty(shape, self._pooled.dtype)
            for f, c in self._columns.items():
                g = np.asarray(d[f])
                if g.shape != (shape[0], self._dim(f)):
                    raise InvalidArgumentError(
                        f"gradients: feature {f!r} has shape "
                        f"{[shape[0], self._dim(f)]}, its gradient {list(g.shape)}"
                    )
                joined[:, c : c + self._dim(f)] = g
            return joined
        arr = np.asarray(d)
        if arr.shape != shape:
            raise InvalidArgumentError(
                f"gradients: expected {list(shape)} (the shape of concat()), got {list(arr.shape)}"
            )
        return np.ascontiguousarray(arr, self._pooled.dtype)


expose(globals(), "pstrain")
