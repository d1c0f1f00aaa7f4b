"""A ps's side of moving variables to another ps while training runs (an elastic ps joined
or leaves); ``_formats/messages/placement_map.py`` gives the steps, the coordinator drives them.

On the ps that receives them, :meth:`Moves.pull` asks the giving ps for the copies itself
(the bytes cross once, from ps to ps; the coordinator sends the steps, not the rows). On
the ps that gives variables away: :meth:`Moves.move_out` copies them (pinned, not
copied until an update writes them) and marks the change clock; :meth:`Moves.finish`
stops serving them, in one step on the loop, and answers with the rows changed since the
mark; :meth:`Moves.end` drops them (or serves them again if the move failed). On the ps
that receives them: :meth:`Moves.install` stages the copies, then applies the changed
rows and serves them. Between the two, each side refuses the variables with
:class:`~pstrain.errors.PlacementChangedError` carrying its newest map, so a client sends
its request where they are now.

A move whose coordinator stopped part way is not left half done for good: a stage that
waited :data:`MOVE_TTL_S` for its next step ends as aborted (leaving what a later move of
the same variables set up since); variables parked on the source after step 3, the only
copy until the move ends, go when a newer coordinator takes this ps over (it restores
them). Every step names its coordinator (``owner``): a step of another's move, or of a
coordinator taken over, is refused, so an old one that wakes up cannot undo a move over
what the new one restored; the new one takes over what the old one left on a ps it moves
variables to.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import numpy as np

from ...._base.cluster import task_name
from ...._base.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    PstrainError,
    ResourceExhaustedError,
    restated,
)
from ...._formats.messages.placement_map import (
    EndMove,
    EndReply,
    FinishMove,
    FinishReply,
    InstallReply,
    InstallVariables,
    MoveOut,
    MoveOutReply,
    MoveRecords,
    PullMove,
    PullReply,
    ReadRecords,
    RecordsBlock,
    RecordsReply,
    SliceSet,
    TableCopy,
    TablePatch,
    VariableCopy,
    VariablePatch,
)
from ...._serving.core import Pinned, Router
from ...._transport.channels import Channel
from ..fencing import Fencing
from ..store import VariableRecord, VariableStore
from ..tables.dynamic_table import TableConfig
from ..tables.handlers import TableHandlers
from ..tables.moved_records import records_of
from ..tables.tiered_slices import CopyStream, TieredSlices
from .ps_map import PsMap
from .stages import Stages

__all__ = ["MOVE_TTL_S", "Moves"]

logger = logging.getLogger(__name__)

#: Seconds a move's stage may wait for its next step before it is dropped (the coordinator
#: sends each step within its request timeout, 120 s, of the step before).
MOVE_TTL_S = 300.0
#: The most bytes of records one ``ps/move_records`` answers with.
MAX_RECORDS_BYTES = 16 << 20


class Moves:
    """The moves in and out of one ps."""

    def __init__(
        self,
        store: VariableStore,
        fencing: Fencing,
        max_store_bytes: int,
        tables: TableHandlers,
        connect: Callable[[str, int], Channel],
    ) -> None:
        self.store = store
        #: A channel to ps ``index`` at ``address`` (this ps's token and TLS): a pull's.
        self.connect = connect
        self.fencing = fencing
        self.max_store_bytes = max_store_bytes
        self.tables = tables
        #: stage -> the slices of each table moving out; then, parked (no longer served):
        #: (table, slices moving, the slices it served before, its capacity after)
        self.outgoing_tables: dict[str, dict[str, SliceSet]] = {}
        self.parked_tables: dict[str, list[tuple[str, SliceSet, SliceSet | None, int | None]]] = {}
        #: stage -> tables receiving slices: (the copy, the slices served before, created here)
        self.incoming_tables: dict[str, list[tuple[TableCopy, SliceSet | None, bool]]] = {}
        #: stage -> table -> its copy, read a block at a time by the ps it goes to (a
        #: tiered table's: ``ps/move_records``), until the source stops serving the slices
        self.streams: dict[str, dict[str, CopyStream]] = {}
        #: stage -> table -> the blocks of its copy pulled here, until the switch
        self.pulled: dict[str, dict[str, Any]] = {}
        #: stage -> the keys being moved out (copied, still served) or parked (no longer served)
        self.outgoing: dict[str, list[str]] = {}
        self.parked: dict[str, list[tuple[VariableRecord, str | None]]] = {}
        #: stage -> the copies staged here, not served yet: (copy, its slots)
        self.incoming: dict[str, list[VariableCopy]] = {}
        #: who started each stage, and the timers that end them after MOVE_TTL_S
        self.stages = Stages(self._expire)
        self.map = PsMap(store)  # the placement map this ps knows
        store.staged.append(self.staged_bytes)
        fencing.on_supersede.append(self._superseded)

    def install_routes(self, route: Router) -> None:
        """Route the move operations (and the placement map's) to their handlers here."""
        self.map.install(route)
        route(MoveOut, self.move_out)
        route(PullMove, self.pull)
        route(FinishMove, self.finish)
        route(InstallVariables, self.install)
        route(EndMove, self.end)
        route(ReadRecords, self.read_records)
        route(MoveRecords, self.move_records)

    def read_records(self, req: ReadRecords) -> RecordsReply:
        """The exactly-once records of variables ``req.names`` here."""
        return RecordsReply(once=self.fencing.records_of(set(req.names)))

    async def move_out(self, req: MoveOut) -> Pinned[MoveOutReply]:
        """Step 1: each variable with its slots, as it is now (pinned), and the clock's mark;
        a tiered table's rows on disk are read on a thread, after the mark (their records,
        which never change, at the places they had then)."""
        if req.stage in self.outgoing or req.stage in self.parked:
            raise InvalidArgumentError(f"ps/move_out: stage {req.stage!r} is already in use")
        records = [self.store.get(k) for k in req.keys]  # all or nothing
        tables = [(self.tables.table(name), moving) for name, moving in req.tables.items()]
        for name, moving in req.tables.items():
            self._check_held(name, moving)
        copies, releases = [], []
        for record in records:
            for r, slot_of in [(record, None)] + [(s, record.name) for s in self.store.slots_of(record.name)]:
                releases.append(r.pin())
                copies.append(
                    VariableCopy(
                        name=r.name, value=r.array, trainable=r.trainable, owner=r.owner, slot_of=slot_of
                    )
                )
        begun: list[tuple[dict[str, Any], Callable[[], Awaitable[None]] | None]] = []
        streams: dict[str, CopyStream] = {}
        for (table, moving), name in zip(tables, req.tables, strict=True):
            if req.pull_records and isinstance(table, TieredSlices):  # pulled a block at a time
                out, streams[name] = table.stream_copy(moving)
                begun.append((out, None))
            else:
                begun.append(table.begin_copy(moving))
        mark = self.store.clock.mark()  # (the copies are of this moment: nothing awaited since)
        if streams:
            self.streams[req.stage] = streams
        self.outgoing[req.stage] = list(req.keys)
        self.outgoing_tables[req.stage] = dict(req.tables)
        self.stages.start("out", req.stage, req.owner, MOVE_TTL_S)

        def release() -> None:
            for r in releases:
                r()

        try:
            await _read_all([read for _, read in begun])
        except BaseException:
            release()
            self.outgoing.pop(req.stage, None)
            self.outgoing_tables.pop(req.stage, None)
            self._close_streams(req.stage)
            self.stages.ended("out", req.stage)
            raise
        table_copies = [TableCopy(**out) for out, _ in begun]
        return Pinned(MoveOutReply(mark=mark, vars=copies, tables=table_copies), release)

    async def move_records(self, req: MoveRecords) -> RecordsBlock:
        """Rows of a copy ``ps/move_out`` took in ``req.stage`` to be pulled (its
        ``CopyStream``), read on a thread: a block of at most ``req.max_bytes`` (and
        :data:`MAX_RECORDS_BYTES`)."""
        self.stages.check("out", req)
        stream = self.streams.get(req.stage, {}).get(req.name)
        if stream is None:
            raise FailedPreconditionError(
                f"ps/move_records: no copy of table {req.name!r} is being pulled from "
                f"{self.store.task} in move {req.stage!r}"
            )
        records, slots = await asyncio.to_thread(
            stream.read, req.start, req.count, min(req.max_bytes, MAX_RECORDS_BYTES)
        )
        return RecordsBlock(records=records, record_slots=list(slots))

    async def pull(self, req: PullMove) -> PullReply:
        """Steps 1 and 2 here, the receiving ps: ``ps/move_out`` asked of the source by this
        ps, for the coordinator that sent ``req`` (its owner), and the copies staged as
        :meth:`install` stages them. The source's refusal is this request's, saying so."""
        if req.stage in self.incoming:
            raise InvalidArgumentError(f"ps/move_pull: stage {req.stage!r} is already in use")
        if task_name("ps", req.source_index) == self.store.task:
            raise InvalidArgumentError(
                f"ps/move_pull: {self.store.task} is ps {req.source_index}: nothing to pull"
            )
        try:
            channel = self.connect(req.source_address, req.source_index)
        except PstrainError as exc:
            raise restated(exc, f"ps/move_pull: {exc.message or exc}") from exc
        channel.owner = req.owner
        try:
            out = await channel.request(
                MoveOut(keys=req.keys, stage=req.stage, tables=req.tables, pull_records=True),
                timeout=req.timeout,
            )
            staged, nbytes = self._stage_pulled(req, out)
            for copy in out.tables:
                if copy.record_count:
                    nbytes += await self._pull_records(req, channel, copy)
        except PstrainError as exc:
            raise restated(
                exc,
                f"ps/move_pull: {self.store.task} asked ps {req.source_index} "
                f"({req.source_address}) for the copies: {exc.message or exc}",
            ) from exc
        finally:
            await channel.close()
        return PullReply(mark=out.mark, staged=staged, nbytes=nbytes)

    def _stage_pulled(self, req: PullMove, out: MoveOutReply) -> tuple[int, int]:
        """Stage what ``ps/move_out`` answered (as :meth:`install` stages copies), each
        table's copy with the slices it serves here after the move and its capacity; the
        copies staged, and the bytes they carried."""
        copies = [
            msgspec.structs.replace(
                c,
                serving=req.serving.get(c.name),
                config=msgspec.structs.replace(c.config, capacity=req.capacity.get(c.name)),
            )
            for c in out.tables
        ]
        staged = self.install(
            InstallVariables(stage=req.stage, vars=out.vars, tables=copies, owner=req.owner)
        )
        nbytes = sum(int(getattr(c.value, "nbytes", 0)) for c in out.vars) + sum(c.nbytes for c in copies)
        return staged.staged, nbytes

    async def _pull_records(self, req: PullMove, channel: Channel, copy: TableCopy) -> int:
        """The rows of ``copy`` its source keeps to be pulled, a block at a time (the next
        asked for while this one is taken in: written to disk here, if the table is tiered),
        until the switch (:meth:`install`); the bytes pulled."""
        sink = self.tables.table(copy.name).pull_sink(copy.name)
        self.pulled.setdefault(req.stage, {})[copy.name] = sink

        def ask(start: int) -> asyncio.Task[RecordsBlock]:
            block = MoveRecords(stage=req.stage, name=copy.name, start=start, count=copy.record_count - start)
            return asyncio.ensure_future(channel.request(block, timeout=req.timeout))

        got = nbytes = 0
        nxt: asyncio.Task[RecordsBlock] | None = ask(0)
        try:
            while nxt is not None:
                block = await nxt
                records = sink.checked(block.records, block.record_slots)
                if not records.size:
                    raise FailedPreconditionError(
                        f"ps/move_records: the copy of table {copy.name!r} ended after {got} of "
                        f"its {copy.record_count} rows"
                    )
                got += records.size
                nxt = ask(got) if got < copy.record_count else None  # (asked while this one is put)
                current = self.pulled.get(req.stage, {}).get(copy.name)
                if current is None or current is not sink:
                    raise FailedPreconditionError(f"ps/move_pull: move {req.stage!r} ended meanwhile")
                sink.put(records, block.record_slots)
                nbytes += records.nbytes
        finally:
            if nxt is not None:
                nxt.cancel()
        if got != copy.record_count:
            raise FailedPreconditionError(
                f"ps/move_records: {got} rows of table {copy.name!r} pulled, not {copy.record_count}"
            )
        return nbytes

    def _check_held(self, name: str, moving: SliceSet) -> None:
        """InvalidArgumentError unless this ps holds every slice of ``moving`` of table
        ``name`` (its shard as created, ``s % n == shard``, or the slices moves gave it)."""
        placed = self.tables.feed.placement.get(name)
        if placed is None:
            return  # created by a coordinator that did not say: the next step checks
        shard, num = placed
        if isinstance(shard, int):
            held = (
                {s for s in range(moving.slices) if s % num == shard} if moving.slices % num == 0 else set()
            )
        else:
            held = set(shard) if moving.slices == num else set()
        missing = sorted(set(moving.owned) - held)
        if missing:
            raise InvalidArgumentError(
                f"ps/move_out: {self.store.task} does not hold slices {missing} of "
                f"{moving.slices} of table {name!r} (it holds {sorted(held)}); nothing moved"
            )

    async def finish(self, req: FinishMove) -> FinishReply:
        """Step 3, atomic on the loop: stop serving the variables and answer with what
        changed since the mark, and their exactly-once records. (A tiered table's rows on
        disk changed since are read on a thread after it: the slices are no longer served,
        so they are as they were.)"""
        self.stages.check("out", req)
        keys = self.outgoing.get(req.stage)
        tables = self.outgoing_tables.get(req.stage, {})
        if (
            keys is None
            or sorted(keys) != sorted(req.keys)
            or tables != req.tables
            or set(req.serving) != set(tables)
        ):
            raise FailedPreconditionError(
                f"ps/move_finish: no move {req.stage!r} of these variables and table slices started here"
            )
        self.stages.stop_timer("out", req.stage)  # parked now: kept until the move ends
        self._close_streams(req.stage)  # (its receiver pulled them before this step)
        self.map.adopt(req.placement, req.owner)
        table_patches, parked_tables = [], []
        patch_reads = []
        for name, moving in tables.items():
            table = self.tables.table(name)
            parked_tables.append(
                (name, moving, self.tables.guards.get(name), req.capacity.get(name, table.config.capacity))
            )
            self.tables.guards.set(name, req.serving[name])  # refused from now on
            patch, read = table.begin_patch(moving, req.mark)
            table_patches.append(patch)
            patch_reads.append(read)
        del self.outgoing_tables[req.stage]
        self.parked_tables[req.stage] = parked_tables
        patches: list[VariablePatch] = []
        parked: list[tuple[VariableRecord, str | None]] = []
        for key in keys:
            for i, record in enumerate(self.store.take(key)):
                rows = record.changed_rows(req.mark)
                if rows is None:
                    patches.append((record.name, None, record.array))
                elif rows.size:
                    patches.append((record.name, rows, record.array[rows]))
                parked.append((record, key if i else None))  # the first is the variable
            self.store.away[key] = "moved away from"
        del self.outgoing[req.stage]
        self.parked[req.stage] = parked
        fences, superseded = self.fencing.state()
        once = self.fencing.records_of(set(keys) | set(tables))
        await _read_all(patch_reads)
        return FinishReply(
            patches=patches,
            once=once,
            fences=fences,
            superseded=superseded,
            tables=[TablePatch(**patch) for patch in table_patches],
        )

    def install(self, req: InstallVariables) -> InstallReply:
        """Steps 2 (stage copies) and 4 (apply the changed rows, serve them)."""
        if not req.activate:
            if req.stage in self.incoming:
                raise InvalidArgumentError(f"ps/install: stage {req.stage!r} is already in use")
            stale = self._stale(req)
            for copy in req.vars:
                if not isinstance(copy.value, np.ndarray):
                    raise InvalidArgumentError(f"ps/install: {copy.name!r} carries no array")
                if copy.name in self.store and copy.name not in stale:
                    raise InvalidArgumentError(
                        f"ps/install: {copy.name!r} already exists on {self.store.task}"
                    )
            added = sum(c.value.nbytes for c in req.vars) + sum(c.nbytes for c in req.tables)
            held = self.tables.held() - sum(  # (variables and tables)
                h.nbytes for h in stale.values() if isinstance(h, VariableRecord)
            )
            if held + added > self.max_store_bytes:
                raise ResourceExhaustedError(
                    f"{self.store.task} cannot take {added} bytes more: it holds "
                    f"{held} of its {self.max_store_bytes} (--max-store-bytes)"
                )
            self.store.check_budget(  # (the tables' copies check theirs as they are staged)
                sum(c.value.nbytes for c in req.vars)
                - sum(h.nbytes for h in stale.values() if isinstance(h, VariableRecord)),
                "ps/install",
            )
            self._take_over(stale, req.owner)
            arriving = self._stage_tables(req.tables)
            self.incoming[req.stage] = list(req.vars)
            self.incoming_tables[req.stage] = arriving
            self.stages.start("in", req.stage, req.owner, MOVE_TTL_S)
            for copy in req.vars:
                if copy.slot_of is None:
                    self.store.away[copy.name] = "is arriving at"
            return InstallReply(staged=len(req.vars) + len(req.tables))
        if req.stage not in self.incoming:
            raise FailedPreconditionError(f"ps/install: nothing staged as {req.stage!r}")
        self.stages.check("in", req)
        table_patches = {p.name: p for p in req.table_patches}
        missing = [
            c.name for c, _, _ in self.incoming_tables.get(req.stage, []) if c.name not in table_patches
        ]
        if missing:
            raise InvalidArgumentError(f"ps/install: no patch of the table slices {missing}")
        staged = self.incoming.pop(req.stage)
        staged_tables = self.incoming_tables.pop(req.stage, [])
        self.stages.ended("in", req.stage)
        # the received arrays are this ps's own (a large body lands in a buffer of its own):
        # kept as they are, not copied (a copy of 1 GiB into fresh pages takes seconds here)
        arrays = {c.name: c.value if c.value.flags.writeable else np.array(c.value) for c in staged}
        for name, rows, values in req.patches:
            if name not in arrays:
                raise InvalidArgumentError(f"ps/install: a patch names {name!r}, not staged")
            try:
                if rows is None:
                    arrays[name] = np.array(values).reshape(arrays[name].shape)
                else:
                    arrays[name][np.asarray(rows)] = values
            except (IndexError, ValueError, TypeError) as exc:  # nothing is served yet
                raise InvalidArgumentError(f"ps/install: a bad patch of {name!r}: {exc}") from None
        pulled = self.pulled.get(req.stage, {})
        merges = [
            self.tables.table(arrived.name).checked_merge(
                arrived, table_patches[arrived.name], pulled.get(arrived.name)
            )
            for arrived, _, _ in staged_tables
        ]  # every table's checked before any is served
        for copy in staged:
            self.store.put(copy.name, arrays[copy.name], copy.trainable, slot_of=copy.slot_of)
            record = self.store.get(copy.name)
            record.owner = copy.owner
            self.store.away.pop(copy.name, None)
        self.pulled.pop(req.stage, None)  # (taken in by the merges)
        for (arrived, _, _), merge in zip(staged_tables, merges, strict=True):
            merge()
            self.tables.table(arrived.name).with_capacity(arrived.config.capacity)
            assert arrived.serving is not None  # (checked when staged)
            self.tables.guards.set(arrived.name, arrived.serving)
            self.tables.feed.moved(
                arrived.name, arrived.serving.owned, arrived.serving.slices, self.store.clock.epoch
            )
        self.fencing.adopt(req.once, req.fences, req.superseded)
        if req.placement is not None:
            self.map.adopt(req.placement, req.owner)
        return InstallReply(installed=len(staged) + len(staged_tables))

    def _stale(self, req: InstallVariables) -> dict[str, Any]:
        """What this ps holds under the names of the arriving copies for a coordinator other
        than theirs: a ps that served an old coordinator, admitted again by a new one, which
        takes it over as a creation does. Name -> the variable, slot or table held."""
        arriving: list[tuple[str, str | None, Any]] = [
            (c.name, c.owner, self.store.find(c.name)) for c in req.vars
        ]
        arriving += [(c.name, c.owner, self.tables.tables.get(c.name)) for c in req.tables]
        return {
            name: held
            for name, owner, held in arriving
            if held is not None and None not in (owner, held.owner) and held.owner != owner
        }

    def _take_over(self, stale: dict[str, Any], owner: str | None) -> None:
        """Supersede the coordinators that left ``stale`` here: what they left goes with
        that (:meth:`_superseded`)."""
        if stale:
            logger.warning("%s: %s of an old coordinator taken over", self.store.task, sorted(stale))
            self.fencing.supersede({held.owner for held in stale.values()}, owner)

    def _stage_tables(self, copies: list[TableCopy]) -> list[tuple[TableCopy, SliceSet | None, bool]]:
        """Check the copies of table slices arriving (all or nothing), then refuse their ids
        here until the move switches (a table new here is made empty, serving nothing)."""
        checked = []
        for copy in copies:
            if (
                copy.moving is None
                or copy.serving is None
                or copy.moving.slices != copy.serving.slices
                or not set(copy.moving.owned) <= set(copy.serving.owned)
            ):
                raise InvalidArgumentError(
                    f"ps/install: the slices of table {copy.name!r} moving "
                    "and served after the move do not agree"
                )
            try:
                config = TableConfig(**msgspec.structs.asdict(copy.config))
            except InvalidArgumentError as exc:
                raise InvalidArgumentError(f"ps/install: table {copy.name!r}: {exc}") from None
            records_of(copy, config.dim, np.dtype(config.dtype))  # (rows on disk at the source)
            existing = self.tables.tables.get(copy.name)
            # (tiered if this ps has a budget: a ps that joins holds its share within it)
            table = existing or self.tables.new_table(copy.name, config, copy.owner)
            if table.config.dim != config.dim or table.config.dtype != config.dtype:
                raise InvalidArgumentError(
                    f"ps/install: table {copy.name!r} is {table.config.dim} "
                    f"{table.config.dtype} here, not {config.dim} {config.dtype}"
                )
            checked.append((copy, table, existing))
        staged = []
        for copy, table, existing in checked:
            assert copy.serving is not None and copy.moving is not None
            if existing is None:
                self.tables.put(copy.name, table)
            staged.append((copy, self.tables.guards.get(copy.name), existing is None))
            before = sorted(set(copy.serving.owned) - set(copy.moving.owned))
            self.tables.guards.set(copy.name, SliceSet(slices=copy.serving.slices, owned=before))
        return staged

    def end(self, req: EndMove) -> EndReply:
        """Step 5: drop the parked copies (committed) or serve them again (aborted); on the
        receiving side, aborted: drop what was staged."""
        self.stages.check("out", req)
        self.stages.check("in", req)
        parked = self.parked.pop(req.stage, None)
        keys = self.outgoing.pop(req.stage, None)
        if parked is not None and not req.commit:
            for record, slot_of in parked:
                if record.name in self.store:  # created here since: not replaced by the old copy
                    logger.warning(
                        "%s: move %s undone, but %r was created here since: kept",
                        self.store.task,
                        req.stage,
                        record.name,
                    )
                    continue
                self.store.away.pop(record.name, None)
                self.store.put(record.name, record.array, record.trainable, slot_of=slot_of)
                self.store.get(record.name).owner = record.owner
        self.stages.ended("out", req.stage)
        self.stages.ended("in", req.stage)
        staged = self.incoming.pop(req.stage, None)
        for copy in staged or ():  # clients may route here by the aborted move's map
            if copy.slot_of is None:
                self.store.away[copy.name] = "moved away from"
        tables = self._end_tables(req.stage, req.commit)
        return EndReply(ended=parked is not None or keys is not None or staged is not None or tables)

    def _close_streams(self, stage: str) -> None:
        """The copies of ``stage`` no longer pulled from here: their tables are no longer
        saved by them."""
        for stream in self.streams.pop(stage, {}).values():
            stream.close()

    def _forget_pulled(self, stage: str) -> None:
        """The rows of ``stage``'s copies pulled here, never switched to: they go."""
        for sink in self.pulled.pop(stage, {}).values():
            sink.forget()

    def _end_tables(self, stage: str, commit: bool) -> bool:
        """A move's end for its table slices: dropped from the source (committed) or served
        there again; a receiving ps that never switched forgets what it staged."""
        self._close_streams(stage)
        self._forget_pulled(stage)
        self.outgoing_tables.pop(stage, None)
        parked = self.parked_tables.pop(stage, None)
        for name, moving, before, capacity in parked or ():
            table = self.tables.tables.get(name)
            if table is None:
                continue
            if commit:
                table.drop_slices(moving)
                table.with_capacity(capacity)
                after = self.tables.guards.get(name)
                if after is not None:
                    self.tables.feed.moved(name, after.owned, after.slices, self.store.clock.epoch)
            else:
                self.tables.guards.set(name, before)
        staged = self.incoming_tables.pop(stage, None)
        for copy, before, created in staged or ():
            if created:
                self.tables.drop(copy.name)
            self.tables.guards.set(copy.name, before)
        return parked is not None or staged is not None

    def _superseded(self, owners: set[str]) -> None:
        """A newer coordinator took this ps over from ``owners``: the moves they left half
        done here end as aborted (their steps are refused from now on), what they parked
        after step 3 goes (the new coordinator restores those variables itself), and so
        do their map and their variables and tables still here."""
        for side, stage in self.stages.of(owners):
            logger.warning("%s: move %s of a coordinator taken over ended as aborted", self.store.task, stage)
            if side == "out":
                self.outgoing.pop(stage, None)
                self.outgoing_tables.pop(stage, None)
                self._close_streams(stage)
                self.parked.pop(stage, None)
                self.parked_tables.pop(stage, None)  # (their rows go with the table it replaces)
            else:
                self._drop_incoming(stage)
        self.map.superseded(owners, {c.name for staged in self.incoming.values() for c in staged})
        # what they left here that the new one did not take over by name (a variable they
        # moved here, say) serves no one now: it goes
        self.store.take_all(set(owners))
        for name in [n for n, t in self.tables.tables.items() if t.owner in owners]:
            self.tables.drop(name)
            self.tables.guards.set(name, None)

    def _expire(self, side: str, stage: str) -> None:
        """A stage still waiting for its next step when its time is up: the source forgets
        its move out, the target what it staged (neither serves anything of it). Unlike an
        abort, which comes before any later move, what a later move of the same variables
        or table slices set up since is left as it is."""
        if stage not in (self.outgoing if side == "out" else self.incoming):
            return  # it went on (or ended) in time
        logger.warning(
            "%s: move %s had no next step in %g s (its coordinator stopped?): ended as aborted",
            self.store.task,
            stage,
            MOVE_TTL_S,
        )
        self.stages.ended(side, stage)
        if side == "out":
            del self.outgoing[stage]
            self.outgoing_tables.pop(stage, None)
            self._close_streams(stage)
            return
        self._drop_incoming(stage)

    def _drop_incoming(self, stage: str) -> None:
        """Forget what ``stage`` staged here, leaving what a later move of the same table
        slices set up since."""
        self.incoming.pop(stage, None)  # (a name marked arriving stays refused: no ps routes here)
        self._forget_pulled(stage)
        for copy, before, created in self.incoming_tables.pop(stage, []):
            assert copy.serving is not None and copy.moving is not None  # (checked when staged)
            mine = SliceSet(
                slices=copy.serving.slices, owned=sorted(set(copy.serving.owned) - set(copy.moving.owned))
            )
            if self.tables.guards.get(copy.name) != mine or any(
                c.name == copy.name for staged in self.incoming_tables.values() for c, _, _ in staged
            ):
                continue  # another move staged or switched slices of this table since
            if created:
                self.tables.drop(copy.name)
            self.tables.guards.set(copy.name, before)

    def staged_bytes(self) -> int:
        """The bytes of the copies staged here, variables and table slices."""
        return (
            sum(c.value.nbytes for copies in self.incoming.values() for c in copies)
            + sum(c.nbytes for staged in self.incoming_tables.values() for c, _, _ in staged)
            + sum(sink.nbytes for sinks in self.pulled.values() for sink in sinks.values())
        )

    def statistics(self) -> dict[str, Any]:
        return {
            "placement_version": self.store.placement.version,
            "placement_refusals": self.store.refusals,
            "moves_in_progress": len(self.outgoing) + len(self.parked) + len(self.incoming),
        }


async def _read_all(reads: list[Callable[[], Awaitable[None]] | None]) -> None:
    """Await every read begun (each ends what it began), then raise the first error."""
    failed: BaseException | None = None
    for read in reads:
        if read is None:
            continue
        try:
            await read()
        except BaseException as exc:
            failed = failed or exc
    if failed is not None:
        raise failed
