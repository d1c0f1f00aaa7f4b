"""Dynamic embedding tables: rows keyed by raw int64 ids, created when ids are admitted.

A :class:`DynamicEmbedding` is made in ``strategy.scope()``; each ps holds the
ids that hash to it (:func:`~pstrain._formats.numerics.idhash.shard_of`), with their rows and
optimizer slots (``server/ps/tables/dynamic_table.py`` says what a shard does).
In a closure, or on the coordinator::

    with strategy.scope():
        table = pstrain.DynamicEmbedding(16, name="user", capacity=1_000_000, admit_after=2)
    rows = await pstrain.embedding_lookup(table, ids)           # any int64 ids
    await optimizer.apply_gradients([(pstrain.IndexedSlices(g, ids), table)])

A shard is created on its ps at its first use (the configuration travels with
the table, so a worker's first lookup creates it as well as the
coordinator's). The capacity counts rows in all: it is split between the ``n`` ps
in shares that add up to it exactly (``capacity // n``, one more on the first
``capacity % n``). A table created once the ps in the job are not the first ``n``
(an elastic ps left or joined) is cut into slices from the start, spread over the ps in
the job (``first_slices``), with the capacity shared by the slices each holds.
Checkpoints (:class:`~pstrain.Checkpoint`) save ids, rows and slots; a restore re-routes
them to any number of ps.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from .._base.context import current_channels
from .._base.errors import InvalidArgumentError, NotFoundError
from .._base.exports import expose, internal
from .._formats.messages.checkpoint_operations import RestoreTable
from .._formats.messages.operations import (
    CreateTable,
    ExportTable,
    LookupTable,
    LookupTables,
    TableIds,
    TableStatistics,
)
from .._formats.messages.placement_map import SliceSet, TableSlices, first_slices
from .._formats.messages.records import Operation, R, TableSpec, validate
from .._formats.numerics.idhash import shard_of
from .._formats.numerics.initializers import Constant, Initializer, RandomUniform, Zeros
from .._kernels import FLOAT_DTYPES
from .._kernels.batches import distinct, merge_duplicates
from .._transport.channels import Channel, ChannelPool
from .arrays import current_creator
from .placement import Placement
from .routing import routed
from .staged_restore import new_stage, restore_staged

__all__ = ["DynamicEmbedding", "TableLookups"]


#: What a tiered table's shard reports besides an untiered one's (summed over the ps).
TIERED_STATISTICS = (
    "hot_rows",
    "cold_rows",
    "disk_bytes",
    "looked_up",
    "promoted",
    "made_back",
    "read_through",
    "demoted",
    "compacted",
    "cold_reads",
    "cold_rows_read",
    "cold_rows_from_page_cache",
    "refused",
    "sightings_shed",
)


class DynamicEmbedding:
    """A table of ``dim``-wide rows keyed by int64 ids over the whole 64-bit space.

    ``initializer``: ``RandomUniform(minval, maxval, seed)`` (default ±0.05), ``Zeros`` or
    ``Constant``: a row's initial value is a function of its id and the seed alone.
    ``admit_after=N``: an id gets a row at its N-th training lookup; ``admit_probability=p``:
    at each training lookup with probability p (decided by a hash of the id and its
    sightings). Until admitted, lookups return ``default_value`` and gradients are dropped.
    ``capacity`` (rows in all) with ``eviction="lru"`` or ``"lfu"``; ``max_age=T``: rows
    not looked up in training for T of their shard's training lookups are evicted.
    """

    dynamic_table = True  # what embedding_lookup and the adapters recognise

    def __init__(
        self,
        dim: int,
        dtype: Any = "float32",
        *,
        name: str | None = None,
        initializer: Initializer | None = None,
        default_value: float = 0.0,
        capacity: int | None = None,
        eviction: str = "lru",
        max_age: int | None = None,
        admit_after: int | None = None,
        admit_probability: float | None = None,
    ) -> None:
        placement = current_creator()
        if not isinstance(placement, Placement) or placement.channels is None:
            raise InvalidArgumentError(
                "a DynamicEmbedding lives on the ps: create it in "
                "strategy.scope() of a ParameterServerStrategy, on the "
                "coordinator"
            )
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise InvalidArgumentError(f"DynamicEmbedding dim must be a positive integer, got {dim!r}")
        init = initializer if initializer is not None else RandomUniform()
        if isinstance(init, RandomUniform):
            low, high, seed = init.minval, init.maxval, init.seed or 0
        elif isinstance(init, Zeros):
            low = high = 0.0
            seed = 0
        elif isinstance(init, Constant):
            low = high = float(init.value)
            seed = 0
        else:
            raise InvalidArgumentError(
                f"a DynamicEmbedding's initializer is RandomUniform, Zeros or Constant (a row's "
                f"value must follow from its id alone), got {type(init).__name__}"
            )
        num_ps = placement.num_ps
        # Where its slices are from the start, if the ps in the job are not the first
        # ``num_ps`` (one left, or one joined); else None: shard ``p`` on ps ``p``.
        birth = None
        if sorted(placement.active) != list(range(num_ps)):
            birth = first_slices(num_ps, sorted(placement.active))
        spread = num_ps if birth is None else len(set(birth.owners))
        if capacity is not None and (
            isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < spread
        ):
            raise InvalidArgumentError(
                f"DynamicEmbedding capacity must be a whole number of rows, at least the {spread} "
                f"ps it is sharded over (each holds a share), got {capacity!r}"
            )
        if eviction not in ("lru", "lfu"):  # "evict" on the wire: named here as the user wrote it
            raise InvalidArgumentError(f"DynamicEmbedding eviction must be 'lru' or 'lfu', got {eviction!r}")
        if name is not None and (not isinstance(name, str) or not name.strip("/")):
            raise InvalidArgumentError(f"a DynamicEmbedding's name must be a non-empty string, got {name!r}")
        self.dim = dim
        self.dtype = np.dtype(dtype)
        self.num_ps = num_ps
        self.capacity = capacity
        self.owner = placement.owner
        #: Its slices from the start (None: shard ``p`` on ps ``p``); the placement map's
        #: once any moved.
        self.birth: TableSlices | None = birth
        self.config: dict[str, Any] = {
            "dim": dim,
            "dtype": self.dtype.name,
            "seed": int(seed),
            "init_low": low,
            "init_high": high,
            "default_value": float(default_value),
            "evict": eviction,
            "capacity": capacity,
            "max_age": max_age,
            "admit_after": admit_after,
            "admit_probability": admit_probability,
        }
        validate("DynamicEmbedding", TableSpec, self.shard_config(0))
        if admit_after is not None and admit_probability is not None:
            raise InvalidArgumentError("give admit_after or admit_probability, not both")
        if low > high:
            raise InvalidArgumentError(f"the initializer's minval {low} is above its maxval {high}")
        if self.dtype not in FLOAT_DTYPES:  # what the ps's table kernels take
            raise InvalidArgumentError(
                f"a DynamicEmbedding's dtype must be float32 or float64, got {self.dtype}"
            )
        #: The coordinator's channels (None in a closure: the closure's own).
        self.pool: ChannelPool | None = placement.channels
        #: ``(id(loop), ps)`` where this handle has sent the shard's creation.
        self.created_on: set[tuple[int, int]] = set()
        # Named once nothing can be refused, as variables are: ``name``, then ``name_1`` ...
        # (two tables of one name would otherwise be one table on the ps).
        self.name = placement.unique_name(name or "dynamic_embedding")
        self.key = placement.namespace + self.name
        placement.tables[self.key] = self

    @property
    def shape(self) -> tuple[None, int]:
        """``(None, dim)``: any number of rows, ``dim`` wide."""
        return (None, self.dim)

    @internal
    def shard_config(self, ps: int) -> dict[str, Any]:
        """The configuration of the shard on ps ``ps``: its share of the capacity."""
        config = {k: v for k, v in self.config.items() if v is not None}
        if self.capacity is not None:
            share, extra = divmod(self.capacity, self.num_ps)
            config["capacity"] = share + (1 if ps < extra else 0)
        return config

    @internal
    def slice_spec(self, sliced: TableSlices, ps: int) -> TableSpec:
        """The configuration of the shard on ps ``ps`` when the table is in ``sliced``: the
        capacity of the slices it holds."""
        config = {**self.shard_config(0), "capacity": self.capacity_shares(sliced).get(ps)}
        return TableSpec(**{k: v for k, v in config.items() if v is not None})

    # -- transport -------------------------------------------------------------------------
    def _pool(self) -> ChannelPool:
        return self.pool if self.pool is not None else current_channels()

    @internal
    def channel(self, ps: int) -> Channel:
        """The channel to the ps holding shard ``ps`` (for pstrain's own use and tests)."""
        return self._pool().channel("ps", ps)

    @internal
    def slices(self) -> TableSlices | None:
        """Which ps holds each slice of the table's hash space, if part of it moved (an
        elastic ps joined or left); None: shard ``p`` of ``num_ps`` is on ps ``p``."""
        return self._pool().session.routes.tables.get(self.key) or self.birth

    @internal
    def holders(self) -> list[int]:
        """The ps holding part of the table now."""
        sliced = self.slices()
        return sorted(set(sliced.owners)) if sliced is not None else list(range(self.num_ps))

    @internal
    def capacity_shares(self, sliced: TableSlices) -> dict[int, int | None]:
        """Each holder's share of the capacity, by the slices it holds (adding up to it)."""
        held = {ps: len(sliced.held_by(ps)) for ps in sorted(set(sliced.owners))}
        if self.capacity is None:
            return dict.fromkeys(held)
        shares = {ps: self.capacity * n // sliced.slices for ps, n in held.items()}
        for ps in sorted(held, key=lambda p: -held[p])[: self.capacity - sum(shares.values())]:
            shares[ps] += 1
        return {ps: max(1, n) for ps, n in shares.items()}

    async def _create(self, ps: int) -> None:
        if self.birth is not None:  # sliced from the start: the slices ps ``ps`` holds now
            sliced = self.slices()
            assert sliced is not None
            if held := sliced.held_by(ps):
                await self.channel(ps).request(
                    CreateTable(
                        name=self.key,
                        config=self.slice_spec(sliced, ps),
                        owner=self.owner,
                        owned=SliceSet(slices=sliced.slices, owned=held),
                    )
                )
        elif ps < self.num_ps:  # else a ps that joined: the table's slices arrive by a move
            await self.channel(ps).request(
                CreateTable(
                    name=self.key,
                    config=TableSpec(**self.shard_config(ps)),
                    owner=self.owner,
                    shard=ps,
                    num_shards=self.num_ps,
                )
            )
        self.created_on.add((id(asyncio.get_running_loop()), ps))

    @internal
    async def shard_ready(self, ps: int) -> None:
        """Create shard ``ps`` if this loop has not yet (before an update that needs it)."""
        if (id(asyncio.get_running_loop()), ps) not in self.created_on:
            await self._create(ps)

    async def _request(self, ps: int, message: Operation[R]) -> R:
        """``message`` to shard ``ps``, creating the shard first where it does not exist yet."""
        if (id(asyncio.get_running_loop()), ps) not in self.created_on:
            await self._create(ps)
        try:
            return await self.channel(ps).request(message)
        except NotFoundError as exc:
            if "dynamic table" not in str(exc):
                raise
            await self._create(ps)
            return await self.channel(ps).request(message)

    @internal
    def route(self, ids: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """``(ps, positions)`` of the ids (1-D) each ps holds."""
        sliced = self.slices()
        if sliced is not None:
            owners = np.asarray(sliced.owners, np.int64)[shard_of(ids, sliced.slices)]
            routed = [(p, np.flatnonzero(owners == p)) for p in sorted(set(sliced.owners))]
        elif self.num_ps == 1:
            return [(0, np.arange(ids.size))] if ids.size else []
        else:
            shards = shard_of(ids, self.num_ps)
            routed = [(p, np.flatnonzero(shards == p)) for p in range(self.num_ps)]  # no sort
        return [(p, pos) for p, pos in routed if pos.size]

    async def _routed(self, ids: np.ndarray, send: Any) -> None:
        """``await send(ps, positions)`` for the ids each ps holds, concurrently, through
        :func:`~pstrain._variables.routing.routed`: ids a ps refused because slices of the
        table moved, or held by a ps that left, are routed again by the newer map."""

        def resplit(group: list[tuple[int, np.ndarray]]) -> list[tuple[int, np.ndarray]]:
            return [(p, pos[sub]) for _, pos in group for p, sub in self.route(ids[pos])]

        async def each(_: Channel, group: list[tuple[int, np.ndarray]]) -> None:
            positions = group[0][1] if len(group) == 1 else np.sort(np.concatenate([p for _, p in group]))
            await send(group[0][0], positions)

        await routed(self._pool(), self.route(ids), lambda item: self.channel(item[0]), each, resplit)

    # -- the API -----------------------------------------------------------------------------
    async def lookup(self, ids: Any, training: bool = True) -> np.ndarray:
        """Rows of ``ids`` (any shape of integers): ``ids.shape + (dim,)``.

        ``training=True`` admits ids (creating rows) and counts them for eviction;
        ``training=False`` (evaluation, serving) changes nothing."""
        flat = _ids(ids, f"lookup of {self.name!r}")
        unique, inverse = distinct(flat)  # in the order of first sight: no sort
        rows = np.empty((unique.size, self.dim), self.dtype)

        async def fetch(ps: int, positions: np.ndarray) -> None:
            reply = await self._request(
                ps, LookupTable(name=self.key, ids=unique[positions], train=bool(training))
            )
            rows[positions] = reply.values[0]

        await self._routed(unique, fetch)
        if unique.size != flat.size:  # else no id repeats: the rows are in the ids' order
            rows = rows[inverse.reshape(-1)]
        return rows.reshape(np.shape(ids) + (self.dim,))

    @internal
    def gradient_groups(self, ids: Any, values: Any) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """``(ps, unique ids, summed values)`` of a sparse gradient, per ps."""
        flat = _ids(ids, f"gradient of {self.name!r}")
        vals = np.asarray(values, self.dtype)
        if vals.shape != np.shape(ids) + (self.dim,):
            raise InvalidArgumentError(
                f"the gradient of dynamic table {self.name!r} has values of shape {vals.shape} "
                f"for ids of shape {np.shape(ids)}: expected {np.shape(ids) + (self.dim,)}"
            )
        vals = vals.reshape(flat.size, self.dim)
        unique, summed = merge_duplicates(flat, vals, sorted=False)
        return [(ps, unique[pos], summed[pos]) for ps, pos in self.route(unique)]

    async def ensure_created(self) -> None:
        """Create the table's shard on every ps that holds part of it now, where this loop
        has not yet (otherwise: at its first use)."""
        await asyncio.gather(*(self.shard_ready(ps) for ps in self.holders()))

    async def statistics(self) -> dict[str, int]:
        """Rows held, admitted, evicted and bytes (in RAM), summed over the ps; on ps that
        tier their tables (``--memory-budget``, ``--table-dir``) also the rows in RAM
        (``hot_rows``) and on disk (``cold_rows``), ``disk_bytes``, the ids of training
        lookups (``looked_up``), rows brought back from disk (``promoted``; ``made_back`` of
        them made again rather than read: rows not changed since the table made them), read
        from it for lookups that do not train and left there (``read_through``) and moved to
        it (``demoted``), reads from disk (``cold_reads``), refusals (``refused``) and the
        times ``admit_after``'s sightings were forgotten for the budget (``sightings_shed``)."""
        parts = await asyncio.gather(
            *(self._request(ps, TableStatistics(name=self.key)) for ps in self.holders())
        )
        keys = ["rows", "admitted", "evicted", "bytes"]
        keys += [k for k in TIERED_STATISTICS if any(k in p for p in parts)]
        return {k: sum(int(p.get(k, 0)) for p in parts) for k in keys}

    async def size(self) -> int:
        """Rows held now, in all."""
        return (await self.statistics())["rows"]

    async def export(self) -> tuple[np.ndarray, np.ndarray]:
        """Every id and its row (ids ascending), for serving or inspection."""
        parts = await asyncio.gather(
            *(self._request(ps, ExportTable(name=self.key)) for ps in self.holders())
        )
        ids = np.concatenate([np.asarray(p["ids"], np.int64) for p in parts])
        rows = np.concatenate([np.asarray(p["rows"]).reshape(-1, self.dim) for p in parts])
        order = np.argsort(ids, kind="stable")
        return ids[order], rows[order].astype(self.dtype, copy=False)

    @classmethod
    @internal
    def handle(
        cls,
        name: str,
        key: str,
        dim: int,
        dtype: str,
        num_ps: int,
        capacity: int | None,
        owner: str,
        config: dict[str, Any],
        birth: TableSlices | None = None,
    ) -> DynamicEmbedding:
        """A table handle inside a closure (unpickled): it reaches the ps through the
        closure's channels."""
        table = cls.__new__(cls)
        table.name, table.key, table.dim, table.dtype = name, key, dim, np.dtype(dtype)
        table.num_ps, table.capacity, table.owner, table.config = num_ps, capacity, owner, config
        table.birth = birth
        table.pool = None
        table.created_on = set()
        return table

    @internal
    async def restore_from(
        self,
        files: list[str],
        slots: dict[str, str] | None = None,
        deltas: list[list[tuple[str, str]]] | None = None,
    ) -> int:
        """Replace every shard with the rows saved in ``files`` (all shards of one save, from
        any number of ps), then each delta of ``deltas`` (``(file, key prefix)`` pairs) in
        order: each ps keeps the ids that hash to it now. ``slots``: saved slot key -> this
        table's slot key (``<optimizer name>/<slot>``). All or nothing: every shard is read
        and checked before any is replaced, and the capacity is shared as a total
        (``staged_restore.py``). Returns rows restored."""
        stage = new_stage()
        requests, shares = self.restore_requests(files, slots, deltas, stage)
        replies = await restore_staged({}, [(self, requests, shares)], stage)
        self.restored_on(requests)
        return sum(int(r.restored or 0) for r in replies.values())

    @internal
    def restore_requests(
        self,
        files: list[str],
        slots: dict[str, str] | None,
        deltas: list[list[tuple[str, str]]] | None,
        stage: str,
    ) -> tuple[dict[int, RestoreTable], dict[int, int | None]]:
        """The ``dyn/restore`` each holder stages as ``stage``, and each one's share of the
        capacity now (``staged_restore.restore_staged`` takes both)."""
        sliced = self.slices()
        requests, shares = {}, {}
        for ps in self.holders():
            if sliced is None:
                config = TableSpec(**self.shard_config(ps))
                requests[ps] = RestoreTable(
                    name=self.key,
                    config=config,
                    owner=self.owner,
                    paths=files,
                    shard=ps,
                    num_shards=self.num_ps,
                    slots=slots,
                    deltas=[list(d) for d in deltas or []],
                    stage=stage,
                )
            else:
                config = self.slice_spec(sliced, ps)
                requests[ps] = RestoreTable(
                    name=self.key,
                    config=config,
                    owner=self.owner,
                    paths=files,
                    shard=0,
                    num_shards=1,
                    slots=slots,
                    deltas=[list(d) for d in deltas or []],
                    owned=SliceSet(slices=sliced.slices, owned=sliced.held_by(ps)),
                    stage=stage,
                )
            shares[ps] = config.capacity
        return requests, shares

    @internal
    def restored_on(self, requests: dict[int, RestoreTable]) -> None:
        """The shards of ``requests`` exist now (restored on this loop's channels)."""
        loop = id(asyncio.get_running_loop())
        self.created_on.update((loop, ps) for ps in requests)

    async def export_to(self, path: str) -> int:
        """Write every id and its row to a safetensors file (``ids`` int64, ``rows``) for
        serving; returns the number of rows."""
        from .._formats.files.tensor_files import write_tensors

        ids, rows = await self.export()
        await asyncio.get_running_loop().run_in_executor(
            None, write_tensors, path, {"ids": ids, "rows": rows}
        )
        return int(ids.size)

    def __deepcopy__(self, memo: dict[int, Any]) -> DynamicEmbedding:
        """A handle is a reference: a copied model (a torch replica) shares the table."""
        return self

    def __reduce__(self) -> Any:
        return (
            _remote_table,
            (
                self.name,
                self.key,
                self.dim,
                self.dtype.str,
                self.num_ps,
                self.capacity,
                self.owner,
                self.config,
                self.birth,
            ),
        )

    def __repr__(self) -> str:
        return (
            f"<pstrain.DynamicEmbedding {self.name!r} dim={self.dim} dtype={self.dtype.name} "
            f"ps={self.num_ps}>"
        )


def _remote_table(
    name: str,
    key: str,
    dim: int,
    dtype: str,
    num_ps: int,
    capacity: int | None,
    owner: str,
    config: dict[str, Any],
    birth: TableSlices | None = None,
) -> DynamicEmbedding:
    return DynamicEmbedding.handle(name, key, dim, dtype, num_ps, capacity, owner, config, birth)


def _ids(ids: Any, what: str) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu" or arr.dtype.itemsize > 8:
        hint = ""
        if arr.dtype.kind in "USO":  # strings, bytes, Python objects
            hint = (
                " (strings?). A table is keyed by int64: hash each key once, the same way "
                "everywhere, e.g. int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8)"
                ".digest(), 'little', signed=True)"
            )
        raise InvalidArgumentError(f"{what}: ids must be integers, got {arr.dtype}{hint}")
    flat = arr.reshape(-1)
    if flat.dtype == np.uint64:
        return flat.view(np.int64)
    return flat.astype(np.int64, copy=False)


class TableLookups:
    """One step's lookups of several dynamic tables (``(table, distinct ids)`` each), as
    items to route with other reads: ``(k, ps, positions)`` for table ``k``'s ids on ps
    ``ps``, split again by the newer map when slices moved or a ps left. ``out[k]`` takes
    table ``k``'s rows."""

    def __init__(self, lookups: list[tuple[DynamicEmbedding, np.ndarray]], training: bool) -> None:
        self.lookups = lookups
        self.training = bool(training)
        self.out = [np.empty((ids.size, t.dim), t.dtype) for t, ids in lookups]

    def pool(self) -> ChannelPool:
        """The channels the tables' requests go through (the closure's, on a worker)."""
        return self.lookups[0][0]._pool()  # noqa: SLF001 - this module's class

    def items(self) -> list[tuple[int, int, np.ndarray]]:
        return [(k, ps, pos) for k, (t, ids) in enumerate(self.lookups) for ps, pos in t.route(ids)]

    def resplit(self, item: tuple[int, int, np.ndarray]) -> list[tuple[int, int, np.ndarray]]:
        k, _, pos = item
        table, ids = self.lookups[k]
        return [(k, p, pos[sub]) for p, sub in table.route(ids[pos])]

    def channel_of(self, item: tuple[int, int, np.ndarray]) -> Channel:
        return self.lookups[item[0]][0].channel(item[1])

    async def entries(
        self, ps: int, group: list[tuple[int, int, np.ndarray]]
    ) -> tuple[list[TableIds], dict[int, np.ndarray]]:
        """The request's entries for ``group`` (one per table, its shard created first) and
        each table's positions, for :meth:`put`."""
        merged: dict[int, np.ndarray] = {}
        for k, _, pos in group:
            merged[k] = pos if k not in merged else np.concatenate([merged[k], pos])
        await asyncio.gather(*(self.lookups[k][0].shard_ready(ps) for k in merged))
        return (
            [TableIds(name=self.lookups[k][0].key, ids=self.lookups[k][1][pos]) for k, pos in merged.items()],
            merged,
        )

    async def send(
        self, channel: Channel, ps: int, message: LookupTables, merged: dict[int, np.ndarray]
    ) -> Any:
        """``message``, sent again once if a shard was not there (a ps restarted empty)."""
        try:
            return await channel.request(message)
        except NotFoundError as exc:
            if "dynamic table" not in str(exc):
                raise
            for k in merged:
                await self.lookups[k][0]._create(ps)  # noqa: SLF001 - this module's class
            return await channel.request(message)

    def put(self, merged: dict[int, np.ndarray], values: list[np.ndarray]) -> None:
        for (k, pos), rows in zip(merged.items(), values):
            self.out[k][pos] = rows


expose(globals(), "pstrain", ["DynamicEmbedding"])
