"""The coordinator's side of elastic parameter servers: a ps joins, a ps leaves, and the
variables move between them while training runs.

The coordinator owns the placement map (``_formats/messages/placement_map.py``: its version, the
ps addresses, the variables not on the ps they were created on). A move follows the
steps that module lists, one source ps at a time, one move at a time; each new map is
pushed to every ps, and clients learn it from the ps (a request to the wrong ps is
refused with the map, and sent again by the client). What is moved: whole variables,
sharded variables' parts, with their optimizer slots and their exactly-once records; and
slices of dynamic tables' hash spaces (``plans.py``), with their rows, slots, LRU/LFU
state, admission sightings and the table's exactly-once records, and their share of its
capacity.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from ..._base.cluster import parse_address, task_name
from ..._base.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PstrainError,
    restated,
)
from ..._base.locks import PlacementLock
from ..._base.tasks import best_effort
from ..._distribute.strategy import ParameterServerStrategy
from ..._formats.messages.operations import TableStatistics
from ..._formats.messages.placement_map import (
    EndMove,
    FinishMove,
    InstallVariables,
    PlacementMap,
    PullMove,
    SetPlacement,
    SliceSet,
    TableSlices,
    VariableCopy,
)
from ..._transport.channels import ChannelPool
from .plans import (
    plan_join,
    plan_leave,
    plan_variables_join,
    spread,
    table_slices,
    variable_shares,
    variables_on,
)

logger = logging.getLogger(__name__)

__all__ = ["PsChanges"]


class PsChanges:
    """Adds, removes and rebalances the ps of one coordinator's job."""

    def __init__(
        self, strategy: ParameterServerStrategy, channels: ChannelPool, *, timeout_s: float = 120.0
    ) -> None:
        self.strategy = strategy
        self.channels = channels
        self.timeout_s = timeout_s
        self._lock = channels.session.placement_lock  # moves (alone) and checkpoint saves (shared) take turns
        #: The move under way: (keys, from ps, to ps, when it started), for status.
        self.moving: tuple[list[str], int, int, float] | None = None
        self.moves_done = 0
        self._reserved: dict[int, str] = {}  # ps index -> the address of the ps it was given to
        #: Ps whose ``remove_ps`` is under way: nothing moves to them, and they are not
        #: counted among the ps that would remain.
        self.leaving: set[int] = set()
        self.bytes_moved = 0
        #: Lost ps being replaced from a checkpoint, and those replaced (``replace.py``).
        self.replacing: set[int] = set()
        self.replaced: list[dict[str, Any]] = []

    @property
    def placement(self) -> PlacementMap:
        return self.channels.session.routes

    def shares(self) -> dict[int, int]:
        """Bytes of variables each active ps holds (their optimizer slots not counted)."""
        return variable_shares(self.placement, self.strategy.placement.placed)

    def status(self) -> dict[str, Any]:
        """The map version, each ps's address and share, and the move under way (if any)."""
        shares = self.shares()
        moving = None
        if self.moving is not None:
            keys, src, dst, started = self.moving
            moving = {
                "variables": keys,
                "from": src,
                "to": dst,
                "seconds": round(time.monotonic() - started, 3),
            }
        slices: dict[int, dict[str, float]] = {i: {} for i in range(len(self.placement.ps))}
        for table in self.strategy.placement.tables.values():
            sliced = self.table_slices(table)
            for ps in set(sliced.owners):
                slices.setdefault(ps, {})[table.name] = round(len(sliced.held_by(ps)) / sliced.slices, 4)
        return {
            "version": self.placement.version,
            "ps": [
                {
                    "index": i,
                    "address": a,
                    "active": bool(a),
                    "bytes": shares.get(i, 0),
                    "table_shares": slices.get(i, {}),
                }
                for i, a in enumerate(self.placement.ps)
            ],
            "moving": moving,
            "moves_done": self.moves_done,
            "bytes_moved": self.bytes_moved,
            "replacing": sorted(self.replacing),
            "replaced": list(self.replaced),
        }

    def statistics(self) -> dict[str, Any]:
        """For ``/metrics`` and ``pstrain status``."""
        return {
            "placement": self.status(),
            "placement_version": self.placement.version,
            "moves_in_progress": int(self.moving is not None),
            "ps_moves": self.moves_done,
            "ps_moved_bytes": self.bytes_moved,
            "ps_replaced": len(self.replaced),
        }

    # -- the API ------------------------------------------------------------------------------
    async def add_ps(self, address: str) -> int:
        """A new, empty ps at ``address`` joins: it gets the next index, and a share of the
        variables moves to it. Returns its index."""
        index = await self.admit_ps(address)
        await self.rebalance(index)
        return index

    async def admit_ps(self, address: str, index: int | None = None) -> int:
        """Give a new ps at ``address`` the next index (or the one reserved for it), and tell
        every ps (nothing moves yet). The new map is published only once the ps answered
        as that index; if any ps refuses it, it is withdrawn (a newer map without the new
        ps): a join that fails leaves the job's ps as they were."""
        parse_address(address)
        async with self._lock:
            before = self.placement
            ps = list(before.ps)
            index = len(ps) if index is None else index
            reserved = self._reserved.pop(index, None)
            ps += [""] * (index + 1 - len(ps))  # an index given to a ps that never came: unused
            ps[index] = address
            joined = before.with_ps(ps)
            try:
                await self.channels.answers(
                    address,
                    "ps",
                    index,
                    self.timeout_s,
                    otherwise="so it did not join (the job's ps are unchanged)",
                )
                try:
                    await self.publish(joined)
                except BaseException:
                    await best_effort(
                        self.publish(before.bumped(joined.version + 1)),
                        f"withdrawing map {joined.version}",
                        logger,
                    )
                    raise
            except BaseException:
                if reserved is not None:  # the ps may ask again with the index it was given
                    self._reserved[index] = reserved
                raise
            self.strategy.placement.active = self.placement.active()
        return index

    def joins(
        self, spawn: Callable[[Coroutine[Any, Any, Any]], Any]
    ) -> Callable[[str, int | None], Awaitable[int]]:
        """What ``coordinator/join_ps`` runs. Without ``index``: the index the ps at
        ``address`` is to take (it answers to that name from then on). With it: the ps
        joins; the moves run in the background (a ps of the job asking again: its index)."""

        async def join(address: str, index: int | None) -> int:
            parse_address(address)
            if address in self.placement.ps:  # a ps of the job asking again (its reply was
                return self.placement.ps.index(address)  # lost, say): it stays as it is
            if index is None:
                asked = [i for i, a in self._reserved.items() if a == address]
                index = asked[0] if asked else len(self.placement.ps) + len(self._reserved)
                self._reserved[index] = address
                return index
            if self._reserved.get(index) != address:
                raise InvalidArgumentError(
                    f"ps index {index} was not given to {address}: ask for an index first"
                )
            index = await self.admit_ps(address, index)
            spawn(self.rebalance(index))
            return index

        return join

    async def rebalance(self, index: int) -> None:
        """Move a share of the variables to ps ``index`` (one that just joined). If a move
        fails while nothing lives on the new ps yet (it died, say), it is taken out of the
        job again before the error is raised. Each move of table slices is planned as it
        starts, under the lock: a ps leaving meanwhile may have taken the slices a plan made
        before would have asked of it. (Stops once ps ``index`` itself is asked to leave.)"""
        plan = plan_variables_join(self.placement, self.strategy.placement.placed, index)
        try:
            for keys in plan:
                await self.move(keys, index)
            before = None
            while True:  # a group of slices a turn of the lock
                async with self._lock:
                    if index in self.leaving:
                        break  # (asked to leave: what moved to it now would only move off again)
                    planned = {src: (src, index, t) for src, t in self._plan_tables_join(index).items()}
                    if not planned:
                        break
                    before = await self._move_group(planned, before)
        except PstrainError as exc:
            held = self.on(index) or any(
                self.table_slices(t).held_by(index) for t in self.strategy.placement.tables.values()
            )
            if held or index not in self.placement.active():
                raise  # part of the job lives there now: a lost ps, replaced as any other
            async with self._lock:
                await best_effort(self.retire(index), f"withdrawing {task_name('ps', index)}", logger)
            raise restated(
                exc,
                f"{task_name('ps', index)} joined but the first move to it "
                f"failed, so it was taken out of the job again (nothing had "
                f"moved to it): {exc.message}",
            ) from exc
        logger.info(
            "%s joined; %d variable(s) and a share of %d table(s) moved to it",
            task_name("ps", index),
            sum(len(k) for k in plan),
            len(self.strategy.placement.tables),
        )

    async def _move_group(self, planned: dict[int, Any], before: dict[int, Any] | None) -> dict[int, Any]:
        """The first group of ``planned`` (``(src, dst, slices)`` values), moved (the lock
        held); ``before``: the plan of the turn before, which this one must differ from
        (a move that changed nothing would be asked for again and again)."""
        if planned == before:
            raise PstrainError(f"a move of table slices left the map as it was: {planned}")
        src, dst, tables = next(iter(planned.values()))
        self._check(dst, list(tables), self.strategy.placement.tables, "dynamic tables")
        await self._move([], src, dst, tables)
        return planned

    async def remove_ps(self, index: int) -> None:
        """Move every variable off ps ``index`` (to the least loaded of the others), then
        take it out of the job: it can stop. Each move is planned as it starts, under the
        lock (a join or another leave meanwhile changes where things are)."""
        active = self.placement.active()
        if index not in active:
            raise InvalidArgumentError(f"no active ps {index!r}: the job's ps are {active}")
        if index in self.leaving:
            raise FailedPreconditionError(f"ps {index} is leaving already")
        if not [k for k in active if k != index and k not in self.leaving]:
            raise FailedPreconditionError(
                "the job's only ps cannot leave"
                if len(active) == 1
                else f"ps {sorted(self.leaving)} are leaving: ps {index} would be the last"
            )
        self.leaving.add(index)
        self.strategy.placement.active = [k for k in active if k not in self.leaving]
        before = None
        try:
            while True:  # a variable or a group of slices a turn of the lock; then the map
                async with self._lock:
                    keys = self.on(index)
                    if keys:
                        shares = self.shares()
                        target = min(
                            (k for k in shares if k != index and k not in self.leaving),
                            key=lambda k: (shares[k], k),
                        )
                        await self._move(keys[:1], index, target)
                        continue
                    tables = self.strategy.placement.tables
                    planned = {
                        dst: (index, dst, t)
                        for dst, t in plan_leave(self.placement, tables, index, self.leaving).items()
                    }
                    if planned:
                        before = await self._move_group(planned, before)
                        continue
                    ps = list(self.placement.ps)
                    ps[index] = ""
                    await self.publish(self.placement.with_ps(ps))
                    break
        finally:
            self.leaving.discard(index)
            self.strategy.placement.active = [k for k in self.placement.active() if k not in self.leaving]
        logger.info("%s left the job; its variables moved to the others", task_name("ps", index))

    async def move(self, keys: list[str], to: int) -> None:
        """Move variables ``keys`` (with their optimizer slots) to ps ``to`` while training
        runs: copy, catch up, switch."""
        placed = self.strategy.placement.placed
        self._check(to, keys, placed, "variables")
        async with self._lock:
            by_source: dict[int, list[str]] = {}
            for key in keys:
                src = self.placement.ps_of(key, placed[key][0])
                if src != to:
                    by_source.setdefault(src, []).append(key)
            for src, moving in by_source.items():
                await self._move(moving, src, to)

    @property
    def lock(self) -> PlacementLock:
        """Held alone by each move and by checkpoints' restores; saves share it."""
        return self._lock

    async def retire(self, index: int) -> None:
        """Ps ``index`` is out of the job (lost): no new variable goes there, the heartbeat
        stops watching it. Its variables stay where the map says until :meth:`install`
        puts them elsewhere. Call with :attr:`lock` held."""
        ps = list(self.placement.ps)
        ps[index] = ""
        await self.publish(self.placement.with_ps(ps))
        self.strategy.placement.active = self.placement.active()

    def spread(self, keys: list[str], to: int | None = None) -> dict[str, int]:
        """Where each of ``keys`` (largest first) goes: ps ``to``, or the least loaded (of
        those not leaving)."""
        return spread(self.placement, self.strategy.placement.placed, keys, to, self.leaving)

    async def install(
        self, copies: list[VariableCopy], where: dict[str, int], once: dict[str, list[Any]] | None = None
    ) -> None:
        """Put ``copies`` (variables with their optimizer slots, read from a checkpoint) on
        the ps ``where`` names for each variable, with the exactly-once records ``once``
        gives by variable, then route to them there (a lost ps's share, replaced). Call
        with :attr:`lock` held."""
        once = once or {}
        placed = self.strategy.placement.placed
        new = self.placement.moved_to(where, {k: placed[k][0] for k in where})
        by_ps: dict[int, list[VariableCopy]] = {}
        for copy in copies:
            by_ps.setdefault(where[copy.slot_of or copy.name], []).append(copy)

        stage = secrets.token_hex(8)
        # every ps stages its share first: one that refuses (full, say) changes nothing anywhere
        staged = await asyncio.gather(
            *(
                self.channel(ps).request(InstallVariables(stage=stage, vars=group), timeout=self.timeout_s)
                for ps, group in by_ps.items()
            ),
            return_exceptions=True,
        )
        failed = [r for r in staged if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(
                *(
                    best_effort(
                        self.channel(ps).request(EndMove(stage=stage, commit=False), timeout=self.timeout_s),
                        f"dropping staged copies on ps {ps}",
                        logger,
                    )
                    for ps in by_ps
                )
            )
            raise failed[0]

        async def activate(ps: int, group: list[VariableCopy]) -> None:
            records = [r for copy in group for r in once.get(copy.name, [])]
            await self.channel(ps).request(
                InstallVariables(stage=stage, activate=True, placement=new, once=records),
                timeout=self.timeout_s,
            )

        await asyncio.gather(*(activate(ps, group) for ps, group in by_ps.items()))
        await self.publish(new)
        self.bytes_moved += sum(int(getattr(c.value, "nbytes", 0)) for c in copies)

    # -- dynamic tables' slices ------------------------------------------------------------------
    def table_slices(self, table: Any) -> TableSlices:
        """Which ps holds each slice of ``table`` now (``plans.table_slices``)."""
        return table_slices(self.placement, table)

    def _plan_tables_join(self, new: int) -> dict[int, dict[str, list[int]]]:
        return plan_join(self.placement, self.strategy.placement.tables, new)

    def _check(self, to: int, keys: list[str], known: dict[str, Any], what: str) -> None:
        """InvalidArgumentError (nothing moves) unless ps ``to`` is active and every key is
        one of ``known``."""
        if to not in self.placement.active():
            raise InvalidArgumentError(f"no active ps {to!r}: the job's ps are {self.placement.active()}")
        unknown = [k for k in keys if k not in known]
        if unknown:
            raise InvalidArgumentError(f"not {what} of this strategy: {unknown}")

    async def move_slices(self, tables: dict[str, list[int]], src: int, dst: int) -> None:
        """Move slices ``tables`` (table key -> slices), all held by ps ``src``, to ps ``dst``."""
        known = self.strategy.placement.tables
        self._check(dst, list(tables), known, "dynamic tables")
        async with self._lock:
            for key, slices in tables.items():
                owners = self.table_slices(known[key]).owners
                if not slices or any(not 0 <= s < len(owners) or owners[s] != src for s in slices):
                    raise InvalidArgumentError(f"slices {slices} of table {key!r} are not all on ps {src}")
            await self._move([], src, dst, tables)

    async def _capacities(self, key: str, src: int, dst: int, moving: int) -> tuple[Any, Any]:
        """The capacities of ps ``src`` and ``dst``'s shards of table ``key`` once ``moving``
        of ``src``'s slices moved: its share of ``src``'s capacity moves with them."""
        table = self.strategy.placement.tables[key]
        if table.capacity is None:
            return None, None
        sliced = self.table_slices(table)
        held = len(sliced.held_by(src))
        current = []
        for ps in (src, dst):
            try:
                stats = await self.channel(ps).request(TableStatistics(name=key), timeout=self.timeout_s)
                current.append(int(stats["capacity"]))
            except NotFoundError:
                current.append(0)
        moved = current[0] if moving >= held else current[0] * moving // held
        return max(1, current[0] - moved), max(1, current[1] + moved)

    # -- the steps ----------------------------------------------------------------------------
    async def _move(
        self, keys: list[str], src: int, dst: int, tables: dict[str, list[int]] | None = None
    ) -> None:
        stage = secrets.token_hex(8)
        source, target = self.channel(src), self.channel(dst)
        tables = tables or {}
        what = keys + [f"{k} ({len(s)} slices)" for k, s in tables.items()]
        self.moving = (what, src, dst, time.monotonic())
        homes = {k: self.strategy.placement.placed[k][0] for k in keys}
        finished = False
        new = self.placement.moved_to({k: dst for k in keys}, homes)
        moving, serving_src, serving_dst, caps, sliced = {}, {}, {}, {}, {}
        for key, slices in tables.items():
            before = self.table_slices(self.strategy.placement.tables[key])
            owners = list(before.owners)
            for s in slices:
                owners[s] = dst
            sliced[key] = TableSlices(slices=before.slices, owners=owners)
            moving[key] = SliceSet(slices=before.slices, owned=sorted(slices))
            serving_src[key] = SliceSet(slices=before.slices, owned=sliced[key].held_by(src))
            serving_dst[key] = SliceSet(slices=before.slices, owned=sliced[key].held_by(dst))
            caps[key] = await self._capacities(key, src, dst, len(slices))
        if sliced:
            new = new.with_tables(sliced).bumped(new.version)
        try:  # `moving` is cleared once the source has let go of what moved (or the move aborted)
            try:
                # the target asks the source for the copies: they cross once, ps to ps
                out = await target.request(
                    PullMove(
                        stage=stage,
                        source_index=src,
                        source_address=self.placement.ps[src],
                        keys=keys,
                        tables=moving,
                        serving=serving_dst,
                        capacity={k: c[1] for k, c in caps.items()},
                        timeout=self.timeout_s,
                    ),
                    timeout=2 * self.timeout_s,
                )
                done = await source.request(
                    FinishMove(
                        keys=keys,
                        stage=stage,
                        mark=out.mark,
                        placement=new,
                        tables=moving,
                        serving=serving_src,
                        capacity={k: c[0] for k, c in caps.items()},
                    ),
                    timeout=self.timeout_s,
                )
                finished = True
                await target.request(
                    InstallVariables(
                        stage=stage,
                        activate=True,
                        patches=done.patches,
                        once=done.once,
                        fences=done.fences,
                        superseded=done.superseded,
                        placement=new,
                        table_patches=done.tables,
                    ),
                    timeout=self.timeout_s,
                )
            except BaseException as exc:
                told = await self._abort(stage, source, target, new if finished else None)
                if not isinstance(exc, PstrainError):
                    raise
                where = "serves them still" if told or not finished else "could not take them back"
                raise restated(
                    exc,
                    f"moving {what} from ps {src} to ps {dst} failed and was undone: "
                    f"ps {src} {where}. The cause: {exc.message or exc}",
                ) from exc
            # the move is made (the target serves what moved, the source refuses it and
            # learnt the map at the switch): a ps that cannot be told now (lost since, or
            # cut off) does not make it fail, and its loss is found as any other (by the
            # next request to it; replace_lost_ps replaces it)
            await self.publish(new, lost_ok=True)
            await best_effort(
                source.request(EndMove(stage=stage, commit=True), timeout=self.timeout_s),
                f"ending move {stage} on {source.task}",
                logger,
            )
        finally:
            self.moving = None
        self.moves_done += 1
        self.bytes_moved += out.nbytes

    async def _abort(self, stage: str, source: Any, target: Any, announced: PlacementMap | None) -> bool:
        """Serve the variables from their source again; the target drops what it staged;
        the ps that can be reached learn a map that withdraws ``announced``. Returns whether
        the source took them back. (The error that stopped the move is the one to raise.)"""
        told = [
            await best_effort(
                c.request(EndMove(stage=stage, commit=False), timeout=self.timeout_s),
                f"ending move {stage} on {c.task}",
                logger,
            )
            for c in (source, target)
        ]
        if announced is not None:  # clients may have learnt it from the source's refusals
            await best_effort(
                self.publish(self.placement.bumped(announced.version + 1)),
                f"withdrawing map {announced.version}",
                logger,
            )
        return told[0]

    async def publish(self, placement: PlacementMap, *, lost_ok: bool = False) -> None:
        """Route by ``placement`` here and tell every active ps (``lost_ok``: a ps that
        cannot be reached is logged, not raised, once every other was told)."""
        self.channels.adopt(placement)
        active = placement.active()
        told = await asyncio.gather(
            *(
                self.channel(k).request(SetPlacement(placement=placement), timeout=self.timeout_s)
                for k in active
            ),
            return_exceptions=True,
        )
        for k, result in zip(active, told, strict=True):
            if not isinstance(result, BaseException):
                continue
            if not (lost_ok and isinstance(result, PstrainError)):
                raise result
            logger.warning("ps %d did not learn placement map %d: %s", k, placement.version, result)

    def channel(self, ps: int) -> Any:
        return self.channels.channel("ps", ps)

    def on(self, ps: int) -> list[str]:
        """The variables on ps ``ps`` now, largest first."""
        return variables_on(self.placement, self.strategy.placement.placed, ps)
