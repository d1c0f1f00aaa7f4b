"""ClusterCoordinator: schedule closures onto workers, join, and report failures.

``schedule(fn, args, kwargs)`` puts a closure on one FIFO queue and returns a
:class:`~pstrain.remote_value.RemoteValue` at once; one dispatcher per worker
(``dispatch.py``) pulls from the queue. Error semantics follow TF's
``ClusterCoordinator``:

* the first error a closure raises is kept (later ones are dropped) and is
  raised, with its own type and the remote traceback, by the next ``join()``,
  ``schedule()`` or ``done()``;
* when it is, the closures still queued are cancelled, those in flight are
  cancelled on their workers, their RemoteValues raise
  :class:`pstrain.errors.CancelledError`, and the error is cleared: the
  coordinator keeps working.

Beyond TF, a RemoteValue may be passed to ``schedule``: it is resolved before
the closure runs, and a failed producer fails the consumer with
:class:`~pstrain.errors.ClosureInputError`.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle

from . import _context, _pickling
from .data import PerWorkerDataset, ResourceSpec
from .dispatch import WorkerDispatcher
from .errors import (
    CancelledError,
    DeadlineExceededError,
    InvalidArgumentError,
    PstrainError,
    UnavailableError,
)
from .remote_value import RemoteValue
from .strategy import ParameterServerStrategy
from .values import PerWorkerValues

logger = logging.getLogger(__name__)

__all__ = ["ClusterCoordinator", "get_current_worker_index"]

_CANCELLED = "The corresponding function is cancelled. Please reschedule the function."


def get_current_worker_index() -> int:
    """The index of the worker running the current closure or dataset function."""
    index = _context.worker_index()
    if index is None:
        raise RuntimeError("Currently accessing worker index inside non-dispatched function: "
                           "get_current_worker_index() works inside closures and dataset functions")
    return index


class Closure:
    __slots__ = ("cid", "fn", "digest", "pickled", "args", "kwargs", "rv", "walk", "inputs")

    def __init__(self, cid: int, fn: Callable[..., Any], digest: bytes, pickled: bytes,
                 args: tuple[Any, ...], kwargs: dict[str, Any], rv: RemoteValue, walk: bool,
                 inputs: list[RemoteValue]) -> None:
        self.cid = cid
        self.fn = fn
        self.digest = digest
        self.pickled = pickled
        self.args = args
        self.kwargs = kwargs
        self.rv = rv
        self.walk = walk
        self.inputs = inputs


def _scan(obj: Any, inputs: list[RemoteValue]) -> bool:
    """Does ``obj`` hold per-worker or remote values (so it must be rewritten per worker)?"""
    if isinstance(obj, RemoteValue):
        inputs.append(obj)
        return True
    if isinstance(obj, PerWorkerValues):
        return True
    if type(obj) is tuple or type(obj) is list:
        found = False
        for x in obj:
            found = _scan(x, inputs) or found
        return found
    if type(obj) is dict:
        found = False
        for x in obj.values():
            found = _scan(x, inputs) or found
        return found
    return False


class ClusterCoordinator:
    """Schedules closures onto the workers of a :class:`ParameterServerStrategy`.

    One per strategy: constructing it again returns the same coordinator.

    >>> # coordinator = pstrain.ClusterCoordinator(strategy)
    >>> # rv = coordinator.schedule(step_fn, args=(iterator,))
    >>> # await coordinator.join(); print(await rv)
    """

    def __new__(cls, strategy: ParameterServerStrategy, *args: Any, **kwargs: Any) -> ClusterCoordinator:
        existing = getattr(strategy, "_coordinator", None)
        if existing is not None and not existing._closed:
            return existing
        return super().__new__(cls)

    def __init__(self, strategy: ParameterServerStrategy, max_inflight_per_worker: int = 1, *,
                 max_batch: int = 1024, worker_timeout_s: float = 10.0,
                 ps_timeout_s: float = 10.0, heartbeat_s: float = 1.0,
                 probe_initial_s: float = 0.05, probe_max_s: float = 2.0,
                 cancel_grace_s: float = 10.0) -> None:
        if getattr(self, "_initialized", False):
            return
        if not isinstance(strategy, ParameterServerStrategy):
            raise InvalidArgumentError("ClusterCoordinator needs a ParameterServerStrategy, got "
                                       f"{type(strategy).__name__}")
        if max_inflight_per_worker < 1:
            raise InvalidArgumentError("max_inflight_per_worker must be at least 1")
        self._initialized = True
        self.strategy = strategy
        strategy._coordinator = self
        self._peers = strategy._peers
        self.max_inflight_per_worker = max_inflight_per_worker
        self.max_batch = max_batch
        self.worker_timeout_s = worker_timeout_s
        self.ps_timeout_s = ps_timeout_s
        self.heartbeat_s = heartbeat_s
        self.probe_initial_s = probe_initial_s
        self.probe_max_s = probe_max_s
        self.cancel_grace_s = cancel_grace_s
        self._queue: deque[Closure] = deque()
        self._inflight = 0
        self._error: BaseException | None = None
        self._ids = itertools.count(1)
        self._rids = itertools.count(1)
        self._fns: dict[Any, tuple[bytes, bytes]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._idle_waiters: list[asyncio.Future[None]] = []
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._closed = False
        self._workers = [WorkerDispatcher(self, i) for i in range(strategy._num_workers)]
        self.closures_done = 0
        self.closures_retried = 0
        self.worker_failures = 0

    # -- loop and tasks ---------------------------------------------------------------------
    def _ensure_started(self) -> None:
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        for w in self._workers:
            self._spawn(w.run())
        self._spawn(self._watch())
        chief = self._chief_address()
        if chief is not None:  # TF_CONFIG names this process's address: serve /metrics there
            self._spawn(self.serve_metrics(*chief))

    def _chief_address(self) -> tuple[str, int] | None:
        from .cluster import parse_address
        from .server.base import is_loopback

        resolver = self.strategy.cluster_resolver
        spec = self._peers.cluster_spec
        if getattr(resolver, "task_type", None) != "chief" or not spec.num_tasks("chief"):
            return None
        host, port = parse_address(spec.task_address("chief", 0))
        if port == 0:
            return None
        return ("127.0.0.1" if is_loopback(host) else "0.0.0.0"), port

    async def _watch(self) -> None:
        """While closures run, ping their workers and every ps: silence past the deadline
        is a failure (a worker's closures are rescheduled; a ps fails the job)."""
        while True:
            await asyncio.sleep(self.heartbeat_s)
            if not self._inflight or self._error is not None:
                continue
            await asyncio.gather(*(self._ping_worker(w) for w in self._workers if w.up and w.inflight),
                                 *(self._ping_ps(k) for k in range(self.strategy._num_ps)))

    async def _ping_worker(self, w: WorkerDispatcher) -> None:
        try:
            await w.channel().call("health", None, timeout=self.worker_timeout_s)
        except (UnavailableError, DeadlineExceededError) as exc:
            logger.warning("%s did not answer a health check: %s", w.task, exc)
            await w.channel().close()  # fails its pending calls: the dispatcher reschedules

    async def _ping_ps(self, k: int) -> None:
        try:
            await self._peers.channel("ps", k).call("health", None, timeout=self.ps_timeout_s)
        except (UnavailableError, DeadlineExceededError) as exc:
            task = f"/job:ps/replica:0/task:{k}"
            self._record_error(UnavailableError(
                f"parameter server {task} is unavailable ({exc}); restart it and restore the "
                "latest checkpoint", task=task), None)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("coordinator task failed", exc_info=task.exception())

    def _on_loop_thread(self) -> bool:
        try:
            return asyncio.get_running_loop() is self._loop or self._loop is None
        except RuntimeError:
            return self._loop is None

    def _strategy_pending(self) -> bool:
        return bool(self.strategy._pending) or self.strategy._flushing is not None

    # -- scheduling ---------------------------------------------------------------------------
    def _function(self, fn: Callable[..., Any]) -> tuple[bytes, bytes]:
        try:
            cached = self._fns.get(fn)
        except TypeError:  # unhashable callable
            cached = None
        if cached is None:
            try:
                pickled = _pickling.dumps(fn)
            except Exception as exc:
                raise InvalidArgumentError(
                    f"cannot send {fn!r} to the workers: it does not pickle ({exc}); closures "
                    "may capture variables, arrays and plain values, not open files or locks") from exc
            cached = (hashlib.blake2b(pickled, digest_size=16).digest(), pickled)
            try:
                self._fns[fn] = cached
            except TypeError:
                pass
        return cached

    def schedule(self, fn: Callable[..., Any], args: Sequence[Any] = (),
                 kwargs: dict[str, Any] | None = None) -> RemoteValue:
        """Queue ``fn(*args, **kwargs)`` to run on some worker; returns at once.

        The function is pickled once, on its first schedule, and sent to each
        worker once; pass values that change from step to step as ``args``.
        """
        if not callable(fn):
            raise TypeError(f"schedule needs a callable (a function or coroutine function), "
                            f"got {type(fn).__name__}")
        if self._closed:
            raise PstrainError("this ClusterCoordinator is closed")
        args = tuple(args)
        kwargs = dict(kwargs) if kwargs else {}
        digest, pickled = self._function(fn)
        inputs: list[RemoteValue] = []
        walk = bool(args or kwargs) and (_scan(args, inputs) | _scan(kwargs, inputs))
        rv = RemoteValue(self._loop)
        closure = Closure(next(self._ids), fn, digest, pickled, args, kwargs, rv, walk, inputs)
        if self._on_loop_thread():
            try:
                self._ensure_started()
                rv._loop = self._loop
            except RuntimeError:
                pass  # no loop yet: dispatch starts with the first join()
            self._queue.append(closure)
            self._wake_dispatchers()
            if self._error is not None:
                self._raise_pending()
        else:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._enqueue_from_thread, closure)
        return rv

    def _enqueue_from_thread(self, closure: Closure) -> None:
        if self._error is not None:
            closure.rv._set_error(CancelledError(_CANCELLED))
            return
        self._queue.append(closure)
        self._wake_dispatchers()

    def _wake_dispatchers(self) -> None:
        for w in self._workers:
            if w._waiter is not None:
                w.wake()

    def _put_back(self, closures: list[Closure]) -> None:
        """Closures of a failed worker: back on the queue (cancelled if an error is pending)."""
        self._inflight -= len(closures)
        for c in closures:
            if self._error is not None:
                c.rv._set_error(CancelledError(_CANCELLED))
            else:
                self.closures_retried += 1
                self._queue.append(c)
        self._wake_dispatchers()
        self._progress()

    # -- errors ---------------------------------------------------------------------------------
    def _rebuild_error(self, payload: dict[str, Any], task: str) -> BaseException:
        exc: BaseException | None = None
        if payload.get("pickled"):
            try:
                exc = cloudpickle.loads(payload["pickled"])
            except Exception:
                exc = None
        if not isinstance(exc, BaseException):
            exc = PstrainError(f"{payload.get('type')}: {payload.get('message')}", task=task,
                               remote_traceback=payload.get("traceback"))
        if isinstance(exc, PstrainError):
            exc.task = exc.task or task
            exc.remote_traceback = exc.remote_traceback or payload.get("traceback")
        if hasattr(exc, "add_note"):
            exc.add_note(f"raised on {task}; remote traceback:\n{payload.get('traceback', '')}")
        return exc

    def _record_error(self, exc: BaseException, closure: Closure | None) -> None:
        if self._error is not None:
            return  # first error wins
        logger.error("%s encountered the following error when processing closure: %r",
                     getattr(exc, "task", None) or "a worker", exc)
        self._error = exc
        self._cancel_all()
        self._progress()

    def _cancel_all(self) -> None:
        """Cancel queued closures now, and ask workers to cancel those in flight."""
        while self._queue:
            self._queue.popleft().rv._set_error(CancelledError(_CANCELLED))
        for w in self._workers:
            if w.inflight and w.up:
                ids = list(w.inflight)
                self._spawn(_send_cancel(w, ids))

    def _raise_pending(self) -> None:
        """Raise and clear the pending error (in-flight closures are abandoned as cancelled)."""
        exc = self._error
        assert exc is not None
        self._cancel_all()
        for w in self._workers:
            for cid in list(w.inflight):
                w._finish(cid, CancelledError(_CANCELLED), failed=True, cancelled=True)
        self._error = None
        raise exc

    # -- waiting --------------------------------------------------------------------------------
    def _progress(self) -> None:
        if self._idle_waiters and (self._error is not None or (not self._queue and not self._inflight)):
            waiters, self._idle_waiters = self._idle_waiters, []
            _resolve(waiters)
        if self._drain_waiters and not self._inflight:
            waiters, self._drain_waiters = self._drain_waiters, []
            _resolve(waiters)

    async def _wait_idle(self) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._idle_waiters.append(fut)
        await fut

    async def join(self) -> None:
        """Wait until every scheduled closure has run; raise the first error if one failed."""
        self._ensure_started()
        while True:
            if self._error is not None:
                # Let the cancelled in-flight closures report back (bounded), then raise.
                if self._inflight:
                    fut = asyncio.get_running_loop().create_future()
                    self._drain_waiters.append(fut)
                    await asyncio.wait([fut], timeout=self.cancel_grace_s)
                self._raise_pending()
            if not self._queue and not self._inflight:
                return
            await self._wait_idle()

    def done(self) -> bool:
        """True when nothing is queued or in flight; raises the pending error if there is one."""
        if self._error is not None:
            self._raise_pending()
        return not self._queue and not self._inflight

    async def fetch(self, structure: Any) -> Any:
        """Await every RemoteValue in a nested structure; other leaves are returned as they are."""
        if isinstance(structure, RemoteValue):
            return await structure
        if isinstance(structure, PerWorkerValues):
            return PerWorkerValues([await self.fetch(v) for v in structure.values])
        if type(structure) is tuple or type(structure) is list:
            items = [await self.fetch(x) for x in structure]
            return tuple(items) if type(structure) is tuple else items
        if isinstance(structure, dict):
            return {k: await self.fetch(v) for k, v in structure.items()}
        return structure

    # -- per-worker resources --------------------------------------------------------------------------
    def create_per_worker_dataset(self, dataset_fn: Any) -> PerWorkerDataset:
        """Run ``dataset_fn`` on every worker; ``iter()`` of the result gives per-worker iterators.

        ``dataset_fn`` is a function returning any iterable (a ``pstrain.data.Dataset``, a
        generator, a list), or such an iterable itself.
        """
        if self._closed:
            raise PstrainError("this ClusterCoordinator is closed")
        fn = dataset_fn if callable(dataset_fn) and not hasattr(dataset_fn, "__iter__") \
            else _Constant(dataset_fn)
        _pickling.dumps(fn)  # registers its user modules to travel by value (and fails early)
        return PerWorkerDataset(self, self._new_resource("dataset", fn=fn))

    def _new_resource(self, kind: str, **fields: Any) -> ResourceSpec:
        spec = ResourceSpec(next(self._rids), kind, len(self._workers), self._loop, fields)
        for w in self._workers:
            w.resources[spec.rid] = spec
            w.pending_resources.append(spec)
        try:
            self._ensure_started()
        except RuntimeError:
            pass
        self._wake_dispatchers()
        return spec

    def _drop_resource(self, rid: int) -> None:
        for w in self._workers:
            if w.resources.pop(rid, None) is not None:
                w.dropped.append(rid)

    # -- observability ----------------------------------------------------------------------------
    def statistics(self) -> dict[str, Any]:
        """Counts for /metrics and `pstrain status`."""
        return {"queued": len(self._queue), "in_flight": self._inflight,
                "closures_done": self.closures_done, "closures_retried": self.closures_retried,
                "worker_failures": self.worker_failures,
                "workers_up": sum(w.up for w in self._workers)}

    async def serve_metrics(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve ``GET /metrics`` and ``/healthz`` for this coordinator; returns the address.

        Token-protected like every server (the strategy's cluster token).
        """
        from .server.base import ServerBase

        coordinator = self

        class _ChiefServer(ServerBase):
            def statistics(self, req: Any) -> dict[str, Any]:
                return {**super().statistics(req), **coordinator.statistics()}

        if self._metrics_server is None:
            self._metrics_server = _ChiefServer("chief", 0, host=host, port=port, token=self._peers.token)
            await self._metrics_server.start()
        return self._metrics_server.address  # type: ignore[return-value]

    _metrics_server: Any = None

    # -- lifecycle --------------------------------------------------------------------------------
    async def close(self) -> None:
        """Stop dispatching and close the channels to the workers."""
        if self._closed:
            return
        self._closed = True
        while self._queue:
            self._queue.popleft().rv._set_error(CancelledError("the coordinator was closed"))
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for w in self._workers:
            for c in w.inflight.values():
                c.rv._set_error(CancelledError("the coordinator was closed"))
            w.inflight.clear()
        await self._peers.close()
        if self._metrics_server is not None:
            await self._metrics_server.stop()
        if getattr(self.strategy, "_coordinator", None) is self:
            self.strategy._coordinator = None

    async def __aenter__(self) -> ClusterCoordinator:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def __reduce__(self) -> Any:
        raise TypeError("a ClusterCoordinator lives on the coordinator; a closure cannot capture it")

    def __repr__(self) -> str:
        return (f"ClusterCoordinator(workers={len(self._workers)}, queued={len(self._queue)}, "
                f"in_flight={self._inflight})")


class _Constant:
    """A dataset given as a value: every worker gets (a copy of) it."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __call__(self) -> Any:
        return self.value


async def _send_cancel(w: WorkerDispatcher, ids: list[int]) -> None:
    try:
        await w.channel().call("worker/cancel", {"ids": ids}, timeout=w.coord.worker_timeout_s)
    except PstrainError:
        pass  # the worker is gone; its closures are put back, then cancelled



def _resolve(waiters: list[asyncio.Future[None]]) -> None:
    for fut in waiters:
        if not fut.done():
            fut.set_result(None)
