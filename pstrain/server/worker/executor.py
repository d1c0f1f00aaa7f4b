"""The worker: runs closures and keeps per-worker resources (datasets, iterators).

Closures never run on the loop that serves requests, so a worker answers
``health`` and ``worker/cancel`` while a closure burns CPU: ``async def``
closures run on a dedicated *closure loop* thread (where the worker's
channels to the ps live), plain ``def`` closures on a small thread pool.

The coordinator sends closures in batches (``worker/run``); each function
travels once per worker and is referred to by digest afterwards. Results
stream back as partial replies as closures finish, coalesced: one message
carries every result that finished since the last one.

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
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from ..._base.cluster import ClusterSpec
from ..._base.context import watch_unawaited, worker_context
from ..._base.errors import (
    ClosureAbortedError,
    ClosureInputError,
    DrainingError,
    InvalidArgumentError,
    NotFoundError,
    OutOfRangeError,
)
from ..._base.tags import set_dispatch
from ..._base.tasks import TaskOwner
from ..._formats import wire
from ..._formats.messages import CANCELLED, ERROR, OK, ResourceRef, exception_payload
from ..._formats.schemas import (
    CancelRequest,
    ConfigureRequest,
    DropRequest,
    ResetRequest,
    ResourceRequest,
    RunRequest,
)
from ..._serving.base import ServerBase
from ..._serving.core import Encoded
from ..._transport.bridge import block_on, new_event_loop
from ..._transport.rpc import ChannelPool

logger = logging.getLogger(__name__)

__all__ = ["WorkerServer"]




def _check_awaited(missed: list[str]) -> None:
    """A closure that dropped a pstrain operation without ``await`` failed: the operation
    never ran (an update silently lost otherwise)."""
    if missed:
        raise InvalidArgumentError(
            f"the closure called {', '.join(sorted(set(missed)))} without `await`: "
            "the operation never ran. Write `await` before it (in an `async def` closure), or "
            "return it from a plain `def` closure")

#: Scalars closures may log between two results messages; more are dropped (and counted).
MAX_PENDING_SCALARS = 100_000

class _FailedResource:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class LockedIterator:
    """A per-worker iterator; ``next()`` is safe from concurrent closures.

    At its end ``next()`` raises :class:`~pstrain.errors.OutOfRangeError` naming the
    dataset and the fix, as TF does (a ``StopIteration`` would not cross an ``await``:
    Python turns it into "coroutine raised StopIteration")."""

    def __init__(self, iterator: Any, dataset: str = "the dataset", task: str = "") -> None:
        self._it = iterator
        self._dataset = dataset
        self._task = task
        self._lock = threading.Lock()

    def __iter__(self) -> LockedIterator:
        return self

    def __next__(self) -> Any:
        with self._lock:
            try:
                return next(self._it)
            except StopIteration:
                raise OutOfRangeError(
                    f"End of sequence: the per-worker iterator of {self._dataset} on {self._task} "
                    "is exhausted. Repeat the dataset (.repeat() on a pstrain.data.Dataset, or "
                    "itertools.cycle) and schedule a fixed number of steps, as TF recommends",
                    task=self._task) from None

    def get_next(self) -> Any:
        """TF's spelling of ``next(it)``."""
        return next(self)


