"""One dispatcher per worker: feeds it closures from the queue over one channel.

A :class:`WorkerDispatcher` connects to its worker (``worker/configure``, which also tells the
worker's incarnation), builds the per-worker resources the registry says are missing, then takes
closures from the :class:`~pstrain._coordinator.scheduling.ClosureQueue` (up to
``max_inflight_per_worker``) and sends them in batches (``worker/run``); results stream back as
they finish and go to the queue.

When the worker cannot be reached its closures are put back on the queue for the other workers, and
it is probed with exponential back-off until it answers; a new incarnation (a restarted process)
gets its resources rebuilt. Every request carries the incarnation it was meant for, so a restarted
worker refuses work for its predecessor instead of running half of it. A draining worker says so
with its results: nothing more goes to it, and its going is no failure.

The dispatcher does the I/O only: the worker's state (joining, up, draining, lost, replaced,
refused), its epoch and incarnation are its :class:`~pstrain._coordinator.membership.WorkerSlot`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .._base.caches import FifoCache
from .._base.cluster import ClusterSpec, task_name
from .._base.errors import (
    AuthenticationError,
    CancelledError,
    ClosureAbortedError,
    ClosureInputError,
    DeadlineExceededError,
    DrainingError,
    InvalidArgumentError,
    NotFoundError,
    OutOfRangeError,
    ProtocolError,
    PstrainError,
    UnavailableError,
    WrongTaskError,
    to_envelope,
)
from .._base.tags import cause
from .._base.tasks import TaskOwner
from .._formats.messages.closures import (
    FUNCTION_BYTES_KEPT,
    FUNCTIONS_KEPT,
    ClosureStatus,
    exception_from_payload,
)
from .._formats.messages.operations import (
    CancelClosures,
    Configure,
    CreateResource,
    DropResources,
    RunClosures,
)
from .._formats.messages.placement_map import PlacementMap
from .._formats.messages.records import ClosureCall, ResultsReply
from .._transport.channels import Channel
from .._transport.wire import PickleFailure, pickle_failure_in
from .closures import Closure
from .membership import SlotState, WorkerSlot
from .resources import ResourceRegistry, ResourceSpec
from .scheduling import CANCELLED_MESSAGE, ClosureQueue

logger = logging.getLogger(__name__)

__all__ = ["DispatchSettings", "WorkerDispatcher"]

_LOST = (UnavailableError, DeadlineExceededError, ClosureAbortedError)


@dataclass
class DispatchSettings:
    """How dispatchers pace and probe (the coordinator's options)."""

    max_inflight_per_worker: int = 1
    max_batch: int = 1024
    worker_timeout_s: float = 10.0
    probe_initial_s: float = 0.05
    probe_max_s: float = 1.0


class _Mismatch(InvalidArgumentError):
    """The task at a worker's address is not that worker (the cluster specs disagree)."""


#: Failures of configuration: the dispatcher reports them and stops (no retry loop). (A
#: worker reached at its address before that refuses a connection there now is lost: the
#: channel says ``UnavailableError``.)
_PERMANENT = (AuthenticationError, ProtocolError, WrongTaskError, _Mismatch)


class WorkerDispatcher:
    """Feeds worker ``index`` from ``queue``; builds its resources from ``registry``.

    ``before_send()`` returns what to await before closures go out (variable
    creations still queued), or None.
    """

    def __init__(
        self,
        slot: WorkerSlot,
        queue: ClosureQueue,
        registry: ResourceRegistry,
        channel: Callable[[], Channel],
        cluster_spec: ClusterSpec,
        tasks: TaskOwner,
        settings: DispatchSettings,
        before_send: Callable[[], Awaitable[None] | None] | None = None,
        fence: Callable[[int, int], Awaitable[None]] | None = None,
        on_scalars: Callable[[list[Any]], None] | None = None,
        owner: str | None = None,
        peers: Callable[[], list[int]] | None = None,
        routes: Callable[[], PlacementMap] | None = None,
    ) -> None:
        self.slot = slot
        #: The coordinator's placement map now, and the version last sent with a batch (a
        #: newer one goes with the next: see ``RunClosures.placement``).
        self.routes = routes
        self.map_sent = 0
        self.index = index = slot.index
        #: The indices of the workers up now (where a closure whose iterator ran out here
        #: may still find data).
        self.peers = peers or (lambda: [index])
        self.owner = owner  # the coordinator incarnation its closures' updates work for
        self.on_scalars = on_scalars  # scalars closures logged (pstrain.summary), as they arrive
        self.task = task_name("worker", index)
        self.queue = queue
        self.registry = registry
        self.channel = channel
        self.cluster_spec = cluster_spec
        self.tasks = tasks
        self.settings = settings
        self.before_send = before_send
        self.fence = fence  # tells every ps to refuse this worker's updates before an epoch
        #: The function digests this incarnation was sent, as many as the coordinator keeps
        #: functions: the worker keeps twice as many, so it holds each one unless another
        #: coordinator sent it newer ones (it then answers UNSENT: ``_send_again``).
        self.sent: FifoCache[bytes, None] = FifoCache(FUNCTIONS_KEPT, FUNCTION_BYTES_KEPT)
        self._probe_now = asyncio.Event()
        self.refused: PstrainError | None = None  # a configuration error: never retried
        self._waiter: asyncio.Future[None] | None = None
        self._broken: BaseException | None = None
        queue.add_listener(self.wake)
        registry.add_listener(self.wake)

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

    @property
    def in_flight(self) -> int:
        return self.queue.in_flight_on(self.index)

    # -- the slot's state, as the coordinator reads it -------------------------------------
    @property
    def up(self) -> bool:
        return self.slot.up

    @property
    def leaving(self) -> bool:
        return self.slot.leaving

    @property
    def failures(self) -> int:
        return self.slot.failures

    @property
    def last_error(self) -> str | None:
        return self.slot.last_error

    @property
    def incarnation(self) -> str | None:
        return self.slot.incarnation

    @property
    def epoch(self) -> int:
        return self.slot.epoch

    @property
    def completed(self) -> int:
        return self.slot.completed

    # -- main loop --------------------------------------------------------------------------
    async def run(self) -> None:
        """Dispatch until cancelled; a lost worker is probed until it is back."""
        backoff = self.settings.probe_initial_s
        while True:
            try:
                await self._connect()
                backoff = self.settings.probe_initial_s
                await self._pump()
            except DrainingError as exc:  # leaving: not a failure; probe for a replacement
                self.slot.said_leaving()
                await self._lost(exc)
                await self._nap(self.settings.probe_max_s)
            except _PERMANENT as exc:  # a configuration error: retrying cannot help
                logger.error("%s: %s (not retried)", self.task, exc)
                self.refused = exc
                self.slot.refused(f"{type(exc).__name__}: {exc}")
                self._put_back()
                self.queue.record_error(exc)
                return
            except _LOST as exc:
                await self._lost(exc)
                await self._nap(backoff)
                backoff = min(backoff * 2, self.settings.probe_max_s)
            except Exception as exc:  # a bug: surface it from join(), keep this worker fed
                logger.exception("dispatcher of %s failed", self.task)
                self.queue.record_error(
                    PstrainError(
                        f"the dispatcher of {self.task} failed: {type(exc).__name__}: {exc}", task=self.task
                    )
                )
                await self._lost(exc)
                await self._nap(backoff)

    async def _connect(self) -> None:
        self.map_sent = 0  # (a fresh configuration may give the worker a pool knowing no map)
        try:
            reply = await self.channel().request(
                Configure(
                    cluster=self.cluster_spec.as_dict(),
                    index=self.index,
                    fresh=self.failures > 0 or self.incarnation is None,
                ),  # see Configure
                timeout=self.settings.worker_timeout_s,
            )
        except WrongTaskError as exc:  # the handshake: another task answers at that address
            there = (
                f"worker {exc.actual.rsplit(':', 1)[-1]}"
                if "/job:worker/" in exc.actual
                else f"not a worker ({exc.actual})"
            )
            raise _Mismatch(
                f"the cluster says {self.task} is at {self.channel().address}, but "
                f"the task there is {there}: the coordinator's cluster spec does not "
                "match the tasks' (TF_CONFIG / PSTRAIN_CONFIG)",
                task=self.task,
            ) from exc
        except NotFoundError as exc:  # the task there has no such operation
            raise _Mismatch(
                f"the cluster says {self.task} is at {self.channel().address}, but "
                f"the task there is not a worker ({exc}): fix the cluster spec "
                "(TF_CONFIG / PSTRAIN_CONFIG)",
                task=self.task,
            ) from exc
        index = reply.index
        if index != self.index:
            raise _Mismatch(
                f"the cluster says {self.task} is at {self.channel().address}, but "
                f"the task there is worker {index}: the coordinator's cluster spec "
                "does not match the tasks' (TF_CONFIG / PSTRAIN_CONFIG)",
                task=self.task,
            )
        known = self.slot.incarnation
        if self.slot.connected(reply.incarnation):
            if known is not None:
                logger.warning(
                    "%s restarted; rebuilding its %d per-worker resource(s)", self.task, len(self.registry)
                )
            self.sent.clear()
            self.registry.worker_restarted(self.index)
            self.queue.refreshed(self.index)  # its iterators start again from the beginning
        else:  # the same process: the resources it built are still there
            self.registry.worker_reconnected(self.index)
        self._broken = None

    async def _nap(self, seconds: float) -> None:
        """Wait before probing the worker again, or less if :meth:`wake_probe` is called."""
        try:  # asyncio.timeout: a close's cancel is never lost (see Channel.request)
            async with asyncio.timeout(seconds):
                await self._probe_now.wait()
        except TimeoutError:
            pass
        self._probe_now.clear()

    def wake_probe(self) -> None:
        """Probe now (a worker joined at this slot's address)."""
        self._probe_now.set()

    async def _lost(self, exc: BaseException) -> None:
        """The worker failed (or left, drained): its closures go back to the queue once its
        old epoch is fenced off every ps (if it is only cut off, not dead, its late updates
        are not applied on top of the retries'); its resources are unknown until it is back."""
        was = self.slot.state
        in_flight = self.in_flight
        epoch = self.slot.lost(f"{type(exc).__name__}: {exc}", in_flight)
        if was is SlotState.DRAINING:
            logger.info("%s left (drained)", self.task)
        elif was is SlotState.UP:
            logger.warning(
                "%s is unreachable (%s); its %d closure(s) go back to the queue%s",
                self.task,
                exc,
                in_flight,
                f" (cause={cause(self.index, epoch - 1)})" if epoch is not None else "",
            )
        if epoch is not None and self.fence is not None:
            try:
                async with asyncio.timeout(self.settings.worker_timeout_s):
                    await self.fence(self.index, epoch)
            except Exception as err:  # a ps we cannot reach cannot take the worker's updates either
                logger.warning("could not fence %s off every ps: %s", self.task, err)
        self._put_back()

    def _put_back(self) -> None:
        self.registry.worker_lost(self.index)
        self.queue.put_back(self.index)

    async def _pump(self) -> None:
        queue, index = self.queue, self.index
        limit = self.settings.max_inflight_per_worker
        while True:
            if self._broken is not None:
                raise self._broken
            if self.leaving and not queue.in_flight_on(index):
                raise DrainingError(f"{self.task} drained and is leaving", task=self.task)
            dropped = self.registry.take_dropped(index)
            if dropped:
                await self.channel().request(DropResources(rids=dropped))
            pending = self.registry.to_build(index)
            if pending:
                await self._build(pending[0])
                continue
            cancels = queue.take_cancellations(index)
            if cancels:
                self.tasks.spawn(self._send_cancel(cancels))
            room = min(limit - queue.in_flight_on(index), self.settings.max_batch)
            if not queue.can_take(index) or room <= 0 or self.leaving:
                await self._wait()
                continue
            if self.before_send is not None:
                creations = self.before_send()  # variables the closures use exist on their ps
                if creations is not None:
                    try:
                        await creations
                    except PstrainError as exc:  # a ps failed to create them: not this worker
                        self.queue.record_error(exc)
                        continue
            batch = queue.take(index, room)
            if batch:
                self.tasks.spawn(self._send(batch))
            del batch  # held across the next wait, it would keep the closures' arguments
            # (a dropped per-worker iterator, say) alive

    async def _build(self, spec: ResourceSpec) -> None:
        try:
            reply = await self.channel().request(
                CreateResource(**spec.request(), incarnation=self.incarnation)
            )
            error = reply.error
        except _LOST:
            raise  # the worker failed: handled by run()
        except PstrainError as exc:  # the worker refused it (cannot unpickle, say)
            error = to_envelope(exc, self.task, exc.remote_traceback)
        self.registry.built(self.index, spec, error)

    async def _send_cancel(self, ids: list[int]) -> None:
        try:
            await self.channel().request(CancelClosures(ids=ids), timeout=self.settings.worker_timeout_s)
        except PstrainError:
            pass  # the worker is gone; its closures are put back, then cancelled

    # -- sending closures ------------------------------------------------------------------------
    async def _send(self, batch: list[Closure]) -> None:
        ready: list[Closure] = []
        for c in batch:
            if not c.inputs or c.inputs_ready():
                ready.append(c)
            else:
                self.tasks.spawn(self._send_when_ready(c))
        if ready:
            await self._send_now(ready)

    async def _send_when_ready(self, c: Closure) -> None:
        for rv in c.inputs:
            try:
                await rv
            except BaseException:  # noqa: S110 - reported by arguments_for as ClosureInputError
                pass
        await self._send_now([c])

    async def _send_now(self, batch: list[Closure]) -> None:
        fns: dict[bytes, bytes] = {}
        entries: list[ClosureCall] = []
        sent = self.sent
        for c in batch:
            if c.walk:
                try:
                    args, kwargs, has_refs = c.arguments_for(self.index)
                except (ClosureInputError, InvalidArgumentError) as exc:
                    self.queue.fail(c.cid, exc)
                    continue
                entries.append(ClosureCall(c.cid, c.digest, args, kwargs, has_refs))
            else:
                entries.append(ClosureCall(c.cid, c.digest, c.args, c.kwargs))
            if c.digest not in sent.entries:
                fns[c.digest] = c.pickled
        if not entries:
            return
        once = {c.cid: c.once_key for c in batch if c.once_key is not None}
        for digest, pickled in fns.items():
            sent.put(digest, None, len(pickled))
        placement = self.routes() if self.routes is not None else None
        if placement is not None and placement.version > self.map_sent:
            self.map_sent = placement.version  # (sent with this batch)
        else:
            placement = None
        try:
            reply = await self.channel().request(
                RunClosures(
                    fns=fns,
                    closures=entries,
                    incarnation=self.incarnation,
                    epoch=self.epoch,
                    owner=self.owner,
                    once=once,
                    placement=placement,
                ),
                on_partial=self._on_results,
            )
        except DrainingError as exc:  # leaving: those closures go to the other workers
            logger.info("%s is leaving (%s); %d closure(s) go elsewhere", self.task, exc, len(batch))
            self.slot.said_leaving()
            self.queue.put_back(self.index, {c.cid for c in batch})
            return
        except _LOST as exc:
            self._broken = exc
            self.wake()  # the pump raises it: put back, reconnect
            return
        except PstrainError as exc:
            # The worker refused the batch itself (it could not decode it, say): those closures fail.
            for c in batch:
                self.queue.fail(c.cid, exc)
            return
        self._on_results(reply)

    def _send_again(self, cid: int) -> None:
        """The worker no longer held closure ``cid``'s function (it keeps a bounded number,
        and another coordinator may have sent it newer ones): it did not run, and goes back
        to the queue, to be sent with its function's bytes. A third time is the worker's fault."""
        c = self.queue.in_flight_closure(cid)
        if c is None:
            return
        self.slot.completed -= 1
        self.sent.discard(c.digest)
        if c.resent >= 2:
            self.queue.fail(
                cid,
                ProtocolError(
                    f"{self.task} answered three times that it did not hold closure {cid}'s "
                    "function, sent again each time with its bytes",
                    task=self.task,
                ),
            )
            return
        c.resent += 1
        self.queue.put_back(self.index, (cid,))

    def _unreadable(self, failure: PickleFailure) -> InvalidArgumentError:
        error = failure.error
        return InvalidArgumentError(
            f"the closure ran on {self.task}, but its result could not be unpickled on the "
            f"coordinator: {type(error).__name__}: {error} (return plain data: numbers, arrays, "
            "lists and dicts of them; or objects whose classes the coordinator can import)",
            task=self.task,
        )

    def _on_results(self, reply: ResultsReply) -> None:
        if reply.leaving:  # draining: its going is no failure
            self.slot.said_leaving()
        finish = self.queue.finish
        queue = self.queue
        scalars = reply.scalars
        if scalars and self.on_scalars is not None:
            self.on_scalars(scalars)
        self.slot.completed += len(reply.results)
        for result in reply.results:
            cid = result.id
            if result.status is ClosureStatus.OK:
                failure = pickle_failure_in(result.value)
                if failure is None:
                    finish(cid, result.value)
                else:
                    queue.fail(cid, self._unreadable(failure))
            elif result.status is ClosureStatus.CANCELLED:
                queue.fail(cid, CancelledError(CANCELLED_MESSAGE, task=self.task), cancelled=True)
            elif result.status is ClosureStatus.UNSENT:
                self._send_again(cid)
            else:
                exc = exception_from_payload(result.value, self.task)
                if isinstance(exc, OutOfRangeError):  # this worker's data ran out
                    queue.out_of_range(cid, exc, self.index, self.peers())
                else:
                    queue.fail(cid, exc)
        self.wake()
