"""ClusterCoordinator: TF's façade over the scheduling core.

``schedule(fn, args, kwargs)`` puts a closure on the
:class:`~pstrain._coordinator.scheduling.ClosureQueue` and returns a
:class:`~pstrain._coordinator.remote_value.RemoteValue` at once; one
:class:`~pstrain._coordinator.dispatch.WorkerDispatcher` per worker takes from the queue.
The error semantics are the queue's (TF's ``ClusterCoordinator``): the first
error a closure raises is raised, with its own type and the remote traceback,
by the next ``join()``, ``schedule()`` or ``done()``; the closures still
queued are cancelled, and the coordinator keeps working afterwards.

Beyond TF, a RemoteValue may be passed to ``schedule``: it is resolved before the closure
runs, and a failed producer fails the consumer with :class:`~pstrain.errors.ClosureInputError`.

Its parts: the heartbeat and ps restarts (``heartbeat.py``), the worker slots and their
dispatchers (``workers.py``), ps that join and leave (``elastic/moves.py``), its endpoint
(``endpoint.py``), lost ps replaced (``elastic/replace.py``), the end of a job (``shutdown.py``),
the function cache (``functions.py``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from .._base.checks import check_options
from .._base.errors import CancelledError, InvalidArgumentError, NotFoundError, PstrainError
from .._base.exports import expose
from .._base.tasks import TaskOwner
from .._distribute.strategy import ParameterServerStrategy
from .._distribute.values import PerWorkerValues
from .._formats.messages import pickling
from .._training import summary
from . import interrupt
from .closures import Closure, check_call, scan_inputs
from .dispatch import DispatchSettings
from .elastic.health import PsHealth
from .elastic.moves import PsChanges
from .elastic.replace import PsReplacement
from .endpoint import CoordinatorEndpoint, chief_address, say_if_not_served
from .functions import FunctionCache
from .heartbeat import Heartbeat
from .per_worker import PerWorkerDataset, as_dataset_fn
from .remote_value import Outcome, RemoteValue
from .resources import ResourceRegistry
from .scheduling import ClosureQueue
from .shutdown import ask_to_leave
from .workers import Workers

if TYPE_CHECKING:
    from .._checkpoint.manager import CheckpointManager

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

    def __init__(
        self,
        strategy: ParameterServerStrategy,
        max_inflight_per_worker: int = 1,
        *,
        max_batch: int = 1024,
        worker_timeout_s: float = 10.0,
        ps_timeout_s: float = 10.0,
        heartbeat_s: float = 1.0,
        probe_initial_s: float = 0.05,
        probe_max_s: float = 1.0,
        cancel_grace_s: float = 10.0,
        no_worker_timeout_s: float | None = 60.0,
    ) -> None:
        if getattr(self, "strategy", None) is not None:
            return  # the existing coordinator of this strategy
        if not isinstance(strategy, ParameterServerStrategy):
            raise InvalidArgumentError(
                f"ClusterCoordinator needs a ParameterServerStrategy, got {type(strategy).__name__}"
            )
        check_options(
            "ClusterCoordinator",
            {"max_inflight_per_worker": max_inflight_per_worker, "max_batch": max_batch},
            {
                "worker_timeout_s": worker_timeout_s,
                "ps_timeout_s": ps_timeout_s,
                "heartbeat_s": heartbeat_s,
                "probe_initial_s": probe_initial_s,
                "probe_max_s": probe_max_s,
                "cancel_grace_s": cancel_grace_s,
                "no_worker_timeout_s": no_worker_timeout_s,
            },
        )
        self.strategy = strategy
        strategy.attach_coordinator(self)
        self._channels = strategy.channels
        self.settings = DispatchSettings(
            max_inflight_per_worker=max_inflight_per_worker,
            max_batch=max_batch,
            worker_timeout_s=worker_timeout_s,
            probe_initial_s=probe_initial_s,
            probe_max_s=probe_max_s,
        )
        self.cancel_grace_s = cancel_grace_s
        self.queue = ClosureQueue()
        self.resources = ResourceRegistry(strategy.num_workers)
        self._tasks = TaskOwner("the coordinator", on_failure=self._task_failed)
        self._ids = itertools.count(1)
        self._fns = FunctionCache()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._endpoint: CoordinatorEndpoint | None = None
        self._closers: list[Callable[[], Awaitable[None]]] = []
        #: What add-ons of the face layer keep on this coordinator (the dashboard's server).
        self.extensions: dict[str, Any] = {}
        #: Each ps's incarnation and health (sans-I/O; the heartbeat feeds it).
        self.ps_health = PsHealth(strategy.num_ps, self._channels.session.restored)
        self.closed = False
        self.workers = Workers(
            strategy,
            self.queue,
            self.resources,
            self.settings,
            tasks=self._tasks,
            ps_timeout_s=ps_timeout_s,
            on_scalars=summary.record_from_worker,
        )
        #: The worker slots and their lifecycle (sans-I/O); each dispatcher drives its slot.
        self.slots = self.workers.slots
        self._workers = self.workers.dispatchers
        self.heartbeat = Heartbeat(
            self._channels,
            self.queue,
            self.ps_health,
            self._workers,
            self.settings,
            ps_timeout_s=ps_timeout_s,
            heartbeat_s=heartbeat_s,
            no_worker_timeout_s=no_worker_timeout_s,
            spawn=self._tasks.spawn,
        )
        #: The placement map and the moves of variables between ps (elastic ps).
        self.ps = PsChanges(strategy, self._channels, timeout_s=max(120.0, ps_timeout_s))
        self._replacement = PsReplacement(self.ps, self.heartbeat, self.queue, self._tasks.spawn)
        self.session = uuid.uuid4().hex[:16]  # exactly-once keys are unique to this coordinator
        self.interrupted: str | None = None  # why, once Ctrl-C stopped new closures
        interrupt.track(self)

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
        self.workers.start(self._tasks.spawn)
        self._tasks.spawn(self.heartbeat.run())
        chief = chief_address(self.strategy.cluster_resolver, self._channels.cluster_spec)
        if chief is not None:  # TF_CONFIG names this process's address: serve /metrics there
            self._tasks.spawn(say_if_not_served(self.serve_metrics(*chief), *chief))
        for hook in START_HOOKS:  # add-ons of the face layer (the dashboard) start here
            hook(self)
        return True

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

    # -- scheduling ---------------------------------------------------------------------------
    def schedule(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        exactly_once: bool = False,
    ) -> RemoteValue:
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
        check_call(fn, args, kwargs)
        if self.interrupted:
            raise CancelledError(self.interrupted)
        if self.closed:
            raise PstrainError("this ClusterCoordinator is closed")
        args = tuple(args)
        kwargs = dict(kwargs) if kwargs else {}
        digest, pickled = self._fns.get(fn)
        inputs: list[RemoteValue] = []
        walk = bool(args or kwargs) and (scan_inputs(args, inputs) | scan_inputs(kwargs, inputs))
        loop = self._loop
        outcome = Outcome(loop)
        cid = next(self._ids)
        closure = Closure(
            cid,
            fn,
            digest,
            pickled,
            args,
            kwargs,
            outcome,
            walk,
            inputs,
            once_key=f"{self.session}:{cid}" if exactly_once else None,
        )
        if loop is None:  # nothing started yet: start on the running loop, if there is one
            if self._start():
                outcome.loop = self._loop  # else: dispatch starts with the first join()
        elif not _runs(loop):  # another thread: hand it over to the coordinator's loop
            loop.call_soon_threadsafe(self.queue.put_cancelled_if_error, closure)
            return RemoteValue(outcome)
        queue = self.queue
        if queue.error is not None:
            self.heartbeat.drop_handled_restart()
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
            self.heartbeat.drop_handled_restart()
            refused = [w.refused for w in self._workers if w.refused is not None]
            if refused and len(refused) == len(self._workers) and not self.queue.is_idle():
                self.queue.record_error(refused[0])  # no worker can ever run what is queued
            if self.queue.error is not None:
                # Let the cancelled in-flight closures report back (bounded), then raise.
                if not await self.queue.wait_drained(self.cancel_grace_s):
                    await self.workers.fence_stragglers()  # their late updates are refused
                if isinstance(self.queue.error, NotFoundError):
                    await self.heartbeat.raise_if_ps_restarted()
                self._raise_pending()
            if self.queue.is_idle():
                return
            await self.queue.wait_idle()

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
        if self.closed:
            raise PstrainError("this ClusterCoordinator is closed")
        return await self.workers.admit(address)

    async def add_ps(self, address: str) -> int:
        """An empty ps at ``address`` (``pstrain serve --role ps --join``) joins the job, and
        a share of the variables moves to it while training runs. Returns its index."""
        return await self.ps.add_ps(address)

    async def remove_ps(self, index: int) -> None:
        """Move every variable off ps ``index`` while training runs; then it may stop. Before the
        variables are made: leave out a ps that left before this coordinator started."""
        await self.ps.remove_ps(index)

    async def replace_ps(self, index: int, manager: CheckpointManager, *, to: int | None = None) -> None:
        """Put lost ps ``index``'s variables on the other ps (or ps ``to``) from ``manager``'s
        latest checkpoint, base and deltas, while the others train; ``index`` leaves the job."""
        await self._replacement.replace(index, manager, to=to)

    def replace_lost_ps(self, manager: CheckpointManager) -> None:
        """From now on, a ps lost while closures run is replaced by itself from ``manager``
        (``replace_ps``); the closures it failed run again once that is done."""
        self._replacement.enable(manager)

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
        return {
            "queued": self.queue.queued,
            "in_flight": self.queue.in_flight,
            "closures_done": self.queue.done_count,
            "closures_retried": self.queue.retried_count,
            "worker_failures": self.worker_failures,
            "closures_held": self.queue.held,
            "workers_up": sum(self.workers_up),
            **self.ps.statistics(),
        }

    async def serve_metrics(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve this coordinator's endpoint; returns its address: ``GET /metrics`` and
        ``/healthz``, ``statistics`` (``pstrain status``), ``coordinator/join`` and
        ``coordinator/membership``, on the server core every ps and worker uses (the stream
        and HTTP on one port, the cluster token both ways)."""
        if self._endpoint is None:
            endpoint = CoordinatorEndpoint(
                self.statistics,
                self.admit_worker,
                self.membership,
                host=host,
                port=port,
                token=self._channels.token,
            )
            endpoint.ps_changes = (self.ps.joins(self._tasks.spawn), self.remove_ps)
            await endpoint.start()
            self._endpoint = endpoint
        assert self._endpoint.address is not None
        return self._endpoint.address

    # -- lifecycle --------------------------------------------------------------------------------
    async def shutdown_cluster(self, startup_wait_s: float = 60.0) -> list[str]:
        """The job is done: ask every ps and worker to leave (those started with
        ``--exit-on-shutdown``, as under ``--slurm-jobs``, so that a SLURM job ends COMPLETED).
        A task never reached yet may still be starting: it is asked again, with back-off, for
        up to ``startup_wait_s``. Returns the tasks that did not leave (refused, unreachable)."""
        return await ask_to_leave(self._channels, startup_wait_s)

    async def close(self) -> None:
        """Stop dispatching and close the channels to the workers."""
        if self.closed:
            return
        self.closed = True
        await self._tasks.close()
        self.queue.close("the coordinator was closed")
        await self._channels.close()
        if self._endpoint is not None:
            await self._endpoint.stop()
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
        return (
            f"ClusterCoordinator(workers={len(self._workers)}, queued={self.queue.queued}, "
            f"in_flight={self.queue.in_flight})"
        )


def _runs(loop: asyncio.AbstractEventLoop) -> bool:
    """Is ``loop`` the loop running in this thread?"""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


expose(globals(), "pstrain", ["ClusterCoordinator"])