class _Batch:
    """One ``worker/run`` request: results go out as partial replies, then the last."""

    __slots__ = ("remaining", "emit", "results", "done")

    def __init__(self, count: int, emit: Callable[[Any], None] | None,
                 done: asyncio.Future[Encoded]) -> None:
        self.remaining = count
        self.emit = emit
        self.results: list[Any] = []
        self.done = done


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
        self.fns: dict[bytes, Callable[..., Any]] = {}
        self.resources: dict[int, Any] = {}
        self._iterated: set[int] = set()  # datasets an iterator was made from
        self.closures_run = 0
        self.closures_failed = 0
        self.closure_seconds = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None  # the serving loop
        self._cloop: asyncio.AbstractEventLoop | None = None  # the closure loop
        self._cthread: threading.Thread | None = None
        self._sync_q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._idle_lock = threading.Lock()
        self._base_context: contextvars.Context | None = None
        self._base_channels: ChannelPool | None = None
        # Closure tasks run on the closure loop and belong to this owner; by id for cancels.
        self._closure_owner = TaskOwner(f"closures of {self.task}")
        self._closure_tasks: dict[int, asyncio.Task[Any]] = {}
        self._cancelled: set[int] = set()
        self.draining = False  # leaving: no new closures
        self._open_batches = 0  # worker/run requests not yet answered
        self._in_flight: set[int] = set()  # ids started and not yet reported
        self._outbox: list[tuple[_Batch, list[Any]]] = []
        self._outbox_lock = threading.Lock()
        self._scalars: list[list[Any]] = []  # pstrain.summary scalars waiting to leave
        self.scalars_dropped = 0  # past MAX_PENDING_SCALARS (a closure logging in a tight loop)
        self._flush_scheduled = False
        self.route("worker/configure", self.configure)
        self.route("worker/run", self.run_closures, pickle=True, stream=True)
        self.route("worker/cancel", self.cancel)
        self.route("worker/resource", self.create_resource, pickle=True)
        self.route("worker/drop_resources", self.drop_resources)
        self.route("worker/reset_channels", self.reset_channels)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> str:
        self._loop = loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        self._cthread = threading.Thread(target=self._closure_main, args=(loop, ready),
                                         name=f"pstrain-worker{self.index}-closures", daemon=True)
        self._cthread.start()
        await ready
        return await super().start()

    def _closure_main(self, serving: asyncio.AbstractEventLoop, ready: asyncio.Future[None]) -> None:
        loop = new_event_loop()
        asyncio.set_event_loop(loop)
        self._cloop = loop
        serving.call_soon_threadsafe(_set_none, ready)
        try:
            loop.run_forever()
        finally:
            loop.close()

    def _context(self) -> contextvars.Context:
        """A fresh context for one closure or dataset function of this worker.

        Copies of one base context (O(1)), rebuilt when the channels change; each run needs
        its own copy, since one context cannot be entered by two threads at once.
        """
        base = self._base_context
        if base is None or self._base_channels is not self.channels:
            base = self._base_context = worker_context(self.index, self.channels, self._scalar)
            self._base_channels = self.channels
        return base.copy()

    async def on_stop(self) -> None:
        cloop = self._cloop
        if cloop is not None and cloop.is_running():
            async def shutdown() -> None:
                await self._closure_owner.close()
                if self.channels is not None:
                    await self.channels.close()

            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(shutdown(), cloop))
            cloop.call_soon_threadsafe(cloop.stop)
        for _ in self._threads:
            self._sync_q.put(None)
        if self._cthread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._cthread.join, 5.0)

    def statistics(self, req: Any) -> dict[str, Any]:
        out = super().statistics(req)
        out.update(closures_run=self.closures_run, closures_failed=self.closures_failed,
                   closure_seconds=self.closure_seconds,
                   closures_running=len(self._closure_tasks), resources=len(self.resources))
        return out

    # -- handlers --------------------------------------------------------------------------
    # -- draining (SIGTERM: a preemption notice) -------------------------------------------------
    def begin_drain(self) -> None:
        """Take no new closures (they are refused with DrainingError and run elsewhere);
        those running finish and report as usual."""
        if not self.draining:
            self.draining = True
            logger.info("%s draining: %d closure(s) to finish, no new ones", self.task,
                        len(self._in_flight))

    async def drained(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until the closures running have reported."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self._in_flight or self._outbox or self._open_batches:
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.02)  # a leaving process polls its own state; no peer waits on it
        return True

    def _refuse_if_draining(self) -> None:
        if self.draining:
            raise DrainingError(f"{self.task} is leaving (draining): its closures go to other "
                                "workers", task=self.task)

    @property
    def joined(self) -> bool:
        """Started with ``--join``: it takes the index the coordinator gives it (and answers
        a handshake dialled as any worker index)."""
        return self.answers_any_index

    @joined.setter
    def joined(self, value: bool) -> None:
        self.answers_any_index = value

    def configure(self, req: ConfigureRequest) -> dict[str, Any]:
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
                self.tasks.spawn(_close_on(old, self._cloop))
        return {"incarnation": self.incarnation, "index": self.index}

    async def run_closures(self, req: RunRequest, emit: Callable[[Any], None] | None) -> Encoded:
        """Run a batch of closures; partial replies carry results as they finish."""
        self._check_incarnation(req.incarnation)
        fns = req.fns
        if fns:
            import cloudpickle

            for digest, pickled in fns.items():
                try:
                    self.fns[digest] = cloudpickle.loads(pickled)
                except Exception as exc:  # e.g. a module the worker cannot import
                    self.fns[digest] = _Unloadable(exc)
        closures = req.closures
        if not closures:
            return _encode_results([])  # nothing to run: answered at once
        self._refuse_if_draining()
        loop = asyncio.get_running_loop()
        batch = _Batch(len(closures), emit, loop.create_future())
        fence = (req.owner, self.index, req.epoch) if req.epoch is not None else None
        self._open_batches += 1
        try:
            self._start_batch(batch, closures, fence, req.once)
            return await batch.done
        finally:
            self._open_batches -= 1

    def _check_incarnation(self, expected: str | None) -> None:
        if expected is not None and expected != self.incarnation:
            raise ClosureAbortedError(
                f"{self.task} restarted since the coordinator connected (it has none of the "
                "functions or resources sent before); reconnect")

    def cancel(self, req: CancelRequest) -> dict[str, Any]:
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

    async def create_resource(self, req: ResourceRequest) -> dict[str, Any]:
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
            if isinstance(source, _FailedResource):
                raise source.error
            # Every iter() starts from the beginning (TF): a dropped dataset, or a
            # single-pass one (an iterator) already iterated, is built afresh.
            if source is None or (iter(source) is source and of in self._iterated):
                source = fn()
            self._iterated.add(of)  # type: ignore[arg-type]
            return LockedIterator(iter(source), _dataset_name(fn), self.task)

        ctx = self._context()
        try:
            self.resources[rid] = await asyncio.get_running_loop().run_in_executor(None, ctx.run, build)
        except Exception as exc:
            self.resources[rid] = _FailedResource(exc)
            return {"rid": rid, "error": exception_payload(exc)}
        return {"rid": rid}

    def reset_channels(self, req: ResetRequest) -> dict[str, Any]:
        """The coordinator found ``job:index`` unreachable: drop our connections to it, so the
        closures using them fail now and later ones reach it afresh once it is back."""
        if self.channels is not None:
            self.channels.reset(req.job, req.index)
        return {}

    def drop_resources(self, req: DropRequest) -> dict[str, Any]:
        for rid in req.rids:
            self.resources.pop(rid, None)
        return {"resources": len(self.resources)}

    # -- running closures (closure loop) ---------------------------------------------------------
    def _closure_context(self, fence: tuple[str | None, int, int] | None, once_key: str | None) -> contextvars.Context:
        ctx = self._context()
        if fence is not None or once_key is not None:
            ctx.run(set_dispatch, fence, once_key)
        return ctx

    def _start_batch(self, batch: _Batch, closures: list[Any], fence: tuple[str | None, int, int] | None = None,
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
                    args, kwargs = self._resolve(args), self._resolve(kwargs)
                except BaseException as exc:
                    self._deliver(batch, [cid, ERROR, exception_payload(exc)])
                    continue
            once_key = once.get(cid) if once else None
            if inspect.iscoroutinefunction(fn):
                coros.append((cid, fn, args, kwargs, self._closure_context(fence, once_key)))
            else:
                with self._idle_lock:
                    spawn = self._idle == 0 and len(self._threads) < self.closure_threads
                if spawn:
                    self._spawn_thread()
                self._sync_q.put((batch, cid, fn, args, kwargs, self._closure_context(fence, once_key)))
        if coros:
            assert self._cloop is not None
            self._cloop.call_soon_threadsafe(self._start_coros, batch, coros)

    def _start_coros(self, batch: _Batch, coros: list[Any]) -> None:
        loop = self._cloop
        assert loop is not None
        for cid, fn, args, kwargs, ctx in coros:
            if cid in self._cancelled:
                self._deliver(batch, [cid, CANCELLED, None])
                continue
            self._closure_tasks[cid] = self._closure_owner.spawn(
                self._run_async(batch, cid, fn, args, kwargs), context=ctx)  # one each

    def _resolve(self, obj: Any) -> Any:
        if isinstance(obj, ResourceRef):
            res = self.resources.get(obj.rid)
            if res is None:
                raise ClosureInputError(
                    f"per-worker resource {obj.rid} does not exist on worker {self.index}")
            if isinstance(res, _FailedResource):
                raise ClosureInputError(
                    f"Input has an error, the original exception is {type(res.error).__name__}, "
                    f"error message is {res.error}")
            return res
        if type(obj) is tuple:
            return tuple(self._resolve(x) for x in obj)
        if type(obj) is list:
            return [self._resolve(x) for x in obj]
        if type(obj) is dict:
            return {k: self._resolve(v) for k, v in obj.items()}
        return obj

    async def _run_async(self, batch: _Batch, cid: int, fn: Callable[..., Any], args: Any,
                         kwargs: Any) -> None:
        started = time.perf_counter()
        try:
            with watch_unawaited() as missed:
                value = await fn(*args, **kwargs)
            _check_awaited(missed)
            record = [cid, OK, value]
        except asyncio.CancelledError:
            record = [cid, CANCELLED, None]
        except BaseException as exc:  # user code: report whatever it raised
            record = [cid, ERROR, exception_payload(exc)]
        finally:
            self._closure_tasks.pop(cid, None)
        self._deliver(batch, record, time.perf_counter() - started)

    def _spawn_thread(self) -> None:
        t = threading.Thread(target=self._thread_main, daemon=True,
                             name=f"pstrain-worker{self.index}-sync{len(self._threads)}")
        self._threads.append(t)
        t.start()

    def _thread_main(self) -> None:
        q = self._sync_q
        lock = self._idle_lock
        while True:
            with lock:
                self._idle += 1
            item = q.get()
            with lock:
                self._idle -= 1
            if item is None:
                return
            batch, cid, fn, args, kwargs, ctx = item
            if cid in self._cancelled:
                self._cancelled.discard(cid)
                self._deliver(batch, [cid, CANCELLED, None])
                continue
            started = time.perf_counter()
            try:
                value = ctx.run(self._call_sync, fn, args, kwargs)
                record = [cid, OK, value]
            except BaseException as exc:
                record = [cid, ERROR, exception_payload(exc)]
            self._deliver(batch, record, time.perf_counter() - started)
            # Not held while waiting for the next closure: a dropped resource must go.
            del item, fn, args, kwargs, ctx, record

    def _call_sync(self, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """A plain ``def`` closure, on a pool thread; an awaitable it returns (``lambda:
        v.assign_add(1.0)``) finishes on the closure loop, where the channels live."""
        with watch_unawaited() as missed:
            value = fn(*args, **kwargs)
            if inspect.isawaitable(value):
                value = block_on(lambda: value, self._cloop, what="a closure's awaitable")
        _check_awaited(missed)
        return value

    def _scalar(self, name: str, value: float, step: int, wall_time: float) -> None:
        """A closure logged a scalar (any thread): it leaves with the next results."""
        with self._outbox_lock:
            if len(self._scalars) < MAX_PENDING_SCALARS:
                self._scalars.append([name, value, step, wall_time])
            else:
                self.scalars_dropped += 1

    def _deliver(self, batch: _Batch, record: list[Any], seconds: float = 0.0) -> None:
        """Called on any thread when a closure ends; results leave in coalesced messages."""
        with self._outbox_lock:
            self.closure_seconds += seconds
            self._outbox.append((batch, record))
            if self._flush_scheduled:
                return
            self._flush_scheduled = True
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._outbox_lock:
            outbox, self._outbox = self._outbox, []
            scalars, self._scalars = self._scalars, []
            self._flush_scheduled = False
        touched: dict[int, _Batch] = {}
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
                    batch.done.set_result(_encode_results(results, scalars))
                    scalars = []
            elif batch.emit is not None:
                results, batch.results = batch.results, []
                try:
                    batch.emit(_encode_results(results, scalars))
                    scalars = []
                except Exception:  # connection gone: the coordinator reschedules
                    logger.debug("could not send partial results", exc_info=True)
            # over HTTP (no emit) results wait for the last one


class _Unloadable:
    """A function that failed to unpickle here: calling it raises why."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise self.error


async def _close_on(channels: ChannelPool, loop: asyncio.AbstractEventLoop) -> None:
    """Close ``channels``' connections of ``loop`` (the closure loop), from the serving loop."""
    await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(channels.close(), loop))


def _set_none(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _encode_results(results: list[Any], scalars: list[Any] | None = None) -> Encoded:
    """Encode results once; a result that cannot travel becomes an error saying so."""
    extra = {"scalars": scalars} if scalars else {}
    try:
        return Encoded(wire.encode_body({"results": results, **extra}, allow_pickle=True))
    except Exception:
        pass
    out = []
    for record in results:
        try:
            wire.encode_body(record, allow_pickle=True)
            out.append(record)
        except Exception as exc:
            err = TypeError(f"the closure's result of type {type(record[2]).__name__} cannot be "
                            f"sent back to the coordinator: {exc}")
            out.append([record[0], ERROR, exception_payload(err)])
    return Encoded(wire.encode_body({"results": out, **extra}, allow_pickle=True))


def _dataset_name(fn: Any) -> str:
    """How an error names a dataset: ``dataset_fn`` 'make_data' (what the user wrote)."""
    inner = getattr(fn, "fn", None) or getattr(fn, "value", None) or fn
    name = getattr(inner, "__qualname__", None) or type(inner).__qualname__
    return f"dataset_fn {name!r}" if callable(inner) else f"the dataset {name!r}"
