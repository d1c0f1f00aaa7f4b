"""The coordinator's heartbeat, and what it learns of each ps's restarts.

Every ``heartbeat_s``, every ps is pinged, and while closures run, the workers running
them. A silent worker's channel is closed (its closures go back to the queue); a ps
silent while closures run fails the job with ``UnavailableError``; a ps that answers with
a new *incarnation* (it restarted, however quickly, and lost its variables) fails it too,
with a message saying so. A closure that failed with ``NotFoundError`` because its ps
restarted is reported the same way by ``join()``. The record of each ps is the sans-I/O
:class:`~pstrain._coordinator.elastic.health.PsHealth`; this module is its I/O.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from .._base.cluster import task_name
from .._base.errors import (
    AuthenticationError,
    DeadlineExceededError,
    ProtocolError,
    PstrainError,
    UnavailableError,
)
from .._formats.messages.operations import Health, ResetChannels
from .._transport.channels import ChannelPool
from .._transport.client import ps_advice
from .dispatch import DispatchSettings, WorkerDispatcher
from .elastic.health import PsHealth
from .scheduling import ClosureQueue

logger = logging.getLogger(__name__)

#: How long closures wait with no worker reachable before a warning says so (a worker
#: starting up takes about this long to be reached).
NO_WORKER_WARN_S = 2.0

__all__ = ["Heartbeat"]


class Heartbeat:
    """Pings the ps and busy workers; turns silence and restarts into the job's errors."""

    def __init__(
        self,
        channels: ChannelPool,
        queue: ClosureQueue,
        ps_health: PsHealth,
        workers: list[WorkerDispatcher],
        settings: DispatchSettings,
        *,
        ps_timeout_s: float,
        heartbeat_s: float,
        no_worker_timeout_s: float | None,
        spawn: Callable[[Coroutine[Any, Any, Any]], Any],
    ) -> None:
        self.channels = channels
        self.queue = queue
        self.ps_health = ps_health
        self.workers = workers  # the coordinator's list: it grows as workers join
        self.settings = settings
        self.ps_timeout_s = ps_timeout_s
        self.heartbeat_s = heartbeat_s
        self.no_worker_timeout_s = no_worker_timeout_s
        self.spawn = spawn
        self._no_worker_since: float | None = None
        self._warned = False
        #: Called with a ps found lost while closures run and its error: True if that is
        #: handled (the ps is being replaced, ``elastic/replace.py``), else the error is the job's.
        self.on_ps_lost: Callable[[int, PstrainError], bool] | None = None

    def active_ps(self) -> list[int]:
        """The ps of the job now (the placement map's: an elastic ps joins or leaves)."""
        active = self.channels.session.routes.active()
        self.ps_health.grow(len(self.channels.session.routes.ps))
        return active

    async def run(self) -> None:
        """Ping every ps (a restart is found even when idle) and, while closures run, their
        workers: silence past the deadline is a failure (a worker's closures are
        rescheduled; a ps fails the job)."""
        while True:
            busy = self.queue.in_flight and self.queue.error is None
            await asyncio.gather(
                *(self._ping_worker(w) for w in self.workers if busy and w.up and w.in_flight),
                *(self._ping_ps(k) for k in self.active_ps()),
            )
            self._check_some_worker_can_run()
            await asyncio.sleep(self.heartbeat_s)

    def _check_some_worker_can_run(self) -> None:
        """Closures waiting while no worker has been reachable for ``no_worker_timeout_s``:
        fail them, naming every task that is down (TF would wait forever)."""
        waiting = self.queue.queued + self.queue.in_flight
        if not waiting or any(w.up for w in self.workers) or self.queue.error is not None:
            self._no_worker_since = None
            self._warned = False
            return
        now = asyncio.get_running_loop().time()
        if self._no_worker_since is None:
            self._no_worker_since = now
            return
        down = [f"{w.task} ({w.last_error or 'never reached'})" for w in self.workers]
        down += [f"{task_name('ps', k)} ({why})" for k, why in sorted(self.ps_health.down.items())]
        if not self._warned and now - self._no_worker_since >= NO_WORKER_WARN_S:
            self._warned = True  # said once, early: what is awaited, and for how long
            limit = (
                "forever"
                if self.no_worker_timeout_s is None
                else f"up to {self.no_worker_timeout_s:g} s (no_worker_timeout_s)"
            )
            logger.warning(
                "no worker is reachable and %d closure(s) wait; waiting %s for one. Down: %s",
                waiting,
                limit,
                "; ".join(down),
            )
        if self.no_worker_timeout_s is None or now - self._no_worker_since < self.no_worker_timeout_s:
            return
        self.queue.record_error(
            UnavailableError(
                f"no worker has been reachable for {now - self._no_worker_since:.0f} s with "
                f"{waiting} closure(s) waiting; down: {'; '.join(down)}. Restart them (the queued "
                "closures were cancelled), or raise no_worker_timeout_s to wait longer"
            )
        )

    async def _ping_worker(self, w: WorkerDispatcher) -> None:
        try:
            await w.channel().request(Health(), timeout=self.settings.worker_timeout_s)
        except (UnavailableError, DeadlineExceededError) as exc:
            logger.warning("%s did not answer a health check: %s", w.task, exc)
            w.channel().reset()  # fails its pending calls: the dispatcher reschedules

    async def _ping_ps(self, k: int) -> None:
        restarted = await self.ps_restarted(k, report_silence=True)
        if restarted is None or (self.on_ps_lost is not None and self.on_ps_lost(k, restarted)):
            return  # (or it is lost, and replaced while training goes on: elastic/replace.py)
        if k in self.ps_health.down:  # silent, not restarted: the workers' links to it stall too
            self.spawn(self._reset_worker_links("ps", k))
        if not self.queue.record_error(restarted) and isinstance(restarted, UnavailableError):
            self.ps_health.deferred = restarted

    async def _reset_worker_links(self, job: str, index: int) -> None:
        """Have every reachable worker drop its connections to ``job:index``: its closures
        stuck on them fail now, and once the task is back, workers reach it afresh instead
        of after TCP's retransmission back-off."""

        async def reset(w: WorkerDispatcher) -> None:
            try:
                await w.channel().request(
                    ResetChannels(job=job, index=index),  # type: ignore[arg-type]
                    timeout=self.settings.worker_timeout_s,
                )
            except PstrainError:
                pass  # that worker is unreachable too: its dispatcher handles it

        await asyncio.gather(*(reset(w) for w in self.workers if w.up))

    async def ps_restarted(self, k: int, report_silence: bool = False) -> PstrainError | None:
        """The error to report if ps ``k`` restarted since last seen (or, with
        ``report_silence`` and closures running, if it does not answer)."""
        channel = self.channels.channel("ps", k)
        health = self.ps_health
        try:
            reply = await channel.request(Health(), timeout=self.ps_timeout_s)
        except (UnavailableError, DeadlineExceededError) as exc:
            channel.reset()  # a healed ps is reached on a fresh connection, at once
            reason = str(exc).removesuffix(ps_advice(channel.task))  # said once, by silent()
            return health.silent(
                k,
                f"{type(exc).__name__}: {reason}",
                busy=report_silence and bool(self.queue.in_flight or self.queue.held),
            )
        except (AuthenticationError, ProtocolError) as exc:  # misconfigured: report, once
            health.misconfigured(k, exc)
            return exc if report_silence else None
        return health.answered(k, reply.incarnation)

    def drop_handled_restart(self) -> None:
        """A pending "ps restarted" error is moot once the program restored a checkpoint onto
        that very incarnation (it learnt of the loss another way, e.g. an earlier error)."""
        health = self.ps_health
        for error in (self.queue.error, health.deferred):
            if health.handled(error):
                if error is health.deferred:
                    health.deferred = None
                else:
                    self.queue.take_error()
                logger.info(
                    "%s restarted, and a checkpoint was restored onto it: carrying on",
                    getattr(error, "task", "a ps"),
                )

    async def raise_if_ps_restarted(self) -> None:
        """A variable not found because its ps restarted is that ps's failure (TF's
        UnavailableError), not the closure's."""
        found = await asyncio.gather(*(self.ps_restarted(k) for k in self.active_ps()))
        restarted = next((e for e in found if e is not None), self.ps_health.deferred)
        self.ps_health.deferred = None
        if restarted is not None:
            raise restarted from self.queue.take_error()
