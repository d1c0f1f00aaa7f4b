"""The worker: runs closures and keeps per-worker resources (datasets, iterators).

Closures never run on the loop that serves requests, so a worker answers
``health`` and ``worker/cancel`` while a closure burns CPU: ``async def``
closures run on a dedicated *closure loop* thread (where the worker's
channels to the ps live), plain ``def`` closures on a small thread pool.

The coordinator sends closures in batches (``worker/run``); each function travels once
per worker, is unpickled on a thread (an import may take seconds), then named by digest;
a newer dispatch ends the older ones' closures (``dispatches.py``). Results stream back
as partial replies as closures finish, coalesced: one message carries every result that
finished since the last one.

Closures and dataset functions run in this worker's ``contextvars`` context
(``context.worker_context``): ``get_current_worker_index()`` and the
channels variable handles use come from there, so several workers can share
one process.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

from ..._base.cluster import ClusterSpec
from ..._base.context import watch_unawaited, worker_context
from ..._base.errors import (
    ClosureAbortedError,
    InvalidArgumentError,
    NotFoundError,
)
from ..._base.tags import set_dispatch
from ..._base.tasks import TaskOwner
from ..._formats.messages import CANCELLED, ERROR, OK, exception_payload
from ..._formats.operations import (
    CancelClosures,
    Configure,
    CreateResource,
    DropResources,
    ResetChannels,
    RunClosures,
)
from ..._serving.base import ServerBase
from ..._serving.core import Encoded
from ..._transport.bridge import block_on
from ..._transport.rpc import ChannelPool
from .closures import Batch, ClosureLoop, Functions, Outbox, SyncPool, check_awaited, encode_results
from .departure import Departure
from .dispatches import Dispatches
from .resources import FailedResource, LockedIterator, dataset_name, resolve

logger = logging.getLogger(__name__)

__all__ = ["WorkerServer"]


class WorkerServer(ServerBase):
    """A worker task. Operations: ``worker/configure``, ``worker/run``,
    ``worker/cancel``, ``worker/resource``, ``worker/drop_resources``."""

    def __init__(self, index: int, *, cluster_spec: ClusterSpec | None = None,
                 client_ssl: Any = None, closure_threads: int = 4, **kwargs: Any) -> None:
        super().__init__("worker", index, **kwargs)
        self.client_ssl = client_ssl
        self.closure_threads = max(1, closure_threads)
        self.channels: ChannelPool | None = None
        if cluster_spec is not None and cluster_spec.num_tasks("ps"):
            self.channels = ChannelPool(cluster_spec, self.token, ssl_context=self.client_ssl)
        self.fns = Functions()  # by digest; unpickled on a thread
        self.resources: dict[int, Any] = {}
        self._iterated: set[int] = set()  # datasets an iterator was made from
        self.closures_run = 0
        self.closures_failed = 0
        self._loop: asyncio.AbstractEventLoop | None = None  # the serving loop
        self._closure_loop = ClosureLoop(f"pstrain-worker{index}-closures")
        self._cloop: asyncio.AbstractEventLoop | None = None  # the closure loop, once started
        self._sync = SyncPool(self.closure_threads, self._run_sync, f"pstrain-worker{index}-sync")
        self._base_context: contextvars.Context | None = None
        self._base_channels: ChannelPool | None = None
        # Closure tasks run on the closure loop and belong to this owner; by id for cancels.
        self._closure_owner = TaskOwner(f"closures of {self.task}")
        self._closure_tasks: dict[int, asyncio.Task[Any]] = {}
        self._cancelled: set[int] = set()
        self.departure = Departure()  # SIGTERM: no new closures, then leave
        self._open_batches = 0  # worker/run requests not yet answered
        self._in_flight: set[int] = set()  # ids started and not yet reported
        self._outbox = Outbox()  # results and scalars on their way back
        self._dispatches = Dispatches(self.task)  # a newer epoch ends the older ones
        self.route(Configure, self.configure)
        self.route(RunClosures, self.run_closures)
        self.route(CancelClosures, self.cancel)
        self.route(CreateResource, self.create_resource)
        self.route(DropResources, self.drop_resources)
        self.route(ResetChannels, self.reset_channels)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> str:
        self._loop = asyncio.get_running_loop()
        self._cloop = await self._closure_loop.start()
        return await super().start()

    def _context(self) -> contextvars.Context:
        """A fresh context for one closure or dataset function: a copy (O(1)) of a base one
        rebuilt when the channels change (one context cannot be entered by two threads)."""
        base = self._base_context
        if base is None or self._base_channels is not self.channels:
            base = self._base_context = worker_context(self.index, self.channels, self._scalar)
            self._base_channels = self.channels
        return base.copy()

    async def on_stop(self) -> None:
        async def shutdown() -> None:  # on the closure loop
            await self._closure_owner.close()
            if self.channels is not None:
                await self.channels.close()

        await self._closure_loop.stop(shutdown)
        self._sync.stop()
        await self._closure_loop.join(5.0)

    def statistics(self, req: Any) -> dict[str, Any]:
        out = super().statistics(req)
        out.update(closures_run=self.closures_run, closures_failed=self.closures_failed,
                   closure_seconds=self._outbox.closure_seconds,
                   closures_running=len(self._closure_tasks), resources=len(self.resources),
                   draining=self.departure.draining)
        return out

    # -- draining (SIGTERM: a preemption notice) -------------------------------------------------
    def begin_drain(self) -> int:
        """Take no new closures (they are refused with DrainingError and run elsewhere);
        those running finish and report as usual. Returns how many are running."""
        if self.departure.begin():
            logger.info("%s draining: %d closure(s) to finish, no new ones", self.task,
                        len(self._in_flight))
        return len(self._in_flight)

    async def drained(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until the closures running have reported, then
        until the coordinator has heard it is leaving (see :class:`Departure`)."""
        return await self.departure.wait(
            lambda: bool(self._in_flight or self._outbox.items or self._open_batches),
            lambda: bool(self.connections), timeout)

    def _refuse_if_draining(self) -> None:
        self.departure.refuse(self.task)

    @property
    def joined(self) -> bool:
        """Started with ``--join``: it takes the index the coordinator gives it (and answers
        a handshake dialled as any worker index)."""
        return self.answers_any_index

    @joined.setter
    def joined(self, value: bool) -> None:
        self.answers_any_index = value

    def configure(self, req: Configure) -> dict[str, Any]:
        """The coordinator tells the worker where the ps are."""
        self._refuse_if_draining()
        if self.joined and req.index is not None and req.index != self.index:
            logger.info("%s joined as worker %d", self.task, req.index)
            self.index = req.index  # the slot the coordinator gave this joining worker
            self._base_context = None
        spec = ClusterSpec(req.cluster)
        if self.channels is None or self.channels.cluster_spec != spec or req.fresh:
            old = self.channels
            self.channels = ChannelPool(spec, self.token, ssl_context=self.client_ssl)
            if old is not None and self._cloop is not None:
                self.tasks.spawn(self._closure_loop.run(old.close()))
        return {"incarnation": self.incarnation, "index": self.index}

    async def run_closures(self, req: RunClosures, emit: Callable[[Any], None] | None) -> Encoded:
        """Run a batch of closures; partial replies carry results as they finish."""
        self._check_incarnation(req.incarnation)
        closures = req.closures
        batch = Batch(len(closures), emit, asyncio.get_running_loop().create_future(), req.epoch)
        older = [] if req.epoch is None else self._dispatches.arrive(batch, (req.owner, self.index))
        try:
            if req.fns or self.fns.loading:
                await self.fns.load(req.fns, {c[1] for c in closures})
            if not closures:
                return encode_results([])  # nothing to run: answered at once
            self._refuse_if_draining()
            self._open_batches += 1
            try:
                await self._dispatches.wait_ended(older, self._cloop)
                if batch.abandoned:  # a newer dispatch arrived meanwhile: this one is fenced
                    return encode_results([[c[0], CANCELLED, None] for c in closures])
                fence = (req.owner, self.index, req.epoch) if req.epoch is not None else None
                self._start_batch(batch, closures, fence, req.once)
                return await batch.done
            finally:
                self._open_batches -= 1
        finally:
            self._dispatches.close(batch)

    def stream_closed(self, connection: Any) -> None:  # its batches' closures stop here too
        self._dispatches.connection_ended(connection, self._cloop)

    def _check_incarnation(self, expected: str | None) -> None:
        if expected is not None and expected != self.incarnation:
            raise ClosureAbortedError(
                f"{self.task} restarted since the coordinator connected (it has none of the "
                "functions or resources sent before); reconnect")

    def cancel(self, req: CancelClosures) -> dict[str, Any]:
        """Cancel running or queued closures by id; ids of closures not in flight are ignored
        (they would otherwise accumulate and cancel a later closure that reuses the id)."""
        ids = [cid for cid in req.ids if cid in self._in_flight]
        self._cancelled.update(ids)
        if self._cloop is not None:
            self._cloop.call_soon_threadsafe(self._cancel_tasks, ids)
        return {"cancelling": len(ids)}

    def _cancel_tasks(self, ids: list[int]) -> None:
        for cid in ids:
            task = self._closure_tasks.get(cid)
            if task is not None:
                task.cancel()

    async def create_resource(self, req: CreateResource) -> dict[str, Any]:
        """Build a per-worker resource: ``dataset`` (call fn), ``iterator`` (iter of one)."""
        self._check_incarnation(req.incarnation)
        rid, kind, fn, of = req.rid, req.kind, req.fn, req.of
        if not callable(fn):
            raise InvalidArgumentError(f"worker/resource: 'fn' must be callable, got {type(fn).__name__}")
        if kind == "iterator" and of is None:
            raise InvalidArgumentError("worker/resource: an iterator needs 'of', its dataset")

        def build() -> Any:
            if kind == "dataset":
                return fn()
            source = self.resources.get(of)  # type: ignore[arg-type]
            if isinstance(source, FailedResource):
                raise source.error
            # Every iter() starts from the beginning (TF): a dropped dataset, or a
            # single-pass one (an iterator) already iterated, is built afresh.
            if source is None or (iter(source) is source and of in self._iterated):
                source = fn()
            self._iterated.add(of)  # type: ignore[arg-type]
            return LockedIterator(iter(source), dataset_name(fn), self.task)

        ctx = self._context()
        try:
            self.resources[rid] = await asyncio.get_running_loop().run_in_executor(None, ctx.run, build)
        except Exception as exc:
            self.resources[rid] = FailedResource(exc)
            return {"rid": rid, "error": exception_payload(exc)}
        return {"rid": rid}

    def reset_channels(self, req: ResetChannels) -> dict[str, Any]:
        """The coordinator found ``job:index`` unreachable: drop our connections to it, so the
        closures using them fail now and later ones reach it afresh once it is back."""
        if self.channels is not None:
            self.channels.reset(req.job, req.index)
        return {}

    def drop_resources(self, req: DropResources) -> dict[str, Any]:
        for rid in req.rids:
            self.resources.pop(rid, None)
        return {"resources": len(self.resources)}

    # -- running closures (closure loop) ---------------------------------------------------------
    def _closure_context(
        self, fence: tuple[str | None, int, int] | None, once_key: str | None
    ) -> contextvars.Context:
        ctx = self._context()
        if fence is not None or once_key is not None:
            ctx.run(set_dispatch, fence, once_key)
        return ctx

    def _start_batch(self, batch: Batch, closures: list[Any],
                     fence: tuple[str | None, int, int] | None = None,
                     once: dict[int, str] | None = None) -> None:
        """On the serving loop: plain functions go straight to the thread pool; coroutine
        functions go to the closure loop in one hand-over for the whole batch."""
        coros = []
        for cid, digest, args, kwargs, has_refs in closures:
            self._in_flight.add(cid)
            fn = self.fns.get(digest)
            if fn is None:
                self._deliver(batch, [cid, ERROR, exception_payload(NotFoundError(
                    f"function {digest.hex()[:12]} was never sent to this worker"))])
                continue
            if has_refs:
                try:
                    args = resolve(args, self.resources, self.index)
                    kwargs = resolve(kwargs, self.resources, self.index)
                except BaseException as exc:
                    self._deliver(batch, [cid, ERROR, exception_payload(exc)])
                    continue
            once_key = once.get(cid) if once else None
            if inspect.iscoroutinefunction(fn):
                coros.append((cid, fn, args, kwargs, self._closure_context(fence, once_key)))
            else:
                self._sync.submit((batch, cid, fn, args, kwargs, self._closure_context(fence, once_key)))
        if coros:
            assert self._cloop is not None
            self._cloop.call_soon_threadsafe(self._start_coros, batch, coros)

    def _start_coros(self, batch: Batch, coros: list[Any]) -> None:
        loop = self._cloop
        assert loop is not None
        for cid, fn, args, kwargs, ctx in coros:
            if cid in self._cancelled or batch.abandoned:
                self._deliver(batch, [cid, CANCELLED, None])
                continue
            task = self._closure_owner.spawn(self._run_async(batch, cid, fn, args, kwargs),
                                             context=ctx)  # one each
            self._closure_tasks[cid] = task
            batch.tasks.add(task)

    async def _run_async(self, batch: Batch, cid: int, fn: Callable[..., Any], args: Any,
                         kwargs: Any) -> None:
        started = time.perf_counter()
        try:
            with watch_unawaited() as missed:
                value = await fn(*args, **kwargs)
            check_awaited(missed)
            record = [cid, OK, value]
        except asyncio.CancelledError:
            record = [cid, CANCELLED, None]
        except BaseException as exc:  # user code: report whatever it raised
            record = [cid, ERROR, exception_payload(exc)]
        finally:
            task = asyncio.current_task()
            if self._closure_tasks.get(cid) is task:
                del self._closure_tasks[cid]
            batch.tasks.discard(task)
        self._deliver(batch, record, time.perf_counter() - started)

    def _run_sync(self, item: tuple[Any, ...]) -> None:
        """One plain ``def`` closure, on a pool thread."""
        batch, cid, fn, args, kwargs, ctx = item
        if cid in self._cancelled or batch.abandoned:
            self._cancelled.discard(cid)
            self._deliver(batch, [cid, CANCELLED, None])
            return
        started = time.perf_counter()
        try:
            value = ctx.run(self._call_sync, fn, args, kwargs)
            record = [cid, OK, value]
        except BaseException as exc:
            record = [cid, ERROR, exception_payload(exc)]
        self._deliver(batch, record, time.perf_counter() - started)

    def _call_sync(self, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """A plain ``def`` closure, on a pool thread; an awaitable it returns (``lambda:
        v.assign_add(1.0)``) finishes on the closure loop, where the channels live."""
        with watch_unawaited() as missed:
            value = fn(*args, **kwargs)
            if inspect.isawaitable(value):
                value = block_on(lambda: value, self._cloop, what="a closure's awaitable")
        check_awaited(missed)
        return value

    def _scalar(self, name: str, value: float, step: int, wall_time: float) -> None:
        """A closure logged a scalar (any thread): it leaves with the next results."""
        self._outbox.scalar(name, value, step, wall_time)

    def _deliver(self, batch: Batch, record: list[Any], seconds: float = 0.0) -> None:
        """Called on any thread when a closure ends; results leave in coalesced messages."""
        if self._outbox.put(batch, record, seconds):
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        outbox, scalars = self._outbox.take()
        touched: dict[int, Batch] = {}
        for batch, record in outbox:
            self._cancelled.discard(record[0])
            self._in_flight.discard(record[0])
            if record[1] == OK:
                self.closures_run += 1
            else:
                self.closures_failed += record[1] == ERROR
            batch.results.append(record)
            batch.remaining -= 1
            touched[id(batch)] = batch
        for batch in touched.values():  # a closure's scalars leave with (or before) its result
            if batch.remaining == 0:
                results, batch.results = batch.results, []
                if not batch.done.done():
                    batch.done.set_result(encode_results(results, scalars, self.departure.flag()))
                    scalars = []
            elif batch.emit is not None:
                results, batch.results = batch.results, []
                try:
                    batch.emit(encode_results(results, scalars, self.departure.flag()))
                    scalars = []
                except Exception:  # connection gone: the coordinator reschedules
                    logger.debug("could not send partial results", exc_info=True)
            # over HTTP (no emit) results wait for the last one

