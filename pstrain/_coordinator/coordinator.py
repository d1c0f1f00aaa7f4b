"""ClusterCoordinator: TF's façade over the scheduling core, plus the heartbeat.

``schedule(fn, args, kwargs)`` puts a closure on the
:class:`~pstrain._coordinator.scheduling.ClosureQueue` and returns a
:class:`~pstrain._coordinator.remote_value.RemoteValue` at once; one
:class:`~pstrain._coordinator.dispatch.WorkerDispatcher` per worker takes from the queue.
The error semantics are the queue's (TF's ``ClusterCoordinator``): the first
error a closure raises is raised, with its own type and the remote traceback,
by the next ``join()``, ``schedule()`` or ``done()``; the closures still
queued are cancelled, and the coordinator keeps working afterwards.

Beyond TF, a RemoteValue may be passed to ``schedule``: it is resolved before
the closure runs, and a failed producer fails the consumer with
:class:`~pstrain.errors.ClosureInputError`.

The heartbeat: every second, every ps is pinged, and while closures run, the
workers running them. A silent worker's channel is closed (its closures go
back to the queue); a ps silent while closures run fails the job with
``UnavailableError``; a ps that answers with a new *incarnation* (it restarted,
however quickly, and lost its variables) fails it too, with a message saying
so. A closure that failed with ``NotFoundError`` because its ps restarted is
reported the same way by ``join()``.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from .._base.cluster import ClusterSpec, is_loopback, parse_address, task_name
from .._base.errors import (
    AuthenticationError,
    DeadlineExceededError,
    InvalidArgumentError,
    NotFoundError,
    ProtocolError,
    PstrainError,
    UnavailableError,
)
from .._base.exports import expose
from .._base.tasks import TaskOwner
from .._distribute.strategy import ParameterServerStrategy
from .._distribute.values import PerWorkerValues
from .._formats import pickling
from .._formats.observability import MetricsEndpoint
from .._training import summary
from .dispatch import DispatchSettings, WorkerDispatcher
from .membership import Membership
from .per_worker import PerWorkerDataset, as_dataset_fn
from .ps_health import PsHealth
from .remote_value import Outcome, RemoteValue
from .resources import ResourceRegistry
from .scheduling import Closure, ClosureQueue, scan_inputs

logger = logging.getLogger(__name__)

__all__ = ["START_HOOKS", "ClusterCoordinator"]

#: Called with each coordinator when it starts dispatching: how add-ons of the layers above
#: (the dashboard, for ``pstrain launch --dashboard``) attach without this module knowing them.
START_HOOKS: list[Callable[[ClusterCoordinator], None]] = []


class ClusterCoordinator:
    """Schedules closures onto the workers of a :class:`ParameterServerStrategy`.

    One per strategy: constructing it again returns the same coordinator::

        coordinator = pstrain.ClusterCoordinator(strategy)
        rv = coordinator.schedule(step_fn, args=(iterator,))
        await coordinator.join()
        print(await rv)
    """

    __pstrain_opaque__ = True  # a checkpoint does not walk into it (object_graph)

    def __new__(cls, strategy: ParameterServerStrategy, *args: Any, **kwargs: Any) -> ClusterCoordinator:
        existing = strategy.coordinator
        if isinstance(existing, ClusterCoordinator) and not existing.closed:
            return existing
        return super().__new__(cls)

    def __init__(self, strategy: ParameterServerStrategy, max_inflight_per_worker: int = 1, *,
                 max_batch: int = 1024, worker_timeout_s: float = 10.0,
                 ps_timeout_s: float = 10.0, heartbeat_s: float = 1.0,
                 probe_initial_s: float = 0.05, probe_max_s: float = 1.0,
                 cancel_grace_s: float = 10.0, no_worker_timeout_s: float | None = 60.0) -> None:
        if getattr(self, "strategy", None) is not None:
            return  # the existing coordinator of this strategy
        if not isinstance(strategy, ParameterServerStrategy):
            raise InvalidArgumentError("ClusterCoordinator needs a ParameterServerStrategy, got "
                                       f"{type(strategy).__name__}")
        if max_inflight_per_worker < 1:
            raise InvalidArgumentError("max_inflight_per_worker must be at least 1")
        self.strategy = strategy
        strategy.attach_coordinator(self)
        self._channels = strategy.channels
        self.settings = DispatchSettings(max_inflight_per_worker=max_inflight_per_worker,
                                         max_batch=max_batch, worker_timeout_s=worker_timeout_s,
                                         probe_initial_s=probe_initial_s, probe_max_s=probe_max_s)
        self.ps_timeout_s = ps_timeout_s
        self.heartbeat_s = heartbeat_s
        self.cancel_grace_s = cancel_grace_s
        self.no_worker_timeout_s = no_worker_timeout_s
        self._no_worker_since: float | None = None
        self.queue = ClosureQueue()
        self.resources = ResourceRegistry(strategy.num_workers)
        self._tasks = TaskOwner("the coordinator", on_failure=self._task_failed)
        self._ids = itertools.count(1)
        self._fns: dict[Any, tuple[bytes, bytes]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._metrics: MetricsEndpoint | None = None
        self._closers: list[Callable[[], Awaitable[None]]] = []
        #: What add-ons of the face layer keep on this coordinator (the dashboard's server).
        self.extensions: dict[str, Any] = {}
        #: Each ps's incarnation and health (sans-I/O; the heartbeat feeds it).
        self.ps_health = PsHealth(strategy.num_ps, self._channels.restored)
        self.closed = False
        spec = self._channels.cluster_spec
        #: The worker slots and their lifecycle (sans-I/O); each dispatcher drives its slot.
        self.slots = Membership(spec.job_tasks("worker"))
        self._workers = [self._dispatcher(slot.index, spec) for slot in self.slots]
        self.session = uuid.uuid4().hex[:16]  # exactly-once keys are unique to this coordinator

    # -- loop and tasks ---------------------------------------------------------------------
    def _start(self) -> bool:
        """Start dispatching on the running loop (False when no loop runs yet)."""
        if self._loop is not None:
            return True
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        self.resources.loop = self._loop
        for w in self._workers:
            self._tasks.spawn(w.run())
        self._tasks.spawn(self._heartbeat())
        chief = self._chief_address()
        if chief is not None:  # TF_CONFIG names this process's address: serve /metrics there
            self._tasks.spawn(self._serve_metrics_or_say(*chief))
        for hook in START_HOOKS:  # add-ons of the face layer (the dashboard) start here
            hook(self)
        return True

    async def _serve_metrics_or_say(self, host: str, port: int) -> None:
        try:
            await self.serve_metrics(host, port)
        except (PstrainError, OSError) as exc:  # a port in use is the user's to fix: say so, once
            logger.error("the coordinator could not serve /metrics on %s:%d: %s (training goes "
                         "on without it)", host, port, exc)

    def run_in_background(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run ``work`` on the coordinator's loop until the coordinator closes (an add-on's
        task, such as the dashboard's); a failure is logged and raised by the next join."""
        self._tasks.spawn(work)

    def on_close(self, callback: Callable[[], Awaitable[None]]) -> None:
        """``await callback()`` when the coordinator closes (an add-on's clean-up)."""
        self._closers.append(callback)

    def _task_failed(self, exc: BaseException) -> None:
        logger.error("a coordinator task failed", exc_info=exc)
        self.queue.record_error(exc)

    def _chief_address(self) -> tuple[str, int] | None:
        resolver = self.strategy.cluster_resolver
        spec = self._channels.cluster_spec
        if getattr(resolver, "task_type", None) != "chief" or not spec.num_tasks("chief"):
            return None
        host, port = parse_address(spec.task_address("chief", 0))
        if port == 0:
            return None
        return ("127.0.0.1" if is_loopback(host) else "0.0.0.0"), port

    async def _heartbeat(self) -> None:
        """Ping every ps (a restart is found even when idle) and, while closures run, their
        workers: silence past the deadline is a failure (a worker's closures are
        rescheduled; a ps fails the job)."""
        while True:
            busy = self.queue.in_flight and self.queue.error is None
            await asyncio.gather(*(self._ping_worker(w) for w in self._workers
                                   if busy and w.up and w.in_flight),
                                 *(self._ping_ps(k) for k in range(self.strategy.num_ps)))
            self._check_some_worker_can_run()
            await asyncio.sleep(self.heartbeat_s)

    def _check_some_worker_can_run(self) -> None:
        """Closures waiting while no worker has been reachable for ``no_worker_timeout_s``:
        fail them, naming every task that is down (TF would wait forever)."""
        waiting = self.queue.queued + self.queue.in_flight
        if not waiting or any(w.up for w in self._workers) or self.queue.error is not None:
            self._no_worker_since = None
            return
        now = asyncio.get_running_loop().time()
        if self._no_worker_since is None:
            self._no_worker_since = now
            return
        if self.no_worker_timeout_s is None or now - self._no_worker_since < self.no_worker_timeout_s:
            return
        down = [f"{w.task} ({w.last_error or 'never reached'})" for w in self._workers]
        down += [f"{task_name('ps', k)} ({why})" for k, why in sorted(self.ps_health.down.items())]
        self.queue.record_error(UnavailableError(
            f"no worker has been reachable for {now - self._no_worker_since:.0f} s with "
            f"{waiting} closure(s) waiting; down: {'; '.join(down)}. Restart them (the queued "
            "closures were cancelled), or raise no_worker_timeout_s to wait longer"))

    async def _ping_worker(self, w: WorkerDispatcher) -> None:
        try:
            await w.channel().call("health", None, timeout=self.settings.worker_timeout_s)
        except (UnavailableError, DeadlineExceededError) as exc:
            logger.warning("%s did not answer a health check: %s", w.task, exc)
            w.channel().reset()  # fails its pending calls: the dispatcher reschedules

    async def _ping_ps(self, k: int) -> None:
        restarted = await self._ps_restarted(k, report_silence=True)
        if restarted is None:
            return
        if k in self.ps_health.down:  # silent, not restarted: the workers' links to it stall too
            self._tasks.spawn(self._reset_worker_links("ps", k))
        if not self.queue.record_error(restarted) and isinstance(restarted, UnavailableError):
            self.ps_health.deferred = restarted

    async def _reset_worker_links(self, job: str, index: int) -> None:
        """Have every reachable worker drop its connections to ``job:index``: its closures
        stuck on them fail now, and once the task is back, workers reach it afresh instead
        of after TCP's retransmission back-off."""
        async def reset(w: WorkerDispatcher) -> None:
            try:
                await w.channel().call("worker/reset_channels", {"job": job, "index": index},
                                       timeout=self.settings.worker_timeout_s)
            except PstrainError:
                pass  # that worker is unreachable too: its dispatcher handles it
        await asyncio.gather(*(reset(w) for w in self._workers if w.up))

    async def _ps_restarted(self, k: int, report_silence: bool = False) -> PstrainError | None:
        """The error to report if ps ``k`` restarted since last seen (or, with
        ``report_silence`` and closures running, if it does not answer)."""
        channel = self._channels.channel("ps", k)
        health = self.ps_health
        try:
            reply = await channel.call("health", None, timeout=self.ps_timeout_s)
        except (UnavailableError, DeadlineExceededError) as exc:
            channel.reset()  # a healed ps is reached on a fresh connection, at once
            return health.silent(k, f"{type(exc).__name__}: {exc}",
                                 busy=report_silence and bool(self.queue.in_flight))
        except (AuthenticationError, ProtocolError) as exc:  # misconfigured: report, once
            health.misconfigured(k, exc)
            return exc if report_silence else None
        incarnation = reply.get("incarnation")
        return health.answered(k, incarnation if isinstance(incarnation, str) else None)

    def _drop_handled_restart(self) -> None:
        """A pending "ps restarted" error is moot once the program restored a checkpoint onto
        that very incarnation (it learnt of the loss another way, e.g. an earlier error)."""
        health = self.ps_health
        for error in (self.queue.error, health.deferred):
            if health.handled(error):
                if error is health.deferred:
                    health.deferred = None
                else:
                    self.queue.take_error()
                logger.info("%s restarted, and a checkpoint was restored onto it: carrying on",
                            getattr(error, "task", "a ps"))

    # -- scheduling ---------------------------------------------------------------------------
    def _function(self, fn: Callable[..., Any]) -> tuple[bytes, bytes]:
        try:
            cached = self._fns.get(fn)
        except TypeError:  # unhashable callable
            cached = None
        if cached is None:
            try:
                pickled = pickling.dumps(fn)
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

    async def _fence_worker(self, worker: int, epoch: int) -> None:
        """Every ps refuses ``worker``'s updates from dispatches before ``epoch``."""
        await asyncio.gather(*(self._channels.channel("ps", k).call(
            "ps/fence", {"worker": worker, "epoch": epoch, "owner": self.strategy.placement.owner},
            timeout=self.ps_timeout_s)
            for k in range(self.strategy.num_ps)))

    def schedule(self, fn: Callable[..., Any], args: Sequence[Any] = (),
                 kwargs: dict[str, Any] | None = None, *, exactly_once: bool = False) -> RemoteValue:
        """Queue ``fn(*args, **kwargs)`` to run on some worker; returns at once.

        The function is pickled once, on its first schedule, and sent to each
        worker once; pass values that change from step to step as ``args``.

        ``exactly_once``: the closure's variable updates are applied once per ps even
        if it runs again after its worker died mid-way: each update carries the closure's
        key and its position among the closure's updates to that ps, and a ps applies a
        (key, position) once (remembering the last ``ONCE_WINDOW`` closures). A retry
        reads the variables afresh; on each ps, its first n updates are skipped where the
        dead attempt had applied n. ``extended.update`` calls are fenced, not deduplicated.
        """
        if not callable(fn):
            raise TypeError(f"schedule needs a callable (a function or coroutine function), "
                            f"got {type(fn).__name__}")
        if self.closed:
            raise PstrainError("this ClusterCoordinator is closed")
        args = tuple(args)
        kwargs = dict(kwargs) if kwargs else {}
        digest, pickled = self._function(fn)
        inputs: list[RemoteValue] = []
        walk = bool(args or kwargs) and (scan_inputs(args, inputs) | scan_inputs(kwargs, inputs))
        loop = self._loop
        outcome = Outcome(loop)
        cid = next(self._ids)
        closure = Closure(cid, fn, digest, pickled, args, kwargs, outcome, walk, inputs,
                          once_key=f"{self.session}:{cid}" if exactly_once else None)
        if loop is None:  # nothing started yet: start on the running loop, if there is one
            if self._start():
                outcome.loop = self._loop  # else: dispatch starts with the first join()
        elif not _runs(loop):  # another thread: hand it over to the coordinator's loop
            loop.call_soon_threadsafe(self.queue.put_cancelled_if_error, closure)
            return RemoteValue(outcome)
        queue = self.queue
        if queue.error is not None:
            self._drop_handled_restart()
        queue.put(closure)
        if queue.error is not None:
            self._raise_pending()
        return RemoteValue(outcome)

    def _raise_pending(self) -> None:
        """Raise and clear the pending error (in-flight closures are abandoned as cancelled)."""
        error = self.queue.take_error()
        if error is not None:
            raise error

    # -- waiting --------------------------------------------------------------------------------
    async def join(self) -> None:
        """Wait until every scheduled closure has run; raise the first error if one failed."""
        self._start()
        while True:
            self._drop_handled_restart()
            refused = [w.refused for w in self._workers if w.refused is not None]
            if refused and len(refused) == len(self._workers) and not self.queue.is_idle():
                self.queue.record_error(refused[0])  # no worker can ever run what is queued
            if self.queue.error is not None:
                # Let the cancelled in-flight closures report back (bounded), then raise.
                await self.queue.wait_drained(self.cancel_grace_s)
                if isinstance(self.queue.error, NotFoundError):
                    await self._raise_if_ps_restarted()
                self._raise_pending()
            if self.queue.is_idle():
                return
            await self.queue.wait_idle()

    async def _raise_if_ps_restarted(self) -> None:
        """A variable not found because its ps restarted is that ps's failure (TF's
        UnavailableError), not the closure's."""
        found = await asyncio.gather(*(self._ps_restarted(k) for k in range(self.strategy.num_ps)))
        restarted = next((e for e in found if e is not None), self.ps_health.deferred)
        self.ps_health.deferred = None
        if restarted is not None:
            raise restarted from self.queue.take_error()

    def done(self) -> bool:
        """True when nothing is queued or in flight; raises the pending error if there is one."""
        self._raise_pending()
        return self.queue.is_idle()

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
        if self.closed:
            raise PstrainError("this ClusterCoordinator is closed")
        fn = as_dataset_fn(dataset_fn)
        pickling.dumps(fn)  # registers its user modules to travel by value (and fails early)
        self._start()
        return PerWorkerDataset(self.resources, self.resources.new("dataset", fn=fn))

    # -- observability ----------------------------------------------------------------------------
    @property
    def workers_up(self) -> list[bool]:
        """Whether each worker is reachable now."""
        return [w.up for w in self._workers]

    def membership(self) -> list[dict[str, Any]]:
        """Each worker slot: its address, state (joining, up, draining, lost, replaced,
        refused), whether it is up or leaving, its failures, epoch and incarnation."""
        return self.slots.snapshot()

    async def admit_worker(self, address: str) -> int:
        """A worker started with ``pstrain serve --role worker --join`` joins the job.

        It takes the first slot whose worker is gone (preempted, drained, unreachable):
        that slot's address becomes ``address`` and its dispatcher connects there at once.
        With every slot's worker up, the cluster grows by one worker: a new dispatcher,
        the per-worker datasets built there, and closures from the shared queue. Returns
        the worker's index."""
        parse_address(address)  # InvalidArgumentError for a bad one
        if self.closed:
            raise PstrainError("this ClusterCoordinator is closed")
        slot, grew = self.slots.admit(address)
        spec = self._channels.cluster_spec.as_dict()
        spec["worker"] = self.slots.addresses()
        new_spec = ClusterSpec(spec)
        self._channels.cluster_spec = new_spec
        for w in self._workers:
            w.cluster_spec = new_spec
        if grew:
            index = self.resources.add_worker()
            assert index == slot.index, (index, slot.index)
            w = self._dispatcher(index, new_spec)
            self._workers.append(w)
            self.strategy.worker_joined()
            if self._loop is not None:
                self._tasks.spawn(w.run())
            logger.info("%s joined at %s (the cluster grew to %d workers)", w.task, address,
                        len(self._workers))
        else:
            w = self._workers[slot.index]
            await self._channels.forget("worker", slot.index)
            logger.info("%s is now at %s (joined)", w.task, address)
        w.wake_probe()
        return slot.index

    def _dispatcher(self, index: int, spec: ClusterSpec) -> WorkerDispatcher:
        placement = self.strategy.placement
        return WorkerDispatcher(self.slots.slot(index), self.queue, self.resources,
                                _channel_getter(self._channels, "worker", index), spec,
                                self._tasks, self.settings, before_send=placement.creations_to_send,
                                fence=self._fence_worker, on_scalars=self._scalars,
                                owner=placement.owner, peers=self.slots.up)

    @property
    def ps_incarnations(self) -> list[str | None]:
        """Each ps's incarnation as last seen by the heartbeat (None: not seen yet)."""
        return list(self.ps_health.incarnations)

    @property
    def worker_failures(self) -> int:
        """Times a worker was found unreachable."""
        return sum(w.failures for w in self._workers)

    @property
    def closures_done(self) -> int:
        """Closures finished, whatever their outcome."""
        return self.queue.done_count

    @property
    def closures_retried(self) -> int:
        """Closures put back on the queue after their worker was lost."""
        return self.queue.retried_count

    def statistics(self) -> dict[str, Any]:
        """Counts for /metrics and `pstrain status`."""
        return {"queued": self.queue.queued, "in_flight": self.queue.in_flight,
                "closures_done": self.queue.done_count, "closures_retried": self.queue.retried_count,
                "worker_failures": self.worker_failures,
                "workers_up": sum(self.workers_up)}

    def _scalars(self, records: list[Any]) -> None:
        """Scalars a closure logged with pstrain.summary (they came back with its result)."""
        for rec in records:
            try:
                name, value, step, wall = rec
                summary.record(str(name), float(value), int(step), float(wall))
            except (TypeError, ValueError):
                logger.warning("a worker sent a malformed scalar: %r", rec)

    async def serve_metrics(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve ``GET /metrics`` and ``/healthz`` for this coordinator; returns the address.

        Token-protected like every server (the strategy's cluster token).
        """
        if self._metrics is None:
            endpoint = MetricsEndpoint(task_name("chief", 0), {"role": "chief", "task": "0"},
                                       self.statistics, host=host, port=port,
                                       token=self._channels.token, join=self.admit_worker,
                                       membership=self.membership)
            await endpoint.start()
            self._metrics = endpoint
        assert self._metrics.address is not None
        return self._metrics.address

    # -- lifecycle --------------------------------------------------------------------------------
    async def shutdown_cluster(self, startup_wait_s: float = 60.0) -> list[str]:
        """The job is done: ask every ps and worker to leave (those started with
        ``--exit-on-shutdown``, as ``pstrain serve --slurm-jobs`` is, so that a SLURM job ends
        COMPLETED). A task never reached yet may still be starting (SLURM starts every rank at
        once, and a ps the job never used may come up last): it is asked again, with back-off,
        for up to ``startup_wait_s``. Returns the tasks that did not leave (refused, or
        unreachable)."""
        spec = self._channels.cluster_spec
        tasks = [(job, i) for job in ("ps", "worker") for i in range(spec.num_tasks(job))]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + startup_wait_s

        async def leave(job: str, index: int) -> str | None:
            channel = self._channels.channel(job, index)
            pause = 0.05
            while True:
                try:
                    await channel.call("server/shutdown", {}, timeout=10.0)
                    return None
                except UnavailableError as exc:
                    if channel.ever_connected or loop.time() + pause > deadline:
                        return f"{task_name(job, index)}: {exc}"
                except PstrainError as exc:
                    return f"{task_name(job, index)}: {exc}"
                await asyncio.sleep(pause)  # back-off while a task that never answered starts
                pause = min(pause * 2, 1.0)

        stayed = [r for r in await asyncio.gather(*(leave(j, i) for j, i in tasks)) if r is not None]
        for line in stayed:
            logger.warning("did not leave: %s", line)
        return stayed

    async def close(self) -> None:
        """Stop dispatching and close the channels to the workers."""
        if self.closed:
            return
        self.closed = True
        await self._tasks.close()
        self.queue.close("the coordinator was closed")
        await self._channels.close()
        if self._metrics is not None:
            await self._metrics.stop()
        for closer in self._closers:
            await closer()
        self.strategy.detach_coordinator(self)

    async def __aenter__(self) -> ClusterCoordinator:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def __reduce__(self) -> Any:
        raise TypeError("a ClusterCoordinator lives on the coordinator; a closure cannot capture it")

    def __repr__(self) -> str:
        return (f"ClusterCoordinator(workers={len(self._workers)}, queued={self.queue.queued}, "
                f"in_flight={self.queue.in_flight})")


def _runs(loop: asyncio.AbstractEventLoop) -> bool:
    """Is ``loop`` the loop running in this thread?"""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _channel_getter(pool: Any, job: str, index: int) -> Callable[[], Any]:
    return lambda: pool.channel(job, index)


expose(globals(), "pstrain", ['ClusterCoordinator'])
