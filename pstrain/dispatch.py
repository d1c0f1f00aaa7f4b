"""One dispatcher per worker: sends closures in batches and handles its worker's failures.

A dispatcher takes as many closures from the coordinator's shared FIFO as its
worker has room for (``max_inflight_per_worker``) and sends them in one
``worker/run`` request; results stream back as partial replies. Before any
closure it builds the worker's per-worker resources (datasets, iterators), in
creation order.

A worker whose channel fails (refused, reset, or silent past the heartbeat
deadline) is a *worker* failure, told apart by where the error arose, not by
its text: its unfinished closures go back to the queue for any worker, the
worker is probed with capped back-off, and when it answers again its
resources are rebuilt before it takes new work. An ``UnavailableError`` that
a closure *raised* (say, a ps it could not reach) is that closure's error.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING, Any

from .cluster import task_name
from .errors import (
    CancelledError,
    ClosureAbortedError,
    ClosureInputError,
    DeadlineExceededError,
    PstrainError,
    UnavailableError,
)
from .server.worker import CANCELLED, OK, ResourceRef
from .values import PerWorkerValues

if TYPE_CHECKING:
    from .coordinator import Closure, ClusterCoordinator, ResourceSpec

logger = logging.getLogger(__name__)


class WorkerDispatcher:
    """Feeds one worker from the coordinator's queue."""

    def __init__(self, coord: ClusterCoordinator, index: int) -> None:
        self.coord = coord
        self.index = index
        self.task = task_name("worker", index)
        self.inflight: dict[int, Closure] = {}
        self.sent: set[bytes] = set()
        self.incarnation: str | None = None
        self.up = False
        self.failures = 0
        self.resources: dict[int, ResourceSpec] = {}
        self.pending_resources: deque[ResourceSpec] = deque()
        self.dropped: list[int] = []
        self._waiter: asyncio.Future[None] | None = None
        self._broken: BaseException | None = None

    # -- waking ---------------------------------------------------------------------------
    def wake(self) -> None:
        fut = self._waiter
        if fut is not None:
            self._waiter = None
            if not fut.done():
                fut.set_result(None)

    async def _wait(self) -> None:
        self._waiter = fut = asyncio.get_running_loop().create_future()
        await fut

    def channel(self) -> Any:
        return self.coord._peers.channel("worker", self.index)

    # -- main loop --------------------------------------------------------------------------
    async def run(self) -> None:
        backoff = self.coord.probe_initial_s
        while True:
            try:
                await self._connect()
                backoff = self.coord.probe_initial_s
                await self._pump()
            except (UnavailableError, DeadlineExceededError, ClosureAbortedError) as exc:
                self._lost(exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.coord.probe_max_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug here must not stop this worker's dispatch
                logger.exception("dispatcher of %s failed; reconnecting", self.task)
                self._lost(exc)
                await asyncio.sleep(backoff)

    async def _connect(self) -> None:
        ch = self.channel()
        reply = await ch.call("worker/configure", {"cluster": self.coord._peers.cluster_spec.as_dict()},
                              timeout=self.coord.worker_timeout_s)
        if reply["incarnation"] != self.incarnation:
            if self.incarnation is not None:
                logger.warning("%s restarted; rebuilding its %d per-worker resource(s)", self.task,
                               len(self.resources))
            self.incarnation = reply["incarnation"]
            self.sent.clear()
            self.pending_resources = deque(self.resources.values())
        else:  # same process: the resources it built are still there
            pending = {id(s) for s in self.pending_resources}
            for spec in self.resources.values():
                if id(spec) not in pending and not spec.rvs[self.index].done():
                    spec.built(self.index, None)
        self._broken = None
        self.up = True
        self.coord._progress()

    def _lost(self, exc: BaseException) -> None:
        """The worker failed: put its closures back; mark its resources aborted."""
        if self.up:
            self.failures += 1
            self.coord.worker_failures += 1
            logger.warning("%s is unreachable (%s); its %d closure(s) go back to the queue",
                           self.task, exc, len(self.inflight))
        self.up = False
        self.incarnation_lost()
        closures = list(self.inflight.values())
        self.inflight.clear()
        self.coord._put_back(closures)
        self.coord._progress()

    def incarnation_lost(self) -> None:
        for spec in self.resources.values():
            spec.abort(self.index)

    async def _pump(self) -> None:
        coord = self.coord
        queue = coord._queue
        limit = coord.max_inflight_per_worker
        while True:
            if self._broken is not None:
                raise self._broken
            if self.dropped:
                rids, self.dropped = self.dropped, []
                await self.channel().call("worker/drop_resources", {"rids": rids})
            if self.pending_resources:
                await self._build(self.pending_resources[0])
                self.pending_resources.popleft()
                continue
            if coord._strategy_pending():
                await coord.strategy.flush()
            room = limit - len(self.inflight)
            if not queue or room <= 0:
                await self._wait()
                continue
            n = min(room, len(queue), coord.max_batch)
            batch = [queue.popleft() for _ in range(n)]
            for c in batch:
                self.inflight[c.cid] = c
            coord._inflight += n
            coord._spawn(self._send(batch))

    async def _build(self, spec: ResourceSpec) -> None:
        try:
            reply = await self.channel().call(
                "worker/resource", {**spec.request(), "incarnation": self.incarnation}, pickle=True,
                timeout=None)
        except (UnavailableError, DeadlineExceededError):
            raise  # the worker failed: handled by run()
        except ClosureAbortedError as exc:  # it restarted under us
            raise UnavailableError(str(exc), task=self.task) from exc
        except PstrainError as exc:  # the worker refused it (cannot unpickle, say)
            reply = {"error": {"type": type(exc).__name__, "message": exc.message,
                               "traceback": exc.remote_traceback}}
        spec.built(self.index, reply.get("error"))

    # -- sending closures ------------------------------------------------------------------------
    async def _send(self, batch: list[Closure]) -> None:
        coord = self.coord
        ready: list[Closure] = []
        for c in batch:
            if c.inputs and not all(rv.done() for rv in c.inputs):
                coord._spawn(self._send_when_ready(c))
            else:
                ready.append(c)
        if ready:
            await self._send_now(ready)

    async def _send_when_ready(self, c: Closure) -> None:
        for rv in c.inputs:
            try:
                await rv
            except BaseException:
                pass  # reported by _prepare as ClosureInputError
        await self._send_now([c])

    def _prepare(self, c: Closure) -> list[Any] | None:
        """The wire entry of one closure for this worker (None: it failed locally)."""
        args, kwargs, has_refs = c.args, c.kwargs, False
        if c.walk:
            try:
                args, has_refs = _substitute(args, self.index)
                kwargs, kw_refs = _substitute(kwargs, self.index)
                has_refs = has_refs or kw_refs
            except ClosureInputError as exc:
                self._finish(c.cid, exc, failed=True)
                return None
        return [c.cid, c.digest, args, kwargs, has_refs]

    async def _send_now(self, batch: list[Closure]) -> None:
        fns: dict[bytes, bytes] = {}
        entries = []
        for c in batch:
            entry = self._prepare(c)
            if entry is None:
                continue
            if c.digest not in self.sent:
                fns[c.digest] = c.pickled
            entries.append(entry)
        if not entries:
            return
        self.sent.update(fns)
        try:
            reply = await self.channel().call_stream(
                "worker/run", {"fns": fns, "closures": entries, "incarnation": self.incarnation},
                self._on_results, pickle=True)
        except (UnavailableError, DeadlineExceededError, ClosureAbortedError) as exc:
            self._broken = exc
            if any(e[0] in self.inflight for e in entries):
                self._lost(exc)  # put back now; the pump loop reconnects
            self.wake()
            return
        except PstrainError as exc:
            # The worker refused the batch itself (it could not decode it, say): those closures fail.
            for e in entries:
                self._finish(e[0], exc, failed=True)
            return
        self._on_results(reply)

    def _on_results(self, reply: Any) -> None:
        coord = self.coord
        for cid, status, value in reply["results"]:
            if status == OK:
                self._finish(cid, value)
            elif status == CANCELLED:
                self._finish(cid, CancelledError(
                    "The corresponding function is cancelled. Please reschedule the function.",
                    task=self.task), failed=True, cancelled=True)
            else:
                self._finish(cid, coord._rebuild_error(value, self.task), failed=True)

    def _finish(self, cid: int, value: Any, *, failed: bool = False, cancelled: bool = False) -> None:
        c = self.inflight.pop(cid, None)
        if c is None:
            return  # abandoned after a cancellation, or put back after a failure
        coord = self.coord
        coord._inflight -= 1
        coord.closures_done += 1
        if failed:
            c.rv._set_error(value)
            if not cancelled:
                coord._record_error(value, c)
        else:
            c.rv._set_value(value)
        self.wake()
        coord._progress()


def _substitute(obj: Any, index: int) -> tuple[Any, bool]:
    """Per-worker values -> this worker's part; RemoteValues -> their values."""
    from .remote_value import RemoteValue

    if isinstance(obj, PerWorkerValues):
        rid = getattr(obj, "_rid", None)
        if rid is not None:
            return ResourceRef(rid), True
        return _substitute(obj.values[index], index)
    if isinstance(obj, RemoteValue):
        try:
            return obj._result(), False
        except BaseException as exc:
            raise ClosureInputError(
                f"Input has an error, the original exception is {type(exc).__name__}, "
                f"error message is {exc}") from exc
    if type(obj) is tuple or type(obj) is list:
        items = [_substitute(x, index) for x in obj]
        out = [x for x, _ in items]
        return (tuple(out) if type(obj) is tuple else out), any(r for _, r in items)
    if type(obj) is dict:
        items2 = {k: _substitute(v, index) for k, v in obj.items()}
        return {k: x for k, (x, _) in items2.items()}, any(r for _, r in items2.values())
    return obj, False
