"""Where a worker's closures run, and how their results come back.

A batch (one ``worker/run``) is started on the serving loop: plain ``def`` closures go to a
small thread pool, ``async def`` ones to the *closure loop* (a thread of its own, where the
worker's channels to the ps live) in one hand-over for the whole batch. Each closure ends
in a record (``[id, status, value]``) put in the outbox from whatever thread it ran on; the
serving loop takes every record that finished since its last look at once, and sends them
as one partial reply (the batch's last record: its reply). The parts (the batch, the
loaded functions, the pool, the outbox, the closure loop) are ``closures.py``'s.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

from ..._base.context import watch_unawaited
from ..._base.errors import InvalidArgumentError
from ..._base.tags import set_dispatch
from ..._base.tasks import TaskOwner
from ..._formats.messages.closures import CANCELLED, ERROR, OK, UNSENT, exception_payload
from ..._formats.messages.records import ClosureCall, ClosureResult
from ..._transport.bridge import block_on
from ..._transport.wire import PickleFailure, pickle_failure_in
from .closures import Batch, ClosureLoop, Functions, Outbox, SyncPool, check_awaited, encode_results

logger = logging.getLogger(__name__)

__all__ = ["ClosureRunner"]


def _unreadable_arguments(failure: PickleFailure) -> InvalidArgumentError:
    error = failure.error
    return InvalidArgumentError(
        f"the closure's arguments could not be unpickled on this worker: {type(error).__name__}: "
        f"{error} (pass plain data: numbers, arrays, lists and dicts of them; or objects whose "
        "classes every worker can import)"
    )


class ClosureRunner:
    """Runs a worker's closures. ``new_context()`` gives a fresh context for one closure (the
    worker's index and channels), ``resolve(args)`` puts the worker's resources in place of
    their references, ``departing()`` says whether the worker is leaving (sent with the
    results)."""

    def __init__(
        self,
        task: str,
        threads: int,
        new_context: Callable[[], contextvars.Context],
        resolve: Callable[[Any], Any],
        departing: Callable[[], Any],
    ) -> None:
        self.fns = Functions()  # by digest; unpickled on a thread
        self.loop = ClosureLoop(f"pstrain-{task}-closures")
        self.cloop: asyncio.AbstractEventLoop | None = None  # the closure loop, once started
        self._serving: asyncio.AbstractEventLoop | None = None
        self._sync = SyncPool(threads, self._run_sync, f"pstrain-{task}-sync")
        self._new_context = new_context
        self._resolve = resolve
        self._departing = departing
        # Closure tasks run on the closure loop and belong to this owner; by id for cancels.
        self._owner = TaskOwner(f"closures of {task}")
        self.tasks: dict[int, asyncio.Task[Any]] = {}
        self.cancelled: set[int] = set()
        self.in_flight: set[int] = set()  # ids started and not yet reported
        self.outbox = Outbox()  # results and scalars on their way back
        self.closures_run = 0
        self.closures_failed = 0

    async def start(self) -> None:
        self._serving = asyncio.get_running_loop()
        self.cloop = await self.loop.start()

    async def stop(self, *closing: Any) -> None:
        """End the closures (and close ``closing``: channel pools living on the closure
        loop), then the closure loop and the pool."""

        async def shutdown() -> None:  # on the closure loop
            await self._owner.close()
            for pool in closing:
                await pool.close()

        await self.loop.stop(shutdown)
        self._sync.stop()
        await self.loop.join(5.0)

    def cancel(self, ids: list[int]) -> list[int]:
        """Cancel running or queued closures by id; returns those in flight (the others are
        ignored: they would otherwise cancel a later closure that reuses the id)."""
        ids = [cid for cid in ids if cid in self.in_flight]
        self.cancelled.update(ids)
        if self.cloop is not None:
            self.cloop.call_soon_threadsafe(self._cancel_tasks, ids)
        return ids

    def _cancel_tasks(self, ids: list[int]) -> None:
        for cid in ids:
            task = self.tasks.get(cid)
            if task is not None:
                task.cancel()

    def _closure_context(
        self, fence: tuple[str | None, int, int] | None, once_key: str | None
    ) -> contextvars.Context:
        ctx = self._new_context()
        if fence is not None or once_key is not None:
            ctx.run(set_dispatch, fence, once_key)
        return ctx

    def start_batch(
        self,
        batch: Batch,
        closures: list[ClosureCall],
        fence: tuple[str | None, int, int] | None = None,
        once: dict[int, str] | None = None,
    ) -> None:
        """On the serving loop: plain functions go straight to the thread pool; coroutine
        functions go to the closure loop in one hand-over for the whole batch."""
        coros = []
        for call in closures:
            cid, args, kwargs = call.id, call.args, call.kwargs
            self.in_flight.add(cid)
            fn = self.fns.get(call.fn)
            if fn is None:  # never sent, or dropped since (Functions): send it again
                self._deliver(batch, ClosureResult(cid, UNSENT))
                continue
            failure = pickle_failure_in(args) or pickle_failure_in(kwargs)
            if failure is not None:
                self._deliver(
                    batch, ClosureResult(cid, ERROR, exception_payload(_unreadable_arguments(failure)))
                )
                continue
            if call.has_refs:
                try:
                    args, kwargs = self._resolve(args), self._resolve(kwargs)
                except BaseException as exc:
                    self._deliver(batch, ClosureResult(cid, ERROR, exception_payload(exc)))
                    continue
            once_key = once.get(cid) if once else None
            if inspect.iscoroutinefunction(fn):
                coros.append((cid, fn, args, kwargs, self._closure_context(fence, once_key)))
            else:
                self._sync.submit((batch, cid, fn, args, kwargs, self._closure_context(fence, once_key)))
        if coros:
            assert self.cloop is not None
            self.cloop.call_soon_threadsafe(self._start_coros, batch, coros)

    def _start_coros(self, batch: Batch, coros: list[Any]) -> None:
        loop = self.cloop
        assert loop is not None
        for cid, fn, args, kwargs, ctx in coros:
            if cid in self.cancelled or batch.abandoned:
                self._deliver(batch, ClosureResult(cid, CANCELLED))
                continue
            task = self._owner.spawn(self._run_async(batch, cid, fn, args, kwargs), context=ctx)  # one each
            self.tasks[cid] = task
            batch.tasks.add(task)

    async def _run_async(
        self, batch: Batch, cid: int, fn: Callable[..., Any], args: Any, kwargs: Any
    ) -> None:
        started = time.perf_counter()
        try:
            with watch_unawaited() as missed:
                value = await fn(*args, **kwargs)
            check_awaited(missed)
            record = ClosureResult(cid, OK, value)
        except asyncio.CancelledError:
            record = ClosureResult(cid, CANCELLED)
        except BaseException as exc:  # user code: report whatever it raised
            record = ClosureResult(cid, ERROR, exception_payload(exc))
        finally:
            task = asyncio.current_task()
            if self.tasks.get(cid) is task:
                del self.tasks[cid]
            batch.tasks.discard(task)
        self._deliver(batch, record, time.perf_counter() - started)

    def _run_sync(self, item: tuple[Any, ...]) -> None:
        """One plain ``def`` closure, on a pool thread."""
        batch, cid, fn, args, kwargs, ctx = item
        if cid in self.cancelled or batch.abandoned:
            self.cancelled.discard(cid)
            self._deliver(batch, ClosureResult(cid, CANCELLED))
            return
        started = time.perf_counter()
        try:
            value = ctx.run(self._call_sync, fn, args, kwargs)
            record = ClosureResult(cid, OK, value)
        except BaseException as exc:
            record = ClosureResult(cid, ERROR, exception_payload(exc))
        self._deliver(batch, record, time.perf_counter() - started)

    def _call_sync(self, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """A plain ``def`` closure, on a pool thread; an awaitable it returns (``lambda:
        v.assign_add(1.0)``) finishes on the closure loop, where the channels live."""
        with watch_unawaited() as missed:
            value = fn(*args, **kwargs)
            if inspect.isawaitable(value):
                value = block_on(lambda: value, self.cloop, what="a closure's awaitable")
        check_awaited(missed)
        return value

    def scalar(self, name: str, value: float, step: int, wall_time: float) -> None:
        """A closure logged a scalar (any thread): it leaves with the next results."""
        self.outbox.scalar(name, value, step, wall_time)

    def _deliver(self, batch: Batch, record: ClosureResult, seconds: float = 0.0) -> None:
        """Called on any thread when a closure ends; results leave in coalesced messages."""
        if self.outbox.put(batch, record, seconds):
            assert self._serving is not None
            self._serving.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        outbox, scalars = self.outbox.take()
        touched: dict[int, Batch] = {}
        for batch, record in outbox:
            self.cancelled.discard(record.id)
            self.in_flight.discard(record.id)
            if record.status is OK:
                self.closures_run += 1
            else:
                self.closures_failed += record.status is ERROR
            batch.results.append(record)
            batch.remaining -= 1
            touched[id(batch)] = batch
        for batch in touched.values():  # a closure's scalars leave with (or before) its result
            if batch.remaining == 0:
                results, batch.results = batch.results, []
                if not batch.done.done():
                    batch.done.set_result(encode_results(results, scalars, self._departing()))
                    scalars = []
            elif batch.emit is not None:
                results, batch.results = batch.results, []
                try:
                    batch.emit(encode_results(results, scalars, self._departing()))
                    scalars = []
                except Exception:  # connection gone: the coordinator reschedules
                    logger.debug("could not send partial results", exc_info=True)
            # over HTTP (no emit) results wait for the last one
