"""The ps's dynamic embedding tables: the ``dyn/*`` operations and the tables' part of
``opt/apply`` and of full saves (``dyn/restore`` is ``table_restores.py``'s). Each table's
shard is a :class:`~pstrain.server.ps.tables.dynamic_table.DynamicTable`; its checkpoint
files go through the ps's :class:`~pstrain.server.ps.checkpoints.saves.CheckpointFiles`.
Every check happens before anything changes, as in ``handlers.py``."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
import os
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import msgspec
import numpy as np

from ...._base.cluster import Named, named
from ...._base.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
)
from ...._formats.files.table_links import LINKED, link_name
from ...._formats.files.tensor_files import whole
from ...._formats.messages.checkpoint_operations import RestoreTable, SaveCheckpoint
from ...._formats.messages.operations import (
    CreateTable,
    ExportTable,
    LookupTable,
    LookupTables,
    TableStatistics,
)
from ...._formats.messages.records import CreatedReply, SaveReply, ValuesReply
from ...._formats.numerics.idhash import shard_of
from ...._serving.core import Router
from ..checkpoints.feed import TableFeed
from ..checkpoints.saves import CheckpointFiles, Pending, Tensors
from ..checkpoints.snapshots import Snapshot
from .dynamic_table import DynamicTable, Found, TableConfig
from .table_restores import TableRestores, discard
from .table_slices import SliceGuards
from .tiered_table import TieredTable, Tiering

__all__ = ["Planned", "TableHandlers", "ids_by_table"]

logger = logging.getLogger(__name__)

#: A read of rows on disk (:meth:`TableHandlers._read_cold`): the table, the places, and
#: ``read(left, missed)``, which reads at the places (``left`` None) or those of
#: ``places[left]``, only what the page cache holds with ``missed``: a dict of arrays a place.
ColdRead = tuple[TieredTable, np.ndarray, Callable[[Any, Any], dict[str, np.ndarray]]]


def _read_back(
    table: TieredTable, places: np.ndarray, ids: np.ndarray, made: np.ndarray, left: Any, missed: Any
) -> dict[str, np.ndarray]:
    """A stage's read of the rows a training request brings back to RAM (their ``ids``, and
    which are rows as the table made them, made again: :meth:`TieredTable.read_cold`)."""
    if left is None:
        return table.read_cold(places, ids, made, missed)
    return table.read_cold(places[left])  # (a row made again is never left)


def _read_ahead(table: TieredTable, places: np.ndarray, left: Any, missed: Any) -> dict[str, np.ndarray]:
    """A stage's read of the rows a lookup that does not train reads where they lie."""
    return {"rows": table.read_rows(places if left is None else places[left], missed)}


#: Rounds in which one tiered table gives back RAM for another (:meth:`TableHandlers._make_room`).
MAKE_ROOM_ROUNDS = 4
#: Bytes of records a compaction reads (and writes again) at a time, at most: a 64th of the
#: ps's budget under 256 MiB (a read and the copies that write it again are a few times
#: that, all outside the budget's arrays).
COMPACT_BYTES = 4 << 20
#: The most bytes of rows a request brings back from disk that the serving loop reads itself
#: where the page cache holds them (:meth:`TableHandlers._read_cold`): about a millisecond
#: of copying; a larger read goes to a thread whole, the loop serving meanwhile.
LOOP_READ_BYTES = 4 << 20

Q = TypeVar("Q")


@dataclasses.dataclass(frozen=True)
class Planned:
    """One table's part of an ``opt/apply``, checked (:meth:`TableHandlers.plan`): its ids,
    gradient and slots, and the ids' rows when planned (``found``)."""

    table: DynamicTable
    ids: np.ndarray
    grad: np.ndarray
    slots: dict[str, tuple[str, float]]
    found: Found


def ids_by_table(wanted: Iterable[tuple[str, Any]]) -> dict[str, np.ndarray]:
    """Each table's ids in ``(table, ids)`` pairs, a table named twice once with the ids of
    both, distinct. Ids that are not a 1-D integer array are left out (the handler refuses
    them by name)."""
    parts: dict[str, list[np.ndarray]] = {}
    for name, raw in wanted:
        try:
            ids = np.asarray(raw)
        except (TypeError, ValueError):
            continue
        if ids.ndim == 1 and ids.dtype.kind in "iu":
            parts.setdefault(name, []).append(ids)
    return {
        name: each[0] if len(each) == 1 else np.unique(np.concatenate([a.astype(np.int64) for a in each]))
        for name, each in parts.items()
    }


