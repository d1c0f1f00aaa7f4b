"""The worker's routes: it runs closures and keeps per-worker resources (datasets,
iterators).

Closures never run on the loop that serves requests, so a worker answers
``health`` and ``worker/cancel`` while a closure burns CPU: ``async def``
closures run on a dedicated *closure loop* thread (where the worker's
channels to the ps live), plain ``def`` closures on a small thread pool
(``runner.py``).

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
import logging
from collections.abc import Callable
from typing import Any

from ..._base.cluster import ClusterSpec
from ..._base.context import worker_context
from ..._base.errors import (
    ClosureAbortedError,
    InvalidArgumentError,
)
from ..._formats.messages.closures import CANCELLED, exception_payload
from ..._formats.messages.operations import (
    CancelClosures,
    Configure,
    CreateResource,
    DropResources,
    ResetChannels,
    RunClosures,
)
from ..._formats.messages.records import (
    CancelReply,
    ClosureResult,
    ConfigureReply,
    DroppedReply,
    EmptyReply,
    ResourceReply,
)
from ..._serving.base import ServerBase
from ..._serving.core import Encoded
from ..._transport.channels import ChannelPool
from .closures import Batch, encode_results
from .departure import Departure
from .dispatches import Dispatches
from .resources import FailedResource, LockedIterator, dataset_name, resolve
from .runner import ClosureRunner

logger = logging.getLogger(__name__)

__all__ = ["WorkerServer"]


class WorkerServer(ServerBase):
    """A worker task. Operations: ``worker/configure``, ``worker/run``,
    ``worker/cancel``, ``worker/resource``, ``worker/drop_resources``."""

    def __init__(
        self,
        index: int,
        *,
        cluster_spec: ClusterSpec | None = None,
        client_ssl: Any = None,
        closure_threads: int = 4,
        **kwargs: Any,
    ) -> None:
        super().__init__("worker", index, **kwargs)
        self.client_ssl = client_ssl
        self.closure_threads = max(1, closure_threads)
        self.channels: ChannelPool | None = None
        if cluster_spec is not None and cluster_spec.num_tasks("ps"):
            self.channels = ChannelPool(cluster_spec, self.token, ssl_context=self.client_ssl)
        self.resources: dict[int, Any] = {}
        self._iterated: set[int] = set()  # datasets an iterator was made from
        self._base_context: contextvars.Context | None = None
        self._base_channels: ChannelPool | None = None
        self.departure = Departure()  # SIGTERM: no new closures, then leave
        self.runner = ClosureRunner(
            f"worker{index}",
            self.closure_threads,
            self._context,
            lambda args: resolve(args, self.resources, self.index),
            self.departure.flag,
        )
        self._open_batches = 0  # worker/run requests not yet answered
        self._dispatches = Dispatches(self)  # a newer epoch ends the older ones
        self.route(Configure, self.configure)
        self.route(RunClosures, self.run_closures)
        self.route(CancelClosures, self.cancel)
        self.route(CreateResource, self.create_resource)
        self.route(DropResources, self.drop_resources)
        self.route(ResetChannels, self.reset_channels)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> str:
        await self.runner.start()
        return await super().start()

    @property
    def closures_run(self) -> int:
        return self.runner.closures_run

    @property
    def closures_failed(self) -> int:
        return self.runner.closures_failed

    def _context(self) -> contextvars.Context:
        """A fresh context for one closure or dataset function: a copy (O(1)) of a base one
        rebuilt when the channels change (one context cannot be entered by two threads)."""
        base = self._base_context
        if base is None or self._base_channels is not self.channels:
            base = self._base_context = worker_context(self.index, self.channels, self.runner.scalar)
            self._base_channels = self.channels
        return base.copy()

    async def on_stop(self) -> None:
        await self.runner.stop(*([self.channels] if self.channels is not None else []))

    def statistics(self, req: Any) -> dict[str, Any]:
        out = super().statistics(req)
        out.update(
            closures_run=self.closures_run,
            closures_failed=self.closures_failed,
            closure_seconds=self.runner.outbox.closure_seconds,
            closures_running=len(self.runner.tasks),
            resources=len(self.resources),
            draining=self.departure.draining,
        )
        return out

    # -- draining (SIGTERM: a preemption notice) -------------------------------------------------
    def begin_drain(self) -> int:
        """Take no new closures (they are refused with DrainingError and run elsewhere);
        those running finish and report as usual. Returns how many are running."""
        if self.departure.begin():
            logger.info(
                "%s draining: %d closure(s) to finish, no new ones", self.task, len(self.runner.in_flight)
            )
        return len(self.runner.in_flight)

    async def drained(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until the closures running have reported, then
        until the coordinator has heard it is leaving (see :class:`Departure`)."""
        return await self.departure.wait(
            lambda: bool(self.runner.in_flight or self.runner.outbox.items or self._open_batches),
            lambda: bool(self.connections),
            timeout,
        )

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

    def configure(self, req: Configure) -> ConfigureReply:
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
            if old is not None and self.runner.cloop is not None:
                self.tasks.spawn(self.runner.loop.run(old.close()))
        return ConfigureReply(incarnation=self.incarnation, index=self.index)

    async def run_closures(self, req: RunClosures, emit: Callable[[Any], None] | None) -> Encoded:
        """Run a batch of closures; partial replies carry results as they finish."""
        self._check_incarnation(req.incarnation)
        if req.placement is not None and self.channels is not None:
            self.channels.adopt(req.placement)  # (an attribute set: the closure loop reads it)
        closures = req.closures
        batch = Batch(len(closures), emit, asyncio.get_running_loop().create_future(), req.epoch)
        older = [] if req.epoch is None else self._dispatches.arrive(batch, (req.owner, self.index))
        fns = self.runner.fns
        # A batch that waits before it starts (for functions, or for an older dispatch)
        # holds its functions meanwhile: another batch's functions loading may drop the oldest.
        held = {c.fn for c in closures} if req.fns or fns.loading or older else None
        if held:
            fns.hold(held)
        try:
            if req.fns or fns.loading:
                await fns.load(req.fns, held or set())
            if not closures:
                return encode_results([])  # nothing to run: answered at once
            self._refuse_if_draining()
            self._open_batches += 1
            try:
                await self._dispatches.wait_ended(older, self.runner.cloop)
                if batch.abandoned:  # a newer dispatch arrived meanwhile: this one is fenced
                    return encode_results([ClosureResult(c.id, CANCELLED) for c in closures])
                fence = (req.owner, self.index, req.epoch) if req.epoch is not None else None
                self.runner.start_batch(batch, closures, fence, req.once)  # (takes the functions)
                if held:
                    fns.release(held)
                    held = None
                return await batch.done
            finally:
                self._open_batches -= 1
        finally:
            if held:
                fns.release(held)
            self._dispatches.close(batch)

    def stream_closed(self, connection: Any) -> None:  # its batches' closures stop here too
        self._dispatches.connection_ended(connection, self.runner.cloop)

    def _check_incarnation(self, expected: str | None) -> None:
        if expected is not None and expected != self.incarnation:
            raise ClosureAbortedError(
                f"{self.task} restarted since the coordinator connected (it has none of the "
                "functions or resources sent before); reconnect"
            )

    def cancel(self, req: CancelClosures) -> CancelReply:
        """Cancel running or queued closures by id; ids of closures not in flight are ignored
        (they would otherwise accumulate and cancel a later closure that reuses the id)."""
        return CancelReply(cancelling=len(self.runner.cancel(req.ids)))

    async def create_resource(self, req: CreateResource) -> ResourceReply:
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
            return ResourceReply(rid=rid, error=exception_payload(exc))
        return ResourceReply(rid=rid)

    def reset_channels(self, req: ResetChannels) -> EmptyReply:
        """The coordinator found ``job:index`` unreachable: drop our connections to it, so the
        closures using them fail now and later ones reach it afresh once it is back."""
        if self.channels is not None:
            self.channels.reset(req.job, req.index)
        return EmptyReply()

    def drop_resources(self, req: DropResources) -> DroppedReply:
        for rid in req.rids:
            self.resources.pop(rid, None)
        return DroppedReply(resources=len(self.resources))
