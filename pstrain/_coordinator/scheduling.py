"""The scheduling core: closures, the queue, in-flight accounting and the first error.

No I/O and no tasks here (the h11 / dask ``WorkerState`` discipline): a
:class:`ClosureQueue` takes events (a closure scheduled, work taken by a
worker, a result, a worker lost) and keeps the state TF's
``ClusterCoordinator`` defines:

* closures run in FIFO order; each is in the queue, in flight on exactly one
  worker, or finished (its :class:`~pstrain._coordinator.remote_value.Outcome` resolved);
* the **first error wins**: a closure that fails records its error unless one
  is already pending; later errors are dropped;
* recording it **cancels what is queued** (their RemoteValues raise
  :class:`~pstrain.errors.CancelledError`) and asks every worker with closures
  in flight to cancel them (:meth:`ClosureQueue.take_cancellations`);
* :meth:`ClosureQueue.take_error` hands the error to the caller that raises it
  (``join``/``schedule``/``done``), abandons what is still in flight as
  cancelled, and **clears** it: the coordinator keeps working;
* closures of a **lost worker are put back** at the front of the queue (in
  their order) and run elsewhere, unless an error is pending (then they are
  cancelled);
* a closure's **RemoteValue inputs** are resolved before it is sent
  (``Closure.arguments_for``, in ``closures.py``); a failed input fails it with
  :class:`~pstrain.errors.ClosureInputError`, also when the producer's error
  cancels the rest (a consumer of a failed value always learns why).

Dispatchers drive it and are told of new work or errors through ``wake``
callbacks; :meth:`ClosureQueue.wait_idle` and :meth:`ClosureQueue.wait_drained`
are what ``join()`` waits on.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from collections.abc import Callable, Collection
from typing import Any

from .._base.errors import CancelledError
from .closures import Closure

__all__ = ["CANCELLED_MESSAGE", "ClosureQueue"]

CANCELLED_MESSAGE = "The corresponding function is cancelled. Please reschedule the function."


class ClosureQueue:
    """The closures of one coordinator: queued, in flight per worker, and the first error."""

    def __init__(self) -> None:
        self._queue: deque[Closure] = deque()
        self._inflight: dict[int, Closure] = {}
        self._held: dict[int, Closure] = {}  # failed on a lost ps: back in the queue once it is replaced
        self._per_worker: dict[int, int] = {}
        self._error: BaseException | None = None
        self._cancel: dict[int, list[int]] = {}  # worker -> in-flight ids to cancel there
        self._listeners: list[Callable[[], None]] = []
        self._idle_waiters: list[asyncio.Future[None]] = []
        self._drain_waiters: list[asyncio.Future[None]] = []
        self.done_count = 0
        self.retried_count = 0
        #: Called with a closure's error and how to put it back: True if it holds the
        #: closure instead of failing it (a ps lost and replaced, ``elastic/replace.py``).
        self.hold: Callable[[BaseException, Callable[[], Any]], bool] | None = None
        #: No closure is handed out while paused (Ctrl-C: those in flight finish first).
        self.paused = False
        #: Workers whose per-worker iterator ran out: they take no more closures, so that
        #: the other workers' remaining batches are all consumed before the job's
        #: OutOfRangeError (cleared when the error is raised, or the worker restarts).
        self._exhausted: set[int] = set()

    # -- observers ------------------------------------------------------------------------------
    def add_listener(self, wake: Callable[[], None]) -> None:
        """``wake()`` is called when there is new work, an error, or room."""
        self._listeners.append(wake)

    def _wake(self) -> None:
        for wake in self._listeners:
            wake()

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def in_flight_on(self, worker: int) -> int:
        return self._per_worker.get(worker, 0)

    @property
    def held(self) -> int:
        """Closures that failed because a ps was lost, held until it is replaced."""
        return len(self._held)

    def is_idle(self) -> bool:
        """Nothing queued, in flight or held."""
        return not self._queue and not self._inflight and not self._held

    @property
    def error(self) -> BaseException | None:
        """The pending error, if a closure failed and nobody has raised it yet."""
        return self._error

    # -- producer ---------------------------------------------------------------------------------
    def put(self, closure: Closure) -> None:
        """Queue a closure (the caller raises a pending error right after, cancelling it)."""
        self._queue.append(closure)
        for wake in self._listeners:
            wake()

    def put_cancelled_if_error(self, closure: Closure) -> None:
        """Queue a closure scheduled from another thread: cancelled if an error is pending."""
        if self._error is not None:
            closure.outcome.set_error(closure.cancel_error(CANCELLED_MESSAGE))
            return
        self.put(closure)

    # -- consumers (dispatchers) --------------------------------------------------------------------
    def take(self, worker: int, limit: int) -> list[Closure]:
        """Up to ``limit`` closures for ``worker``, now in flight on it."""
        queue = self._queue
        n = min(limit, len(queue))
        if n <= 0 or worker in self._exhausted or self.paused or self._held:
            return []
        batch = [queue.popleft() for _ in range(n)]
        for c in batch:
            c.worker = worker
            self._inflight[c.cid] = c
        self._per_worker[worker] = self._per_worker.get(worker, 0) + n
        return batch

    def _release(self, cid: int) -> Closure | None:
        c = self._inflight.pop(cid, None)
        if c is not None and c.worker is not None:
            self._per_worker[c.worker] -= 1
        return c

    def _ended(self, c: Closure) -> None:
        """Its worker reported it: a cancellation still to send for it is moot."""
        pending = self._cancel.get(c.worker) if c.worker is not None else None
        if pending and c.cid in pending:
            pending.remove(c.cid)

    def finish(self, cid: int, value: Any) -> bool:
        """Closure ``cid`` returned ``value``; False if it is no longer in flight (abandoned)."""
        c = self._inflight.pop(cid, None)  # the hot path: _release and _ended, inline
        if c is None:
            return False
        if c.worker is not None:
            self._per_worker[c.worker] -= 1
        if self._cancel:
            self._ended(c)
        self.done_count += 1
        c.outcome.set_value(value)
        if self._idle_waiters or self._drain_waiters:
            self._progress()
        return True

    def fail(self, cid: int, error: BaseException, *, cancelled: bool = False) -> bool:
        """Closure ``cid`` raised ``error`` (or was ``cancelled``): its RemoteValue raises it,
        and a real failure is recorded as the first error."""
        c = self._release(cid)
        if c is None:
            return False
        self._ended(c)
        if not cancelled and self.hold is not None and self.hold(error, functools.partial(self._unhold, cid)):
            c.worker = None
            self._held[cid] = c  # until its ps is found alive, or replaced
            return False
        self.done_count += 1
        c.outcome.set_error(error)
        if not cancelled:
            self.record_error(error)
        self._progress()
        return True

    def out_of_range(self, cid: int, error: BaseException, worker: int, up: Collection[int]) -> None:
        """Closure ``cid`` found ``worker``'s iterator at its end (``error``). While another
        worker (of those ``up``) still has data, the closure goes back to the front of the
        queue and ``worker`` takes no more; when none has, it fails with ``error`` (the
        queue is cancelled and ``join`` raises it, as TF's OutOfRangeError)."""
        self._exhausted.add(worker)
        if not set(up) - self._exhausted:
            self.fail(cid, error)
            return
        c = self._release(cid)
        if c is None:
            return
        c.worker = None
        self._queue.appendleft(c)
        self._wake()
        self._progress()

    def can_take(self, worker: int) -> bool:
        """Is there work ``worker`` may take now? (None while closures are held: they run
        again before any later closure starts.)"""
        return bool(self._queue) and worker not in self._exhausted and not self.paused and not self._held

    def refreshed(self, worker: int) -> None:
        """``worker``'s iterators were built afresh (it restarted): it takes work again."""
        self._exhausted.discard(worker)

    def put_back(self, worker: int, cids: Collection[int] | None = None) -> int:
        """``worker`` was lost (or refused ``cids``, leaving): its closures go back to the
        front of the queue, in order (or are cancelled if an error is pending). Returns how
        many. Closures it refused never ran there: they do not count as retried."""
        lost = [c for c in self._inflight.values() if c.worker == worker and (cids is None or c.cid in cids)]
        for c in lost:
            self._release(c.cid)
            c.worker = None
        self._cancel.pop(worker, None)
        if self._error is not None:
            for c in lost:
                c.outcome.set_error(c.cancel_error(CANCELLED_MESSAGE))
        else:
            if cids is None:
                self.retried_count += len(lost)
            self._queue.extendleft(reversed(lost))
        self._wake()
        self._progress()
        return len(lost)

    def in_flight_closure(self, cid: int) -> Closure | None:
        return self._inflight.get(cid)

    def _unhold(self, cid: int, error: BaseException | None = None) -> None:
        """A held closure goes back to the queue before every later one (held closures run
        again in the order they were scheduled); it does not count as retried. With
        ``error``, it fails with that instead (what holding it found out)."""
        c = self._held.pop(cid, None)
        if c is not None and error is not None:
            self.done_count += 1
            c.outcome.set_error(error)
            self.record_error(error)
            self._wake()
            self._progress()
        elif c is not None:
            queue = self._queue
            queue.insert(next((i for i, q in enumerate(queue) if q.cid > cid), len(queue)), c)
            self._wake()

    # -- errors ------------------------------------------------------------------------------------
    def record_error(self, error: BaseException) -> bool:
        """Keep ``error`` unless one is pending; cancel the queue; ask for in-flight cancels."""
        if self._error is not None:
            return False
        self._error = error
        self._cancel_queued(CANCELLED_MESSAGE, cause=error)
        for c in self._inflight.values():
            if c.worker is not None:
                self._cancel.setdefault(c.worker, []).append(c.cid)
        self._wake()
        self._progress()
        return True

    def take_cancellations(self, worker: int) -> list[int]:
        """The in-flight ids the dispatcher of ``worker`` should ask its worker to cancel."""
        return self._cancel.pop(worker, None) or []

    def take_error(self) -> BaseException | None:
        """Hand over the pending error and clear it; closures still in flight are abandoned
        (their RemoteValues raise CancelledError; late results are ignored)."""
        error = self._error
        if error is None:
            return None
        self._cancel_queued(CANCELLED_MESSAGE)
        for cid in list(self._inflight):
            c = self._release(cid)
            if c is not None:
                self.done_count += 1
                c.outcome.set_error(c.cancel_error(CANCELLED_MESSAGE))
                if c.worker is not None and cid not in self._cancel.get(c.worker, ()):
                    self._cancel.setdefault(c.worker, []).append(cid)  # stop it there too
        self._error = None
        self._exhausted.clear()  # new iterators may follow: every worker takes work again
        self._wake()
        self._progress()
        return error

    @property
    def waiting(self) -> int:
        """Closures not sent yet: queued, and held back (``cancel_queued`` fails them)."""
        return len(self._queue) + len(self._held)

    def cancel_queued(self, message: str) -> int:
        """Fail every queued closure with CancelledError(``message``); returns how many."""
        n = len(self._queue) + len(self._held)
        self._cancel_queued(message)
        self._progress()
        return n

    def _cancel_queued(self, message: str, cause: BaseException | None = None) -> None:
        """Fail every queued closure; with ``cause``, each error names the error that
        cancelled it (a RemoteValue awaited before ``join`` still says why)."""
        self._queue.extend(self._held.values())
        self._held.clear()
        while self._queue:
            c = self._queue.popleft()
            error = c.cancel_error(message)
            if cause is not None and isinstance(error, CancelledError):
                error = CancelledError(
                    f"{message} It was cancelled by an earlier error: {type(cause).__name__}: {cause}"
                )
                error.__cause__ = cause
            c.outcome.set_error(error)

    def close(self, reason: str) -> None:
        """Cancel everything, queued and in flight (the coordinator is closing)."""
        self._cancel_queued(reason)
        for cid in list(self._inflight):
            c = self._release(cid)
            if c is not None:
                c.outcome.set_error(CancelledError(reason))
        self._progress()

    # -- waiting -------------------------------------------------------------------------------------
    def _progress(self) -> None:
        if self._idle_waiters and (self._error is not None or self.is_idle()):
            _resolve(self._idle_waiters)
            self._idle_waiters = []
        if self._drain_waiters and not self._inflight:
            _resolve(self._drain_waiters)
            self._drain_waiters = []

    async def wait_idle(self) -> None:
        """Until nothing is queued or in flight, or an error is pending."""
        if self._error is not None or self.is_idle():
            return
        fut = asyncio.get_running_loop().create_future()
        self._idle_waiters.append(fut)
        await fut

    async def wait_drained(self, timeout: float | None = None) -> bool:
        """Until nothing is in flight (True), or ``timeout`` seconds (False)."""
        if not self._inflight:
            return True
        fut = asyncio.get_running_loop().create_future()
        self._drain_waiters.append(fut)
        done, _ = await asyncio.wait([fut], timeout=timeout)
        return bool(done)


def _resolve(waiters: list[asyncio.Future[None]]) -> None:
    for fut in waiters:
        if not fut.done():
            fut.set_result(None)