def shard_tensors(
    table: DynamicTable, save: dict[str, Snapshot], rename: dict[str, str], prefix: str = ""
) -> Tensors:
    """A table shard's snapshots (``save``) as a file's tensors: ``<prefix>ids``, ``rows``
    and the others as they are, each slot in ``rename`` as ``<prefix>slot:<its name>`` with
    its initial value as ``<prefix>init:<its name>`` (slots not in ``rename`` left out)."""
    out: Tensors = []
    for key, snap in save.items():
        if key.startswith("slot:"):
            if key[5:] not in rename:
                continue
            key = f"slot:{rename[key[5:]]}"
        out.append((prefix + key, snap.array.dtype, snap.shape, snap))
    for key, init in table.slot_init.items():
        if key in rename:
            out.append(whole(f"{prefix}init:{rename[key]}", np.array([init], np.float64)))
    return out


def table_scope(
    guards: SliceGuards, feed: TableFeed, name: str, ids: Any
) -> tuple[int, tuple[int, ...]] | None:
    """The part of table ``name`` an update of ``ids`` on this ps covers (what its
    exactly-once record keeps): the slices of these ids, if slices of the table moved (a
    client on an older map sends some of this ps's slices and not others); else this ps's
    shard (it gets all of an update's ids of its shard); None if it does not know."""
    slices = guards.slices(name)
    if slices is not None:
        return slices, tuple(np.unique(shard_of(np.asarray(ids, np.int64), slices)).tolist())
    placed = feed.placement.get(name)
    if placed is None or not isinstance(placed[0], int):
        return None
    return placed[1], (placed[0],)


