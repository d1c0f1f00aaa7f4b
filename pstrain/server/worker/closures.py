"""How a worker runs closures, short of the server: a batch of results on its way back,
the pool of threads that run plain ``def`` closures, and the checks and encodings of
what a closure returns."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import queue
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from ..._base.caches import FifoCache
from ..._base.errors import InvalidArgumentError
from ..._formats.messages.closures import ERROR, FUNCTION_BYTES_KEPT, FUNCTIONS_KEPT, exception_payload
from ..._formats.messages.records import ClosureResult
from ..._serving.core import Encoded
from ..._transport import wire
from ..._transport.bridge import new_event_loop
from ..._transport.frames import DEFAULT_MAX_BODY

__all__ = [
    "MAX_PENDING_SCALARS",
    "Batch",
    "ClosureLoop",
    "Functions",
    "Outbox",
    "SyncPool",
    "Unloadable",
    "check_awaited",
    "encode_results",
]

#: Scalars closures may log between two results messages; more are dropped (and counted).
MAX_PENDING_SCALARS = 100_000


def check_awaited(missed: list[str]) -> None:
    """A closure that dropped a pstrain operation without ``await`` failed: the operation
    never ran (an update silently lost otherwise)."""
    if missed:
        raise InvalidArgumentError(
            f"the closure called {', '.join(sorted(set(missed)))} without `await`: "
            "the operation never ran. Write `await` before it (in an `async def` closure), or "
            "return it from a plain `def` closure"
        )


class Batch:
    """One ``worker/run`` request: results go out as partial replies, then the last."""

    __slots__ = ("remaining", "emit", "results", "done", "epoch", "abandoned", "tasks")

    def __init__(
        self,
        count: int,
        emit: Callable[[Any], None] | None,
        done: asyncio.Future[Encoded],
        epoch: int | None = None,
    ) -> None:
        self.remaining = count
        self.emit = emit
        self.results: list[ClosureResult] = []
        self.done = done
        self.epoch = epoch  # the coordinator's dispatch it belongs to (``dispatches.py``)
        self.abandoned = False  # a newer dispatch arrived: start nothing more of it
        self.tasks: set[asyncio.Task[Any]] = set()  # its async closures running (closure loop)


class Unloadable:
    """A function that failed to unpickle here: calling it raises why."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise self.error


def _unpickle(pickled: bytes) -> Callable[..., Any]:
    import cloudpickle

    try:
        return cloudpickle.loads(pickled)
    except Exception as exc:  # e.g. a module the worker cannot import
        return Unloadable(exc)


class Functions:
    """The functions sent to a worker, by digest (each travels once per connection).

    They are unpickled on a thread: the first closure of a PyTorch model imports torch,
    seconds during which the serving loop must go on answering health checks (the
    coordinator declared such a worker lost, and ran the step again beside it). A batch
    waits for the functions it calls, also those another batch is still loading.

    Twice as many are kept as a coordinator counts a worker as holding (``FUNCTIONS_KEPT``,
    ``FUNCTION_BYTES_KEPT`` of their pickled bytes), the oldest dropped first, never one a
    batch waiting to start calls (:meth:`hold`). A closure whose function was dropped all
    the same (another coordinator sent newer ones) is answered ``UNSENT``, and comes again
    with its function's bytes.
    """

    def __init__(self, max_items: int = 2 * FUNCTIONS_KEPT, max_bytes: int = 2 * FUNCTION_BYTES_KEPT) -> None:
        self.kept: FifoCache[bytes, Callable[..., Any]] = FifoCache(max_items, max_bytes)
        self.loading: dict[bytes, asyncio.Future[Callable[..., Any]]] = {}
        self._held: dict[bytes, int] = {}  # digest -> batches waiting to start that call it

    def get(self, digest: bytes) -> Callable[..., Any] | None:
        return self.kept.entries.get(digest)

    def hold(self, digests: set[bytes]) -> None:
        """Keep ``digests`` until :meth:`release`: a batch that calls them waits to start."""
        held = self._held
        for d in digests:
            held[d] = held.get(d, 0) + 1

    def release(self, digests: set[bytes]) -> None:
        held = self._held
        for d in digests:
            n = held[d] - 1
            if n:
                held[d] = n
            else:
                del held[d]

    async def load(self, fns: dict[bytes, bytes], needed: set[bytes]) -> None:
        """Start unpickling ``fns``, then wait for those of ``needed`` still loading."""
        loop = asyncio.get_running_loop()
        kept = self.kept
        for digest, pickled in fns.items():
            fn = kept.entries.get(digest)
            if digest in self.loading:
                continue
            if fn is not None and not isinstance(fn, Unloadable):
                kept.touch(digest)  # sent again on a new connection, or after the coordinator dropped it
                continue
            ctx = contextvars.copy_context()  # what unpickling saw on the serving loop
            future = self.loading[digest] = loop.run_in_executor(None, ctx.run, _unpickle, pickled)
            future.add_done_callback(functools.partial(self._loaded, digest, len(pickled)))
        for digest in needed:
            pending = self.loading.get(digest)
            if pending is not None:  # (its callback, added first, has run when this wakes)
                await asyncio.shield(pending)

    def _loaded(self, digest: bytes, size: int, future: asyncio.Future[Callable[..., Any]]) -> None:
        self.kept.put(digest, future.result(), size, keep=self._held.__contains__)  # never raises
        del self.loading[digest]


