"""Replacing a lost ps while the others train (elastic ps, with delta checkpoints).

A ps that is lost (SIGKILLed, its host gone, or restarted empty) took the variables it
held. :meth:`PsReplacement.replace` puts them back, with their optimizer slots, from a
:class:`~pstrain.checkpoint.CheckpointManager`'s latest checkpoint (its base and deltas:
``_checkpoint/shares.py``) on the other ps, or on a ps that joined, and takes the lost one
out of the job; the slices of dynamic tables it held are read from the same checkpoint
by the ps that take them (``dyn/restore`` with ``merge``). The updates it took after the
latest delta are lost: at most one ``delta_interval_s``. The steps, with the placement lock
held (no save or move meanwhile):

1. a map without the lost ps is published: no new variable goes there, the heartbeat
   stops watching it;
2. its variables' values are read from the checkpoint (off the loop);
3. each target ps stages, then serves them; the map saying where they are now is
   published, and clients learn it from the ps as after any move.

With :meth:`PsReplacement.enable`, this runs by itself. A closure that failed because a
ps could not be reached is held; the ps is asked once more (``health``, the heartbeat's
check); if it is lost (silent, or restarted with a new incarnation) it is replaced, and
the held closures go back to the front of the queue when that ends. A ps that answers as
before was not lost: the closure runs again at once. The heartbeat hands over a ps it
finds lost while closures run the same way. If the replacement fails, its error is the
job's (the next ``join`` raises it). While closures are held no later closure starts (they
run again first, in the order they were scheduled); those in flight that touch only the
other ps finish. Schedule with ``exactly_once=True``: a closure that ran in part before the
loss is then applied once on the ps that kept its updates.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import numpy as np
from msgspec.structs import replace

from ..._base.cluster import task_name
from ..._base.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PsRestartedError,
    PstrainError,
    UnavailableError,
)
from ..._checkpoint.shares import read_share, table_sources
from ..._formats.messages.checkpoint_operations import AbortRestore, CommitRestore, RestoreTable
from ..._formats.messages.placement_map import ReadRecords, SetPlacement, SliceSet, TableSlices, VariableCopy
from ..._variables.staged_restore import new_stage
from ..heartbeat import Heartbeat
from ..scheduling import ClosureQueue
from .moves import PsChanges
from .plans import plan_leave

if TYPE_CHECKING:
    from ..._checkpoint.manager import CheckpointManager

logger = logging.getLogger(__name__)

__all__ = ["PsReplacement"]

_PS_TASK = "/job:ps/replica:0/task:"
#: A ps found alive this many times within the window while closures keep failing on it is
#: not held for: the closures fail (a worker cut off from a ps the coordinator reaches).
_MAX_ALIVE, _ALIVE_WINDOW_S = 20, 5.0
#: How long a replaced ps is told, should it answer again, that it left the job.
FENCE_FOR_S = 600.0


class PsReplacement:
    """Replaces lost ps from a checkpoint manager's deltas, on request or by itself."""

    def __init__(
        self,
        changes: PsChanges,
        heartbeat: Heartbeat,
        queue: ClosureQueue,
        spawn: Callable[[Coroutine[Any, Any, Any]], Any],
    ) -> None:
        self.changes = changes
        self.heartbeat = heartbeat
        self.queue = queue
        self.spawn = spawn
        #: Where lost ps are replaced from by themselves (None: they fail the job, as in TF).
        self.manager: CheckpointManager | None = None
        self._ending: dict[int, asyncio.Event] = {}  # ps index -> set when its replacement ends
        self.failed: dict[int, BaseException] = {}
        self._alive: dict[int, collections.deque[float]] = {}  # ps -> when it was found alive
        queue.hold = self._hold  # (a ps that lost a variable a closure named is asked why)

    def enable(self, manager: CheckpointManager) -> None:
        """Replace a ps lost while closures run from ``manager``'s latest checkpoint."""
        self.manager = manager
        self.heartbeat.on_ps_lost = self._found_lost

    async def replace(self, index: int, manager: CheckpointManager, *, to: int | None = None) -> None:
        """Put lost ps ``index``'s variables (with their slots) on the other ps (or on ps
        ``to``) from ``manager``'s latest checkpoint; ps ``index`` leaves the job."""
        ending = self._ending.get(index)
        if ending is not None and not ending.is_set():
            raise FailedPreconditionError(f"{task_name('ps', index)} is being replaced already")
        self._ending[index] = ending = asyncio.Event()
        try:
            await self._replace_now(index, manager, to)
        finally:
            ending.set()
            self.changes.replacing.discard(index)

    async def _replace_now(self, index: int, manager: CheckpointManager, to: int | None) -> None:
        changes = self.changes
        active = changes.placement.active()
        if index not in active:
            raise InvalidArgumentError(f"no active ps {index!r}: the job's ps are {active}")
        if to is not None and (to == index or to not in active):
            raise InvalidArgumentError(
                f"ps {to} cannot take ps {index}'s variables: the job's ps are {active}"
            )
        if len(active) == 1:
            raise FailedPreconditionError("the job's only ps cannot be replaced by the others")
        started = time.monotonic()
        changes.replacing.add(index)
        async with changes.lock:  # no save, delta or move meanwhile: the latest delta is whole
            path = manager.latest_checkpoint
            if path is None:
                raise FailedPreconditionError(
                    f"{manager.directory} has no checkpoint to replace "
                    f"{task_name('ps', index)}'s variables from"
                )
            keys = changes.on(index)
            await changes.retire(index)
            copies = await asyncio.get_running_loop().run_in_executor(
                None, read_share, manager.checkpoint, path, set(keys), changes.strategy.placement.owner
            )
            sources = await asyncio.get_running_loop().run_in_executor(
                None, table_sources, manager.checkpoint, path
            )
            copies, once, steps = await self._counted(set(keys), copies)
            await changes.install(copies, changes.spread(keys, to), once)
            rows = await self._replace_tables(index, sources, to)
        seconds = time.monotonic() - started
        self.spawn(self._fence(index))
        nbytes = sum(int(c.value.nbytes) for c in copies)
        tables = sorted(k for k, t in changes.strategy.placement.tables.items() if k in sources and rows)
        self.changes.replaced.append(
            {
                "ps": index,
                "variables": len(keys),
                "keys": sorted(keys),
                "tables": tables,
                "bytes": nbytes,
                "table_rows": rows,
                "seconds": round(seconds, 3),
                "checkpoint": path,
                "steps_since_checkpoint": steps,
            }
        )
        shown = ", ".join(sorted(keys)[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
        logger.warning(
            "%s was lost and replaced in %.2f s: its %d variable(s) (%s; %d bytes with their "
            "slots) and %d table row(s) were rolled back to %s and put on the other ps; %s",
            task_name("ps", index),
            seconds,
            len(keys),
            shown or "none",
            nbytes,
            rows,
            path,
            f"the step counter kept its count, {steps} step(s) past the checkpoint's: the "
            "updates to them of those steps were lost, but for those in flight, which ran again"
            if steps is not None
            else "no step counter was on it",
        )

    async def _counted(
        self, lost: set[str], copies: list[VariableCopy]
    ) -> tuple[list[VariableCopy], dict[str, list[Any]], int | None]:
        """An optimizer's step counter (or its mirror) among the ``lost`` variables comes
        back with the count of the one on a ps that kept its state, and that one's
        exactly-once records: a step it counted before the loss is not counted again when
        its closure runs again. Returns the copies, the records by variable, and how many
        steps the checkpoint's count was behind (None: no counter was lost)."""
        once: dict[str, list[Any]] = {}
        behind = None
        at = {c.name: i for i, c in enumerate(copies)}
        for optimizer in list(self.changes.strategy.placement.counters):
            pair = (optimizer.iterations, optimizer.iterations_mirror)
            gone = [v for v in pair if v.key in lost and v.key in at]
            if len(gone) != 1:
                continue
            kept = pair[1] if gone[0] is pair[0] else pair[0]
            count = int(await kept.read_value())
            reply = await self.changes.channel(kept.ps_index).request(ReadRecords(names=[kept.key]))
            copy = copies[at[gone[0].key]]
            behind = max(behind or 0, count - int(copy.value))
            copies[at[copy.name]] = replace(copy, value=np.asarray(count, np.asarray(copy.value).dtype))
            once[copy.name] = [
                [key, seq, [copy.name], answer, parts] for key, seq, _, answer, parts in reply.once
            ]
        return copies, once, behind

    async def _replace_tables(self, index: int, sources: dict[str, Any], to: int | None) -> int:
        """Put the rows of the slices lost ps ``index`` held of each dynamic table on the
        others (or on ps ``to``), read from ``sources`` (``table_sources``: base, then
        deltas); then route to them there. Returns the rows put back."""
        changes = self.changes
        tables = changes.strategy.placement.tables
        if to is None:
            plan = plan_leave(changes.placement, tables, index, changes.leaving)
        else:
            plan = {to: {k: changes.table_slices(t).held_by(index) for k, t in tables.items()}}
        after: dict[str, TableSlices] = {}
        for key, table in tables.items():
            owners = list(changes.table_slices(table).owners)
            for dst, per_table in plan.items():
                for s in per_table.get(key, []):
                    owners[s] = dst
            after[key] = TableSlices(slices=len(owners), owners=owners)

        stage = new_stage()  # every ps reads and checks its slices first, then all merge them

        async def put(dst: int, key: str, slices: list[int]) -> int:
            table, new = tables[key], after[key]
            files, slots, deltas = sources[key]
            reply = await changes.channel(dst).request(
                RestoreTable(
                    name=key,
                    config=table.slice_spec(new, dst),
                    owner=table.owner,
                    paths=files,
                    shard=0,
                    num_shards=1,
                    slots=slots,
                    deltas=[list(d) for d in deltas],
                    owned=SliceSet(slices=new.slices, owned=slices),
                    merge=SliceSet(slices=new.slices, owned=new.held_by(dst)),
                    stage=stage,
                ),
                timeout=changes.timeout_s,
            )
            return int(reply.staged or 0)

        puts = [
            (dst, put(dst, key, slices))
            for dst, per_table in plan.items()
            for key, slices in per_table.items()
            if slices
        ]
        if not puts:
            return 0
        staged = await asyncio.gather(*(p for _, p in puts), return_exceptions=True)
        targets = {dst for dst, _ in puts}
        failed = [r for r in staged if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(
                *(changes.channel(dst).request(AbortRestore(stage=stage)) for dst in targets),
                return_exceptions=True,
            )
            raise failed[0]
        await asyncio.gather(*(changes.channel(dst).request(CommitRestore(stage=stage)) for dst in targets))
        rows = sum(r for r in staged if isinstance(r, int))
        await changes.publish(
            changes.placement.with_tables(
                {k: v for k, v in after.items() if index in changes.table_slices(tables[k]).owners}
            )
        )
        return rows

    async def _fence(self, index: int) -> None:
        """Tell the lost ps, if it answers again (a partition that healed), that it left the
        job: it then serves none of its old variables (``server/ps/moves/handlers.py``)."""
        channel = self.changes.channel(index)
        deadline = time.monotonic() + FENCE_FOR_S
        while time.monotonic() < deadline:
            try:
                await channel.request(SetPlacement(placement=self.changes.placement), timeout=5.0)
            except (UnavailableError, DeadlineExceededError):
                await asyncio.sleep(2.0)  # retried while it may come back
                continue
            except PstrainError:  # another task at that address now (a ps that joined anew)
                return
            logger.info(
                "%s answered again after it was replaced: it serves nothing now", task_name("ps", index)
            )
            return

    # -- by itself ------------------------------------------------------------------------------
    def _found_lost(self, index: int, error: BaseException) -> bool:
        """The heartbeat found ps ``index`` lost (``error``) while closures run: replace it
        (True), unless replacing it failed before (False: ``error`` is the job's)."""
        if self.manager is None or index in self.failed or not isinstance(error, UnavailableError):
            return False
        self._start(index, error)
        return True

    def _hold(self, error: BaseException, put_back: Callable[..., Any]) -> bool:
        """A closure failed with ``error``: if a ps could not be reached, hold it (True) until
        that ps is found alive or replaced, then ``put_back()``. If a ps did not know a
        variable it named, hold it while that ps is asked whether it restarted: if it did,
        it is replaced as a lost one is (ps replaced here) and the closure runs again, or
        the closure fails with that (``UnavailableError``, as TF's); else with ``error``."""
        task = getattr(error, "task", None)
        if isinstance(error, NotFoundError) and isinstance(task, str) and task.startswith(_PS_TASK):
            self.spawn(self._restarted_or(int(task[len(_PS_TASK) :]), error, put_back))
            return True
        if (
            self.manager is None
            or not isinstance(error, UnavailableError)
            or not isinstance(task, str)
            or not task.startswith(_PS_TASK)
        ):
            return False
        index = int(task[len(_PS_TASK) :])
        if index in self.failed or len(self._alive.get(index, ())) >= _MAX_ALIVE:
            return False  # its replacement failed; or it answers, yet closures keep failing on it
        self.spawn(self._check_then_put_back(index, put_back))
        return True

    async def _restarted_or(self, index: int, error: BaseException, resolve: Callable[..., Any]) -> None:
        """A ps did not know a variable a closure named: if it restarted (empty) and ps are
        replaced here, it is lost like a silent one, so it is replaced and the closure runs
        again once that ends (``resolve()``); else the closure fails with the restart, or
        with ``error`` (``resolve(exc)``)."""
        outcome: BaseException | None = error
        try:
            restarted = await self.heartbeat.ps_restarted(index)
            if isinstance(restarted, PsRestartedError):
                outcome = restarted
                if self.manager is not None and index not in self.failed:
                    if index not in self._ending and index in self.changes.placement.active():
                        self._start(index, restarted)
                    ending = self._ending.get(index)
                    if ending is not None:
                        await ending.wait()
                    if index not in self.failed:
                        outcome = None  # replaced (or earlier): the closure runs again
        finally:
            if outcome is None:
                resolve()
            else:
                resolve(outcome)

    async def _check_then_put_back(self, index: int, put_back: Callable[[], Any]) -> None:
        try:
            if index not in self._ending and index in self.changes.placement.active():
                lost = await self.heartbeat.ps_restarted(index, report_silence=True)
                if lost is None:  # it answers as before: the closure runs again
                    now = time.monotonic()
                    alive = self._alive.setdefault(index, collections.deque())
                    alive.append(now)
                    while alive and alive[0] < now - _ALIVE_WINDOW_S:
                        alive.popleft()
                elif index not in self._ending:
                    self._start(index, lost)
            ending = self._ending.get(index)
            if ending is not None:
                await ending.wait()
        finally:
            put_back()

    def _start(self, index: int, error: BaseException) -> None:
        if index in self._ending:
            return
        logger.warning(
            "%s is lost (%s): replacing it from %s while training goes on",
            task_name("ps", index),
            error,
            self.manager and self.manager.directory,
        )
        self._ending[index] = ending = asyncio.Event()
        self.changes.replacing.add(index)
        self.spawn(self._replace(index, ending))

    async def _replace(self, index: int, ending: asyncio.Event) -> None:
        assert self.manager is not None
        try:
            await self._replace_now(index, self.manager, None)
        except Exception as exc:
            logger.error("replacing %s failed", task_name("ps", index), exc_info=exc)
            self.failed[index] = exc
            self.queue.record_error(
                UnavailableError(
                    f"{task_name('ps', index)} was lost and could not be replaced from "
                    f"{self.manager.directory}: {type(exc).__name__}: {exc}",
                    task=task_name("ps", index),
                )
            )
        finally:
            ending.set()
            self.changes.replacing.discard(index)
