"""The restores of a ps's dynamic table shards (``dyn/restore``): read from a checkpoint (a
base and its deltas), checked whole, then put in place at once or staged until the
coordinator's ``ckpt/commit`` puts every restored shard of the job in place together (a
replacement ps, a restore of the whole job), or its ``ckpt/abort`` (or a timeout) drops them.

A shard restored anew replaces the one here; a lost ps's slices restored into a ps that
serves others are merged into its shard (``req.merge``); a tiered shard streams its rows to
disk as it reads them and links the base's files into its tier (``tiered_restore.py``).
Nothing served changes until the shard is installed: on any error the shard made for the
restore goes, with its rows on disk.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Protocol

import msgspec
import numpy as np

from ...._base.errors import InvalidArgumentError, ResourceExhaustedError
from ...._formats.files.delta_files import TablePlan
from ...._formats.messages.checkpoint_operations import RestoreTable
from ...._formats.messages.placement_map import TableCopy, TablePatch
from ...._formats.messages.records import RestoreReply
from ..checkpoints.feed import TableFeed
from ..checkpoints.saves import MAX_STAGED, STAGE_TTL_S, CheckpointFiles
from .cold_records import META, pack_records, record_dtype
from .dynamic_table import DynamicTable, TableConfig
from .set_aside import SetAsides
from .table_slices import SliceGuards
from .tiered_restore import fill_from_plan
from .tiered_table import TieredTable, Tiering

__all__ = ["TableRestores", "Tables", "discard"]


@dataclasses.dataclass
class _Staged:
    """A table's restore held until ``ckpt/commit``: its rows, its share of the capacity as
    staged, and what puts it in place with the share the commit gives (it cannot fail)."""

    rows: int
    capacity: int | None
    install: Callable[[int | None], object]
    table: DynamicTable | None = None  # the table made for it (a tiered one's disk goes if dropped)
    nbytes: int = 0  # what a merge staged holds (a table staged: its own ``nbytes``)
    drop: Callable[[], None] | None = None  # what a merge written to disk undoes if dropped


def _check_capacity(name: str, rows: int, capacity: int) -> None:
    if rows > capacity:
        raise InvalidArgumentError(
            f"dyn/restore of {name!r}: {rows} rows for this shard, more than its capacity of {capacity}"
        )


def _dropped(staged: _Staged, keep: DynamicTable | None = None) -> None:
    """A staged restore dropped (aborted, timed out or staged again): what it wrote goes."""
    if staged.drop is not None:
        staged.drop()
    elif staged.table is not keep:
        discard(staged.table)


def discard(table: DynamicTable | None) -> None:
    """``table`` is gone from this ps: if tiered, its directory goes (once no save or read
    of it is left)."""
    if isinstance(table, TieredTable):
        table.cold.discard()


class Tables(Protocol):
    """What a restore needs of the ps's tables (``handlers.py``'s ``TableHandlers``)."""

    tables: dict[str, DynamicTable]
    checkpoints: CheckpointFiles
    feed: TableFeed
    guards: SliceGuards
    tiering: Tiering | None
    max_table_bytes: int | None
    max_store_bytes: int | None

    @property
    def task(self) -> str: ...

    def held(self) -> int: ...

    def new_table(self, name: str, config: TableConfig, owner: str | None) -> DynamicTable: ...

    def put(self, name: str, table: DynamicTable) -> None: ...

    def taken_over(self, existing: DynamicTable | None, owner: str | None) -> None: ...


class TableRestores:
    """The table restores of one ps (the shards of ``handlers``' tables), and those staged
    for ``ckpt/commit``."""

    def __init__(self, handlers: Tables) -> None:
        self.handlers = handlers
        #: Restores staged by ``stage``: each table read and checked, and the timer that
        #: drops them if no ``ckpt/commit`` or ``ckpt/abort`` comes (``commit_tables``).
        self.staged: dict[str, tuple[dict[str, _Staged], asyncio.TimerHandle]] = {}
        #: Bytes of the shards being read into RAM now (each checked against the room left
        #: with the others counted: restores of several tables arrive together).
        self.reading = 0
        #: Tiered shards set aside on disk for restores in place, and the tiered restores
        #: under way (``set_aside.py``).
        self.asides = SetAsides(handlers, self.staged_for)

    async def restore_table(self, req: RestoreTable) -> RestoreReply:
        config = TableConfig(**msgspec.structs.asdict(req.config))
        if req.shard >= req.num_shards:
            raise InvalidArgumentError(f"dyn/restore: shard {req.shard} of {req.num_shards}")
        # the slices this ps holds, if part of the table moved; else its shard
        mine: tuple[int | list[int], int] = (
            (req.shard, req.num_shards) if req.owned is None else (req.owned.owned, req.owned.slices)
        )
        deltas = [[(path, prefix) for path, prefix in delta] for delta in req.deltas]
        if self.handlers.tiering is not None and req.merge is None:  # a tiered shard, made anew
            return await self._restore_tiered(req, config, mine, deltas)
        # planned first (the deltas composed, the base's ids read), so that what the rows
        # need is known, and refused, before any is read; then read into arrays made once
        plan = await self.handlers.checkpoints.read_table_plan(
            req.paths, mine[0], mine[1], config.dim, np.dtype(config.dtype), deltas
        )
        if req.merge is None and req.stage is None and config.capacity is not None:
            _check_capacity(req.name, plan.rows, config.capacity)
        wanted = [k for k in plan.slots if req.slots is None or k in req.slots]
        to_disk = req.merge is not None and self.handlers.tiering is not None
        need = self._check_room(req, plan, len(wanted), in_ram=not to_disk)
        self.reading += need  # (held until the rows are staged, in place, or dropped)
        try:
            if to_disk:
                return await self._merge_to_disk(req, config, plan, wanted)
            return await self._restore_read(req, config, mine, plan, wanted)
        finally:
            self.reading -= need

    async def _restore_read(
        self,
        req: RestoreTable,
        config: TableConfig,
        mine: tuple[int | list[int], int],
        plan: TablePlan,
        wanted: list[str],
    ) -> RestoreReply:
        """:meth:`restore_table` of a shard read into RAM, its room checked."""
        ids, rows, slots, slot_init = await asyncio.to_thread(plan.read_whole, wanted)
        if req.slots is not None:
            slots = {req.slots[k]: v for k, v in slots.items() if k in req.slots}
            slot_init = {req.slots[k]: v for k, v in slot_init.items() if k in req.slots}
        if req.merge is not None:
            if req.stage is not None:  # merged by ckpt/commit (a replacement, all or nothing)
                self._stage(
                    req.stage,
                    req.name,
                    _Staged(
                        int(ids.size),
                        config.capacity,
                        lambda _: self._merge_restored(req, config, ids, rows, slots, slot_init),
                        nbytes=int(ids.nbytes + rows.nbytes + sum(a.nbytes for a in slots.values())),
                    ),
                )
                return RestoreReply(staged=int(ids.size), stage=req.stage)
            return self._merge_restored(req, config, ids, rows, slots, slot_init)
        table = self.handlers.new_table(req.name, config, req.owner)  # (untiered: a tiered one streams)

        def fill() -> Awaitable[None]:
            return asyncio.to_thread(table.load, ids, rows, slots, slot_init)

        return await self._put_restored(req, config, mine, table, int(ids.size), fill)

    async def _merge_to_disk(
        self, req: RestoreTable, config: TableConfig, plan: TablePlan, wanted: list[str]
    ) -> RestoreReply:
        """A lost ps's slices merged into a tiered shard here (a replacement): their rows
        written to the shard's disk a piece at a time as they are read, as a move's rows are
        pulled, and indexed when the merge is put in place (``ckpt/commit``). A lost ps's
        share of a table may be far more than this ps's budget: RAM holds their ids and
        places meanwhile, 16 bytes a row, and a piece being written."""
        existing = self.handlers.tables.get(req.name)
        table = existing or self.handlers.new_table(req.name, config, req.owner)
        assert isinstance(table, TieredTable)
        table.room_on_disk(plan.rows)  # (refused before a row is written, if it has none)
        named = {k: req.slots[k] if req.slots is not None else k for k in wanted}
        slots = sorted(named.values())  # (a record's slots, in order)
        saved_as = {v: k for k, v in named.items()}
        record = record_dtype(config.dim, table.dtype, len(slots))
        sink = table.pull_sink(req.name)
        assert self.handlers.tiering is not None
        piece = self.handlers.tiering.save_bytes  # (a save's staging: a share of the budget)

        def drop() -> None:  # (aborted: the rows written die; a shard made for it goes)
            sink.forget()
            if existing is None:
                discard(table)

        # each piece read on a thread, written on the loop: the shard's disk is the loop's,
        # which moves its rows there meanwhile (as a move's pulled blocks are written)
        pieces = plan.with_slots(wanted).pieces(piece)
        try:
            while (got := await asyncio.to_thread(next, pieces, None)) is not None:
                ids, rows, by_name = got
                by_slot = [by_name[saved_as[k]] for k in slots]
                sink.put(pack_records(record, ids, np.zeros(ids.size, META), rows, by_slot), slots)
        except BaseException:
            drop()
            raise
        finally:
            pieces.close()
        live = np.concatenate([np.empty(0, np.int64), *(ids for ids, _ in sink.blocks)])
        copy = TableCopy(
            name=req.name,
            config=req.config,
            ids=np.empty(0, np.int64),
            rows=np.empty((0, config.dim), table.dtype),
            slot_init={named[k]: v for k, v in plan.slot_init.items() if k in named},
        )
        patch = TablePatch(
            name=req.name,
            live=live,
            ages=np.zeros(live.size, np.int64),
            freq=np.zeros(live.size, np.int64),
            ids=np.empty(0, np.int64),
            rows=np.empty((0, config.dim), table.dtype),
        )

        def install(_: int | None) -> None:
            try:  # (the budget may have no room left for their index now: refused, they die)
                table.checked_merge(copy, patch, pulled=sink)()
            except BaseException:
                drop()
                raise
            self._merged(req, config, table)

        if req.stage is not None:
            staged = _Staged(int(live.size), config.capacity, install, nbytes=sink.nbytes, drop=drop)
            self._stage(req.stage, req.name, staged)
            return RestoreReply(staged=int(live.size), stage=req.stage)
        install(None)
        return RestoreReply(restored=int(live.size))

    def _check_room(self, req: RestoreTable, plan: TablePlan, slots: int, in_ram: bool = True) -> int:
        """InvalidArgumentError if the shard's rows and ``slots`` of their slots are more
        than a table may hold here (``--max-variable-bytes``), ResourceExhaustedError if
        reading them would take what this ps holds past ``--max-store-bytes`` (by default
        80 % of the memory it may use): a restore is refused before it reads a row, where
        the kernel would kill the ps once it had read them. The shard it replaces, if any,
        counts until the restored one is in its place: both are held until then, and so is
        the plan (the ids of the rows kept) until the rows are read. Returns the bytes the
        read holds. ``in_ram=False``: the rows go to disk
        as they are read (a tiered shard's merge), RAM holding 16 bytes a row for them."""
        table_bytes = plan.nbytes(slots) if in_ram else 16 * plan.rows
        limit = self.handlers.max_table_bytes
        if in_ram and limit is not None and table_bytes > limit:
            raise InvalidArgumentError(
                f"dyn/restore of {req.name!r}: {plan.rows} rows with {slots} slot(s) are "
                f"{table_bytes} bytes on this shard, more than this ps's limit of {limit} "
                "(pstrain serve --max-variable-bytes)"
            )
        need = table_bytes + plan.held_nbytes
        limit = self.handlers.max_store_bytes
        held = self.handlers.held()
        if limit is None:
            return need
        if held + need > limit:
            raise ResourceExhaustedError(
                f"dyn/restore of {req.name!r}: reading its {plan.rows} rows on this shard, with "
                f"{slots} slot(s), holds {need} bytes, which would take {self.handlers.task} past its limit "
                f"of {limit} bytes held ({held} held now: variables, tables and restores "
                "staged; pstrain serve --max-store-bytes). Restore onto more ps (a table saved "
                "from any number of ps restores onto any other), or give the ps a "
                "--memory-budget and a --table-dir (its rows past the budget then live on disk)"
            )
        return need

    async def _put_restored(
        self,
        req: RestoreTable,
        config: TableConfig,
        mine: tuple[int | list[int], int],
        table: DynamicTable,
        rows: int,
        fill: Callable[[], Awaitable[None]],
    ) -> RestoreReply:
        """Fill ``table`` (a new shard: ``fill`` reckons on the loop what it may keep in RAM,
        then puts the rows in on a thread, where a large shard's copies and writes to disk
        would hold the serving loop), then stage it for ckpt/commit or install it. On any
        error the table goes (and its rows on disk): nothing served changed."""
        try:
            await fill()
        except BaseException:
            discard(table)
            raise
        if req.stage is not None:  # put in place by ckpt/commit, with its share of the capacity

            def install(capacity: int | None) -> None:
                table.with_capacity(capacity)
                self._install(table, req, mine)

            self._stage(req.stage, req.name, _Staged(len(table), config.capacity, install, table))
            return RestoreReply(staged=rows, stage=req.stage)
        self._install(table, req, mine)
        return RestoreReply(restored=rows)

    async def _restore_tiered(
        self,
        req: RestoreTable,
        config: TableConfig,
        mine: tuple[int | list[int], int],
        deltas: list[list[tuple[str, str]]],
    ) -> RestoreReply:
        """:meth:`restore_table` of a tiered shard, the one it replaces set aside on disk if
        both do not fit the budget: the deltas composed and the base's ids checked first
        (``delta_files.read_table_plan``), then the base's files linked into the tier where
        they can be, the rest of its rows read a piece at a time on one thread while another
        writes each piece past the hot set to disk (reading and writing overlap; the whole
        base is never in RAM): ``tiered_restore.py``."""
        async with self.asides.under_way(req.name):
            assert self.handlers.tiering is not None
            limit = self.handlers.tiering.limit
            old = self.handlers.tables.get(req.name)
            if isinstance(old, TieredTable) and self.handlers.held() + old.nbytes > limit:
                # a shard as large again does not fit beside it: aside before the plan is read
                await self.asides.set_aside(req.name, old)
            plan = await self.handlers.checkpoints.read_table_plan(
                req.paths, mine[0], mine[1], config.dim, np.dtype(config.dtype), deltas
            )
            names = {k: k for k in plan.slots}
            if req.slots is not None:
                names = {k: req.slots[k] for k in plan.slots if k in req.slots}
            slot_init = {names[k]: plan.slot_init[k] for k in names}
            if req.stage is None and config.capacity is not None:
                _check_capacity(req.name, plan.rows, config.capacity)

            table = self.handlers.new_table(req.name, config, req.owner)
            assert isinstance(table, TieredTable)
            reserved = 0

            async def fill() -> None:  # (budgeted as if the shard it replaces were gone)
                nonlocal reserved
                old = self.handlers.tables.get(req.name)  # (None if set aside)
                besides = plan.held_nbytes  # (its ids, held beside the shard until it is filled)
                hot = table.rows_in_ram_for(plan.rows, len(slot_init), replacing=old, besides=besides)
                need = table.ram_for(plan.rows, len(slot_init), hot) + besides
                if isinstance(old, TieredTable) and self.handlers.held() + need > limit:
                    await self.asides.set_aside(req.name, old)  # (both shards do not fit the budget)
                # held from now (on the loop, at once) until the shard is staged or in place: the
                # next shard's restore, which may be under way beside this one, counts it
                reserved = need
                self.reading += reserved
                await asyncio.to_thread(fill_from_plan, table, plan, names, slot_init, hot)

            try:
                return await self._put_restored(req, config, mine, table, plan.rows, fill)
            finally:
                self.reading -= reserved

    def staged_for(self, name: str) -> bool:
        """Whether a restore of table ``name`` is staged (for ``ckpt/commit``)."""
        return any(name in tables for tables, _ in self.staged.values())

    def staged_bytes(self) -> int:
        """What the restores staged for ``ckpt/commit`` hold in RAM: a ps counts them with
        its variables and tables until they are put in place or dropped."""
        return self.reading + sum(
            s.table.nbytes if s.table is not None else s.nbytes
            for tables, _ in self.staged.values()
            for s in tables.values()
        )

    def _stage(self, stage: str, name: str, staged: _Staged) -> None:
        entry = self.staged.get(stage)
        if entry is None:
            if len(self.staged) >= MAX_STAGED:
                raise InvalidArgumentError(
                    f"dyn/restore: {len(self.staged)} restores are staged on {self.handlers.task} "
                    f"already (at most {MAX_STAGED}): commit or abort them first"
                )
            timer = asyncio.get_running_loop().call_later(STAGE_TTL_S, self.abort_tables, stage)
            entry = self.staged[stage] = ({}, timer)
        before = entry[0].get(name)
        entry[0][name] = staged
        if before is not None:
            _dropped(before, keep=staged.table)

    def commit_tables(self, stage: str, capacities: dict[str, int | None]) -> Callable[[], int]:
        """Check that the tables staged as ``stage`` fit ``capacities`` (each table's share
        here; a table not named keeps the share it was staged with); returns what puts them
        in place (it cannot fail), or raises with nothing changed."""
        tables = self.staged.get(stage, ({}, None))[0]
        for name, staged in tables.items():
            capacity = capacities.get(name, staged.capacity)
            if capacity is not None and staged.rows > capacity:
                raise InvalidArgumentError(
                    f"ckpt/commit of {name!r}: {staged.rows} rows staged on {self.handlers.task}, more "
                    f"than its share of the capacity, {capacity}"
                )

        def install() -> int:
            entry = self.staged.pop(stage, None)
            if entry is None:
                return 0
            entry[1].cancel()
            for name, staged in entry[0].items():
                staged.install(capacities.get(name, staged.capacity))
            return len(entry[0])

        return install

    def abort_tables(self, stage: str) -> bool:
        """Drop the tables staged as ``stage``; whether there were any."""
        entry = self.staged.pop(stage, None)
        if entry is not None and entry[1] is not None:
            entry[1].cancel()
        for name, staged in entry[0].items() if entry is not None else ():
            _dropped(staged)
            self.asides.settle(name)  # (a shard set aside for it comes back)
        return entry is not None

    def _install(self, table: DynamicTable, req: RestoreTable, mine: tuple[int | list[int], int]) -> None:
        """A restored table replaces the shard here."""
        aside = self.asides.replaced(req.name)  # (a shard set aside for it goes, with its disk)
        existing = self.handlers.tables.get(req.name) or aside
        if existing is not None:  # counters of this process only go up (Prometheus counters)
            table.admitted, table.evicted = existing.admitted, existing.evicted
        self.handlers.taken_over(existing, req.owner)
        self.handlers.put(req.name, table)
        self.handlers.guards.set(req.name, req.owned)
        self.handlers.feed.placed(req.name, *mine)
        self.handlers.feed.replaced(req.name, self.handlers.checkpoints.store.clock.epoch)
        first = req.paths[0] if req.paths else next((d[0][0] for d in req.deltas if d), None)
        if first is not None:
            self.handlers.feed.saved(req.name, first)

    def _merge_restored(
        self,
        req: RestoreTable,
        config: TableConfig,
        ids: np.ndarray,
        rows: np.ndarray,
        slots: dict[str, np.ndarray],
        slot_init: dict[str, float],
    ) -> RestoreReply:
        """Put the restored rows of a lost ps's slices into the table here (made empty if
        it has none), which serves ``req.merge`` from now on."""
        assert req.merge is not None
        table = self.handlers.tables.get(req.name) or self.handlers.new_table(req.name, config, req.owner)
        empty = np.empty(0, np.int64)
        table.merge_slices(
            TableCopy(name=req.name, config=req.config, ids=ids, rows=rows, slots=slots, slot_init=slot_init),
            TablePatch(
                name=req.name,
                live=ids,
                ages=np.zeros(ids.size, np.int64),
                freq=np.zeros(ids.size, np.int64),
                ids=empty,
                rows=np.empty((0, config.dim), table.dtype),
            ),
        )
        self._merged(req, config, table)
        return RestoreReply(restored=int(ids.size))

    def _merged(self, req: RestoreTable, config: TableConfig, table: DynamicTable) -> None:
        """``table``, a lost ps's slices merged into it, serves ``req.merge`` from now on."""
        assert req.merge is not None
        table.with_capacity(config.capacity)
        self.handlers.put(req.name, table)
        self.handlers.guards.set(req.name, req.merge)
        self.handlers.feed.moved(
            req.name, req.merge.owned, req.merge.slices, self.handlers.checkpoints.store.clock.epoch
        )