def encode_results(
    results: list[ClosureResult],
    scalars: list[Any] | None = None,
    leaving: bool = False,
    limit: int = DEFAULT_MAX_BODY,
) -> Encoded:
    """Encode results once (each as ``ClosureResult``'s array, written out here: the hottest
    reply, one per finished closure); a result that cannot travel becomes an error saying so:
    one that cannot be encoded, or one larger than ``limit`` (the largest message the
    coordinator takes, as every pstrain process by default). ``leaving``: the worker is
    draining (the coordinator sends it nothing more)."""
    extra: dict[str, Any] = {"scalars": scalars} if scalars else {}
    if leaving:
        extra["leaving"] = True
    arrays = [[r.id, r.status.value, r.value] for r in results]
    try:
        body = wire.encode_body({"results": arrays, **extra}, allow_pickle=True)
        if wire.body_size(body) <= limit:
            return Encoded(body)
    except Exception:
        pass
    out = []
    for record in arrays:
        try:
            size = wire.body_size(wire.encode_body(record, allow_pickle=True))
            why = (
                f"it is {size} bytes, more than the {limit} one message to the coordinator may "
                "carry: return less (write a large result to a file, or a variable)"
                if size > limit
                else None
            )
        except Exception as exc:
            why = str(exc)
        if why is None:
            out.append(record)
        else:
            err = TypeError(
                f"the closure's result of type {type(record[2]).__name__} cannot be "
                f"sent back to the coordinator: {why}"
            )
            out.append([record[0], ERROR.value, exception_payload(err)])
    return Encoded(wire.encode_body({"results": out, **extra}, allow_pickle=True))


class SyncPool:
    """Threads that run plain ``def`` closures: one more is started when a closure waits
    and none is idle, up to ``size``; ``run(item)`` runs on the thread."""

    def __init__(self, size: int, run: Callable[[Any], None], name: str) -> None:
        self.size = size
        self.run = run
        self.name = name
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, item: Any) -> None:
        with self._lock:
            spawn = self._idle == 0 and len(self._threads) < self.size
        if spawn:
            t = threading.Thread(target=self._main, daemon=True, name=f"{self.name}{len(self._threads)}")
            self._threads.append(t)
            t.start()
        self._queue.put(item)

    def stop(self) -> None:
        """Each thread ends after the closure it runs (if any)."""
        for _ in self._threads:
            self._queue.put(None)

    def _main(self) -> None:
        q = self._queue
        lock = self._lock
        while True:
            with lock:
                self._idle += 1
            item = q.get()
            with lock:
                self._idle -= 1
            if item is None:
                return
            self.run(item)
            del item  # not held while waiting for the next closure: a dropped resource must go


class Outbox:
    """Results of finished closures, and scalars they logged, waiting to leave (any thread
    puts; the serving loop takes them all at once: one message carries them)."""

    def __init__(self) -> None:
        self.items: list[tuple[Batch, ClosureResult]] = []
        self.scalars: list[list[Any]] = []  # pstrain.summary scalars waiting to leave
        self.scalars_dropped = 0  # past MAX_PENDING_SCALARS (a closure logging in a tight loop)
        self.closure_seconds = 0.0
        self._lock = threading.Lock()
        self._flush_scheduled = False

    def scalar(self, name: str, value: float, step: int, wall_time: float) -> None:
        with self._lock:
            if len(self.scalars) < MAX_PENDING_SCALARS:
                self.scalars.append([name, value, step, wall_time])
            else:
                self.scalars_dropped += 1

    def put(self, batch: Batch, record: ClosureResult, seconds: float) -> bool:
        """Add a result; True when the caller must schedule a flush (none is pending)."""
        with self._lock:
            self.closure_seconds += seconds
            self.items.append((batch, record))
            if self._flush_scheduled:
                return False
            self._flush_scheduled = True
            return True

    def take(self) -> tuple[list[tuple[Batch, ClosureResult]], list[list[Any]]]:
        with self._lock:
            items, self.items = self.items, []
            scalars, self.scalars = self.scalars, []
            self._flush_scheduled = False
        return items, scalars


class ClosureLoop:
    """The thread whose event loop runs a worker's ``async def`` closures (where its
    channels to the ps live), apart from the loop that serves requests."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    async def start(self) -> asyncio.AbstractEventLoop:
        serving = asyncio.get_running_loop()
        ready: asyncio.Future[None] = serving.create_future()
        self._thread = threading.Thread(target=self._main, args=(serving, ready), name=self.name, daemon=True)
        self._thread.start()
        await ready
        assert self.loop is not None
        return self.loop

    def _main(self, serving: asyncio.AbstractEventLoop, ready: asyncio.Future[None]) -> None:
        loop = new_event_loop()
        asyncio.set_event_loop(loop)
        self.loop = loop
        serving.call_soon_threadsafe(_set_none, ready)
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def run(self, work: Coroutine[Any, Any, Any]) -> Any:
        """Run ``work`` on the closure loop, from the serving loop."""
        assert self.loop is not None
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(work, self.loop))

    async def stop(self, shutdown: Callable[[], Awaitable[None]]) -> None:
        """``await shutdown()`` on the closure loop, then stop it."""
        loop = self.loop
        if loop is not None and loop.is_running():

            async def last() -> None:
                await shutdown()

            await self.run(last())
            loop.call_soon_threadsafe(loop.stop)

    async def join(self, timeout: float) -> None:
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)


def _set_none(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