class TableHandlers:
    """The dynamic tables of one ps, by name, and the operations on them."""

    def __init__(
        self,
        task: str | Named,
        checkpoints: CheckpointFiles,
        max_gather_bytes: int,
        feed: TableFeed,
        guards: SliceGuards,
        *,
        max_table_bytes: int | None = None,
        max_store_bytes: int | None = None,
        on_takeover: Callable[[set[str | None], str | None], None] | None = None,
        as_of: Callable[[str, Any, np.ndarray, np.ndarray], np.ndarray] | None = None,
        tiering: Tiering | None = None,
        spawn: Callable[[Coroutine[Any, Any, None]], object] | None = None,
    ) -> None:
        self._name = named(task)  # the ps's name as it is now (a ps that joined is renamed)
        self.max_table_bytes = max_table_bytes  # a shard's rows and slots: --max-variable-bytes
        self.max_store_bytes = max_store_bytes  # all it holds in RAM: --max-store-bytes
        #: Called with (the owners replaced, the new owner) when a coordinator takes a table over.
        self.on_takeover = on_takeover
        self.checkpoints = checkpoints
        self.max_gather_bytes = max_gather_bytes
        self.tables: dict[str, DynamicTable] = feed.tables
        self.feed = feed  # told where each table is saved and which shard it is
        #: The slices each table serves here, for the tables part of which moved (moves.py).
        self.guards = guards
        #: A lookup's rows as a read of an exactly-once closure sees them (``as_of``): the
        #: ps's before images (``before_images.py``).
        self.as_of = as_of
        #: The ps's byte budget and table directory: its tables are tiered (None: in RAM).
        self.tiering = tiering
        self._tiers = 0  # tiered tables made (each its own directory)
        self.spawn = spawn  # runs the compaction of a tiered table's segments (the ps's tasks)
        #: ``dyn/restore``, and the restores staged for ``ckpt/commit`` (held beside the
        #: tables until then: counted in what the ps holds).
        self.restores = TableRestores(self)
        checkpoints.store.staged.append(self.restores.staged_bytes)

    def held(self) -> int:
        """What this ps holds in RAM for variables and tables (what its budget covers)."""
        return self.checkpoints.store.held() + sum(t.nbytes for t in self.tables.values())

    def room(self, adding: int, table: str) -> None:
        """ResourceExhaustedError if growing table ``table`` by ``adding`` bytes would take
        what this ps holds past ``--max-store-bytes`` (by default 80 % of the memory it may
        use): the request is refused, where the kernel would kill the ps."""
        if self.max_store_bytes is None:
            return
        held = self.held()
        if held + adding > self.max_store_bytes:
            raise ResourceExhaustedError(
                f"dynamic table {table!r}: growing it by {adding} bytes would take {self._name.task} "
                f"past its limit of {self.max_store_bytes} bytes held ({held} held now, variables "
                "and tables; pstrain serve --max-store-bytes): give the table a capacity (its "
                "rows are then evicted), shard it over more ps, or give the ps a --memory-budget "
                "and a --table-dir (rows past it then live on disk)"
            )

    def put(self, name: str, table: DynamicTable) -> None:
        """Serve ``table`` as ``name`` here; a tiered table it replaces gives back its disk."""
        old = self.tables.get(name)
        self.tables[name] = table
        if old is not table:
            discard(old)

    def drop(self, name: str) -> None:
        """Table ``name`` is no longer here (its disk goes with it, if tiered)."""
        discard(self.tables.pop(name, None))

    def cold_index(self) -> int:
        """What of :meth:`held` indexes the tables' rows on disk (the budget's cold share)."""
        return sum(t.cold.nbytes for t in self.tables.values() if isinstance(t, TieredTable))

    def new_table(self, name: str, config: TableConfig, owner: str | None) -> DynamicTable:
        """A shard of table ``name``: tiered if this ps has a budget and a table directory."""
        clock = self.checkpoints.store.clock
        if self.tiering is None:
            return DynamicTable(name, config, owner, self.max_table_bytes, clock=clock, room=self.room)
        self._tiers += 1
        return TieredTable(
            name,
            config,
            owner,
            clock=clock,
            directory=self.tiering.table_directory(name, self._tiers),
            budget=self.tiering.limit,
            ps_budget=self.tiering.budget,
            held=self.held,
            cold_index=self.cold_index,
            segment_rows=self.tiering.segment_rows,
            shed=self.shed_sightings,
        )

    def shed_sightings(self) -> bool:
        """Forget the older half of the sightings (``admit_after``) of the table on this ps
        that remembers the most, for rows of any table that need the RAM: whether one had
        any. (Not a table set aside for a restore: its arrays are on disk, read back whole.)"""
        asides = self.restores.asides
        tables = [t for name, t in self.tables.items() if name not in asides and t.sightings_bytes()]
        return bool(tables) and max(tables, key=lambda t: t.sightings_bytes()).shed_sightings()

    def rows_in_ram(
        self,
        fn: Callable[[Q], Any],
        ids_of: Callable[[Q], Iterable[tuple[str, Any]]],
        trains: Callable[[Q], bool] = lambda req: True,
        check: Callable[[Q], object] | None = None,
    ) -> Callable[[Q], Any]:
        """``fn`` (a handler that runs in one step on the loop) behind a stage that first
        brings back into RAM (read on the loop from the page cache, or on a thread:
        :meth:`_read_cold`) the rows on disk that its request names
        (``ids_of``: its ``(table, ids)``); ``fn`` itself if this ps tiers nothing. A request
        that does not train (``trains``) has those rows read for it and left on disk.
        ``check`` refuses, before anything is read, what ``fn`` would refuse whatever the
        rows: a refused request reads nothing from disk and moves nothing between the tiers
        (the rows a lookup reads for its reply follow the reply's limit, not how many ids
        a request names)."""
        if self.tiering is None:
            return fn

        async def run(req: Q) -> Any:
            wanted = list(ids_of(req))
            names = {name for name, _ in wanted}
            train = trains(req)
            asides = self.restores.asides
            while True:  # (a table set aside for a restore in place: after it, and staged again)
                if asides:
                    await asides.settled(names)
                if check is not None:
                    check(req)
                read = await self.stage(wanted, train)
                if not asides or not any(name in asides for name in names):
                    break
                for table in read:
                    table.read_ahead = None
            try:
                out = fn(req)  # no await between the stage and the handler: its rows stay in RAM
            finally:
                for table in read:
                    table.read_ahead = None
            for name, _ in wanted:
                self.compact(name)
            return (await out) if inspect.isawaitable(out) else out

        functools.update_wrapper(run, fn)
        return run

    def compact(self, name: str) -> None:
        """Start copying the live rows of a half-dead segment of table ``name`` (if tiered,
        and none is being copied): read on a thread, written at the end on the loop."""
        table = self.tables.get(name)
        if not isinstance(table, TieredTable) or table.compacting or self.spawn is None:
            return
        number = table.cold.compactable()
        if number is not None:
            table.compacting = True
            self.spawn(self._compact(table, number))

    async def _compact(self, table: TieredTable, number: int) -> None:
        """Copy the live records of segment ``number`` to the end, ``COMPACT_BYTES`` of them
        at a time (a half-dead segment of a million wide records is hundreds of MB: read at
        once, it would put the ps that far past its budget)."""
        cold = table.cold
        try:
            slots, places = cold.live_in(number)
            chunk = min(COMPACT_BYTES, table.budget // 64)
            per = max(1, chunk // cold.record(cold.segments[number].slots).itemsize)
            for lo in range(0, slots.size, per):
                part, at = slots[lo : lo + per], places[lo : lo + per]
                still = cold.current(part, at)  # not taken back meanwhile
                part, at = part[still], at[still]
                if not part.size:
                    continue
                cold.begin_read()
                try:
                    records = await asyncio.to_thread(cold.read, at, dict(table.slot_init))
                finally:
                    cold.end_read()
                if self.tables.get(table.name) is not table:
                    return
                table.compacted += cold.rewrite(part, at, records)
        except ResourceExhaustedError as exc:  # a full disk: the segment stays, tried again later
            logger.warning("%s: compaction of table %r put off: %s", self.task, table.name, exc)
        finally:
            table.compacting = False

    async def stage(self, wanted: Iterable[tuple[str, Any]], train: bool = True) -> list[TieredTable]:
        """Read the rows of ``wanted`` that are on disk (one thread call for all of them),
        then put them back in RAM; for a request that does not ``train``, leave them on disk
        and give their rows to the handler (:attr:`TieredTable.read_ahead`, which the caller
        clears after it). Returns the tables given rows read ahead."""
        if not train:
            return await self._read_ahead(wanted)
        reads = []
        for table, ids in self._tiered_ids(wanted):
            if table.hot_short(ids.size):  # the other tables' rows in RAM left it no room
                self._make_room(table, ids.size)
            if not len(table.cold):
                if table.cold_short(ids.size):  # its rows on disk will need RAM for their index
                    table.shrink_for_cold(ids.size, keep=ids)
                continue
            ids = np.ascontiguousarray(ids, np.int64)
            found = table.in_ram(ids)  # only the others are looked for on disk
            cold_ids, slots, places = table.cold_found(ids[found.pos < 0])
            if cold_ids.size:  # too many for RAM at once: refused before anything is read
                table.holds_at_once(cold_ids.size + int(np.count_nonzero(found.pos >= 0)))
            # the ids in neither tier take new rows in RAM, and as many rows move out to new
            # slots on disk (those put back give up theirs first: :meth:`TieredTable.promote`)
            new = int(np.count_nonzero(found.pos < 0)) - cold_ids.size
            if table.cold_short(new, ids.size):  # the index on disk needs RAM for them
                table.shrink_for_cold(new, ids.size, keep=ids)  # (none of ``ids`` moves)
            if cold_ids.size:  # (which need no read: taken with their places, on the loop)
                reads.append((table, ids, cold_ids, slots, places, found, new, table.cold.made_at(slots)))
        got = await self._read_cold(
            [
                (t, places, functools.partial(_read_back, t, places, cold, made))
                for t, _, cold, _, places, *_, made in reads
            ]
        )
        for (table, ids, cold_ids, slots, places, found, new, _), records in zip(reads, got):
            if self.tables.get(table.name) is table:  # (not replaced meanwhile)
                table.promote(cold_ids, slots, places, records, ids, found)
                if table.cold_short(new, ids.size):  # the rows put back grew the hot set into
                    table.shrink_for_cold(new, ids.size, keep=ids)  # the room checked for above
        return []

    async def _read_ahead(self, wanted: Iterable[tuple[str, Any]]) -> list[TieredTable]:
        """:meth:`stage` of a request that does not train: the rows on disk it names, read on
        a thread and handed to its handler, nothing moved (no room made in RAM or on disk)."""
        reads = []
        for table, ids in self._tiered_ids(wanted):
            if len(table.cold):
                ids = np.ascontiguousarray(ids, np.int64)
                _, places = table.cold_wanted(ids[table.in_ram(ids).pos < 0])
                if places.size:
                    reads.append((table, np.sort(places)))
        got = await self._read_cold([(t, p, functools.partial(_read_ahead, t, p)) for t, p in reads])
        given = []
        for (table, places), read in zip(reads, got):
            if self.tables.get(table.name) is table:  # (not replaced meanwhile)
                table.read_ahead = (places, read["rows"])
                given.append(table)
        return given

    def _tiered_ids(self, wanted: Iterable[tuple[str, Any]]) -> Iterator[tuple[TieredTable, np.ndarray]]:
        """The tiered tables ``wanted`` names, each once with all its ids (an update may name
        a table twice, its parts applied one after the other: their rows come back to RAM
        together, none moved out for another's). A request the handler will refuse (a table
        not here, ids that are not ids) is left to the handler."""
        for name, ids in ids_by_table(wanted).items():
            table = self.tables.get(name)
            if isinstance(table, TieredTable):
                yield table, ids

    async def _read_cold(self, reads: list[ColdRead]) -> list[dict[str, np.ndarray]]:
        """What each of ``reads`` reads (``(table, places, read)``: ``read(None, missed)``
        reads at ``places``, ``read(left, None)`` those of ``places[left]``, each a dict of
        arrays a place): on the loop, the records the page cache holds (reads that cannot
        wait for the disk: ``ColdRows.read``'s ``missed``), of reads of at most
        ``LOOP_READ_BYTES``; the rest in one thread call, as every read went before. A hop to
        a thread and back costs more than a few hundred records copied from the page cache,
        and the request's reply waits for it."""
        got: list[Any] = [None] * len(reads)
        rest: list[tuple[int, np.ndarray | None]] = []  # (read, its places left: None, all)
        for k, (table, places, read) in enumerate(reads):
            if places.size * table.hot_row_bytes() > LOOP_READ_BYTES:
                rest.append((k, None))
                continue
            missed = np.zeros(places.size, bool)
            got[k] = read(None, missed)
            if missed.any():
                rest.append((k, missed))
        if rest:

            def on_thread() -> list[dict[str, np.ndarray]]:
                return [reads[k][2](left, None) for k, left in rest]

            more = await self._read_on_thread([reads[k][0] for k, _ in rest], on_thread)
            for (k, left), values in zip(rest, more):
                if left is None:
                    got[k] = values
                else:
                    for key, part in values.items():
                        got[k][key][left] = part
        return got

    @staticmethod
    async def _read_on_thread(tables: list[TieredTable], read: Callable[[], list[Any]]) -> list[Any]:
        """``read()`` on a thread, no segment of ``tables`` deleted meanwhile."""
        if not tables:
            return []
        for table in tables:
            table.cold.begin_read()
        try:
            return await asyncio.to_thread(read)
        finally:
            for table in tables:
                table.cold.end_read()

    def _tiered_largest_first(self) -> list[TieredTable]:
        """This ps's tiered tables, those with the most rows allocated in RAM first: the order
        in which they give RAM back."""
        return sorted((t for t in self.tables.values() if isinstance(t, TieredTable)), key=lambda t: -t.alloc)

    def _make_room(self, table: TieredTable, n: int) -> None:
        """Have this ps's other tiered tables give back RAM until ``table`` can hold ``n``
        rows at once and as many again, the largest first (between requests: no handler
        holds their places). Each gives back in a few rounds: its rows moved to disk take
        some of what it frees for their index."""
        for other in self._tiered_largest_first():
            if other is table:
                continue
            for _ in range(MAKE_ROOM_ROUNDS):
                short = table.hot_short(n)
                if not short:
                    return
                if not other.give_back(short * table.hot_row_bytes()):
                    break

    def give_room(self, nbytes: int, keep: Mapping[str, np.ndarray] | None = None) -> str:
        """Have this ps's tiered tables give back about ``nbytes`` of RAM (their coldest rows
        to disk, the largest table first) for variables or optimizer slots the budget has
        no room for: a table's hot set is a cache, a variable is not. ``keep``: ids of each
        table a request has staged in RAM, which stay there. Returns, for a refusal, why
        they gave less: a save reading a table (which then gives nothing), or ""."""
        keep = keep or {}
        tables = self._tiered_largest_first()
        goal = self.held() - nbytes
        for table in tables:
            ids, floor = keep.get(table.name), table.hot_floor()
            for _ in range(2 * MAKE_ROOM_ROUNDS):
                short = self.held() - goal
                if short <= 0:
                    return ""
                # twice what is short first: a row moved to disk frees less than its share
                # of the hot set's budget (its id stays, in the index of the rows on disk);
                # then what is short, should the index have no room for twice as many
                if not (table.give_back(2 * short, ids, floor) or table.give_back(short, ids, floor)):
                    break
        saving = sorted(t.name for t in tables if t.saves)
        if saving:
            return (
                f"; a save is reading tables {saving}, whose rows in RAM give none of their RAM "
                "until it ends: try again then"
            )
        return ""

    @property
    def task(self) -> str:
        return self._name.task

    def install(self, route: Router) -> None:
        """Route the table operations (and full saves, which write the tables too) here."""
        route(CreateTable, self.create_table)
        route(
            LookupTable,
            self.rows_in_ram(
                self.lookup_table,
                lambda req: [(req.name, req.ids)],
                lambda req: req.train,
                lambda req: self.check_lookups([(req.name, req.ids)], "dyn/lookup", held=False),
            ),
        )
        route(TableStatistics, self.table_statistics)
        route(ExportTable, self.export_table)
        route(RestoreTable, self.restores.restore_table)
        route(SaveCheckpoint, self.save_checkpoint)

    def plan(
        self, grads: Iterable[tuple[str, Any, Any]], prefix: str, specs: dict[str, float]
    ) -> list[Planned]:
        """The tables' sparse gradients of an ``opt/apply``, checked whole (nothing changes),
        for :meth:`apply`."""
        planned = []
        for name, table, ids, grad in self.check_gradients(grads):
            pos = table.locate_update(ids)
            if pos is None:
                raise InvalidArgumentError(
                    f"opt/apply: the ids of table {name!r} must be distinct "
                    "(merge the rows of a repeated id first)"
                )
            slots = {slot: (f"{prefix}/{slot}", init) for slot, init in specs.items()}
            planned.append(Planned(table, ids, grad, slots, table.found(pos)))
        return planned

    @staticmethod
    def apply(planned: list[Planned], rule: Callable[..., None], cfg: dict[str, Any], step: int) -> None:
        """The optimizer's step on each table's part, one after the other. An update may
        give a table twice (its parts applied in turn, as given): a part's rows are those
        planned unless an earlier part moved rows since (a tiered table brings back on the
        loop rows no stage did, and may move others out to make room), and then found
        again, never another id's row taken for its own."""
        for part in planned:
            pos = part.table.positions_now(part.ids, part.found)
            part.table.apply(rule, part.ids, part.grad, part.slots, cfg, step, pos)

    def check_gradients(
        self, grads: Iterable[tuple[str, Any, Any]], *, held: bool = True
    ) -> list[tuple[str, DynamicTable, np.ndarray, np.ndarray]]:
        """``(name, table, ids, values)`` of each table's sparse gradient, checked as far as
        the rows' places do not matter (names, ids, slices held, the values' shape). Not
        ``held``: only the gradients of tables here, and not whether their slices still are
        (before the fence, which may answer a retry with its first attempt's reply)."""
        checked = []
        for name, ids, values in grads:
            if not held and name not in self.tables:
                continue
            table = self.table(name)
            ids = _table_ids(ids, f"sparse gradient of table {name!r}")
            if held:
                self.guards.check(name, ids)
            grad = np.asarray(values)
            if grad.shape != (ids.size, table.config.dim) or grad.dtype.kind not in "fiu":
                raise InvalidArgumentError(
                    f"sparse gradient of table {name!r}: values must be ({ids.size}, "
                    f"{table.config.dim}) numbers, got {grad.shape} {grad.dtype}"
                )
            checked.append((name, table, ids, grad))
        return checked

    def table(self, name: str) -> DynamicTable:
        table = self.tables.get(name)
        if table is None:
            self._not_aside(name)
            raise NotFoundError(f"dynamic table {name!r} not found on {self.task}")
        return table

    def _not_aside(self, name: str) -> None:
        """FailedPreconditionError if table ``name`` is set aside for a restore in place (a
        request of its rows waits for it; others are refused meanwhile)."""
        if name in self.restores.asides:
            raise FailedPreconditionError(
                f"dynamic table {name!r} is set aside on {self.task}'s disk while a restore "
                "replaces it (both do not fit its --memory-budget): ask again once the restore ends"
            )

    def create_table(self, req: CreateTable) -> CreatedReply:
        """Create a table's shard here; the same configuration again is a no-op, another
        owner's table of that name is taken over (a restarted coordinator)."""
        config = TableConfig(**msgspec.structs.asdict(req.config))
        if (req.shard is None) != (req.num_shards is None) or (
            req.shard is not None and req.num_shards is not None and req.shard >= req.num_shards
        ):
            raise InvalidArgumentError(f"dyn/create of {req.name!r}: shard {req.shard} of {req.num_shards}")
        if req.owned is not None and (req.shard is not None or not req.owned.owned):
            raise InvalidArgumentError(
                f"dyn/create of {req.name!r}: a shard and slices given both, or no slice owned"
            )
        self._not_aside(req.name)
        existing = self.tables.get(req.name)
        if existing is not None and (existing.owner == req.owner or req.owner is None):
            if req.name in self.guards or existing.capacity_reshared:
                # slices moved, or a restore shared the capacity by the rows each ps restored:
                # its share is this ps's own now (a handle that did neither cannot know it)
                config = dataclasses.replace(config, capacity=existing.config.capacity)
            if existing.config != config:
                raise AlreadyExistsError(
                    f"dynamic table {req.name!r} exists on {self.task} with another configuration "
                    f"({existing.config.as_dict()})"
                )
            if req.shard is not None and req.num_shards is not None and req.name not in self.guards:
                self.feed.placed(req.name, req.shard, req.num_shards)
            return CreatedReply(created=0)
        table = self.new_table(req.name, config, req.owner)  # checks first
        self.taken_over(existing, req.owner)
        self.put(req.name, table)
        self.guards.set(req.name, req.owned)
        if req.owned is not None:
            self.feed.placed(req.name, req.owned.owned, req.owned.slices)
        elif req.shard is not None and req.num_shards is not None:
            self.feed.placed(req.name, req.shard, req.num_shards)
        self.feed.replaced(req.name, self.checkpoints.store.clock.epoch)
        return CreatedReply(created=1)

    def taken_over(self, existing: DynamicTable | None, owner: str | None) -> None:
        if existing is not None and existing.owner != owner and self.on_takeover is not None:
            self.on_takeover({existing.owner}, owner)

    def lookup_table(self, req: LookupTable) -> ValuesReply:
        return self._lookups([(req.name, req.ids)], req.train, req.as_of, "dyn/lookup")

    def lookup_tables(self, req: LookupTables) -> ValuesReply:
        """The tables' half of a ``dyn/lookup_many`` (the ps routes it: its reads of
        variables are the store's)."""
        return self._lookups([(x.name, x.ids) for x in req.lookups], req.train, req.as_of, "dyn/lookup_many")

    def check_lookups(
        self, lookups: list[tuple[str, Any]], op: str, *, held: bool = True
    ) -> list[tuple[str, DynamicTable, np.ndarray]]:
        """``(name, table, ids)`` of each lookup, checked as far as the rows' places do not
        matter (names, ids, slices held, the reply's size); nothing read or changed. Not
        ``held``: not whether the ids' slices are here (a pass over the ids the handler
        makes anyway)."""
        if len({name for name, _ in lookups}) != len(lookups):
            raise InvalidArgumentError(f"{op}: a table is named more than once (name each once)")
        checked = []
        nbytes = 0
        for name, raw in lookups:
            table = self.table(name)
            ids = _table_ids(raw, f"{op} of {name!r}")
            if held:
                self.guards.check(name, ids)
            nbytes += ids.size * table.config.dim * table.dtype.itemsize
            if nbytes > self.max_gather_bytes:
                raise InvalidArgumentError(
                    f"{op} of {name!r}: the reply would be more than "
                    f"this ps's limit of {self.max_gather_bytes} bytes"
                )
            checked.append((name, table, ids))
        return checked

    def _lookups(self, lookups: list[tuple[str, Any]], train: bool, as_of: Any, op: str) -> ValuesReply:
        """Rows of each ``(table, ids)``: everything checked (names, slices held, sizes,
        distinct ids) before the first row is admitted."""
        planned = []
        for name, table, ids in self.check_lookups(lookups, op):
            pos = table.locate(ids)
            if pos is None:
                raise InvalidArgumentError(f"{op} of {name!r}: ids must be distinct (look up each id once)")
            planned.append((name, table, ids, pos))
        values = []
        for name, table, ids, pos in planned:
            rows = table.lookup(ids, train, pos)
            if as_of is not None and self.as_of is not None:  # see before_images.py
                rows = self.as_of(name, as_of, ids, rows)
            values.append(rows)
        return ValuesReply(values=values)

    def table_statistics(self, req: TableStatistics) -> dict[str, Any]:
        return self.table(req.name).statistics()

    def export_table(self, req: ExportTable) -> dict[str, Any]:
        table = self.table(req.name)
        # sized before anything is gathered (a tiered table's rows on disk are read for it)
        nbytes = len(table) * (8 + table.config.dim * table.dtype.itemsize * (1 + len(table.slots)))
        if nbytes > self.max_gather_bytes:
            raise InvalidArgumentError(
                f"dyn/export of {req.name!r}: {nbytes} bytes, more than this ps's limit of "
                f"{self.max_gather_bytes}; save a checkpoint and read it with load_variables"
            )
        exported = table.export()
        return {
            "ids": exported.pop("ids"),
            "rows": exported.pop("rows"),
            "slots": {k[5:]: v for k, v in exported.items()},
            "slot_init": table.slot_init,
            "stats": table.statistics(),
        }

    def _take_shard(self, name: str, path: str, slots: dict[str, str] | None) -> tuple[Pending, int]:
        """Table ``name``'s shard as it is now (its arrays through snapshots: an update keeps
        only the old values of the rows it changes), to be written to ``path`` (with the
        files it links: ``Pending.links``); and its rows."""
        table = self.table(name)
        rename = slots if slots is not None else {k: k for k in table.slot_init}
        tensors: Tensors = []
        pending = self.checkpoints.take(path, tensors)
        save = table.snapshot()
        pending.releases.append(functools.partial(table.end_snapshot, save))
        # (before the tensors' shapes are taken: the rows of a linked file are not written)
        links = table.save_links(save, os.path.dirname(pending.real), rename)
        tensors.extend(shard_tensors(table, save, rename))
        for k, (source, mask) in enumerate(links):
            tensors.append(whole(f"{LINKED}{k}", mask))
            pending.links.append((source, link_name(pending.real, k)))
        return pending, table.statistics()["rows"]

    async def save_checkpoint(self, req: SaveCheckpoint) -> SaveReply:
        """Variables, and the table shards ``req.tables``, each to its file, all taken in
        one step (no ``await`` between them), so the files hold this ps at one moment: an
        ``opt/apply`` that updates a variable and a table is in both or in neither. With
        tables and no variables, no variables file is written."""
        taken: list[Pending] = []
        rows: dict[str, int] = {}
        links: dict[str, int] = {}
        try:
            if req.tensors or not req.tables:
                taken.append(self.checkpoints.take_variables(req))
            for shard in req.tables:
                pending, rows[shard.name] = self._take_shard(shard.name, shard.path, shard.slots)
                taken.append(pending)
                if pending.links:
                    links[shard.name] = len(pending.links)
        except BaseException:
            for pending in taken:
                pending.release()
            raise
        results = await asyncio.gather(*(self.checkpoints.write(p) for p in taken), return_exceptions=True)
        written = [r for r in results if not isinstance(r, BaseException)]
        if len(written) != len(results):
            raise next(r for r in results if isinstance(r, BaseException))
        for shard in req.tables:
            self.feed.saved(shard.name, shard.path)
        return SaveReply(
            path=req.path, bytes=sum(r["bytes"] for r in written), table_rows=rows, table_links=links
        )


def _table_ids(ids: Any, what: str) -> np.ndarray:
    """Ids of a dynamic table: a 1-D int64 array (uint64 is viewed as int64)."""
    arr = np.asarray(ids)
    if arr.ndim != 1 or arr.dtype.kind not in "iu" or arr.dtype.itemsize > 8:
        raise InvalidArgumentError(f"{what}: ids must be a 1-D integer array, got {arr.dtype} {arr.shape}")
    if arr.dtype == np.uint64:
        return arr.view(np.int64)
    return arr.astype(np.int64, copy=False)
