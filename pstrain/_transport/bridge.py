"""The one blocking bridge between threads and event loops.

pstrain's API is asynchronous; three places must nevertheless block a thread
until a coroutine has finished: ``pstrain.run(main())`` (no loop yet),
``RemoteValue.fetch()`` (TF parity: a plain thread waits for a result that
the coordinator's loop produces) and a worker's thread running a plain
``def`` closure that returned an awaitable (it must finish on the worker's
closure loop). All of them go through :func:`block_on`, which

* refuses a thread that is running an event loop (blocking it would
  deadlock that loop): the caller should ``await`` instead;
* raises :class:`~pstrain.errors.DeadlineExceededError` (a ``TimeoutError``)
  when ``timeout`` passes, cancelling the work it started;
* turns Ctrl-C (``KeyboardInterrupt``) into cancellation of that work, then
  re-raises it;
* runs the coroutine in the *caller's* ``contextvars`` context, so "which
  worker am I" and "which channels do I use" follow the work across threads.

>>> async def answer():
...     return 42
>>> run(answer())
42
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import inspect
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from .._base.errors import DeadlineExceededError, PstrainError
from .._base.exports import expose
from .channels import close_loop_channels
from .interrupt import Interruption

__all__ = ["block_on", "run"]

T = TypeVar("T")


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new uvloop loop (asyncio's own if uvloop is missing)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep a door open
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def block_on(
    make: Callable[[], Awaitable[T]],
    loop: asyncio.AbstractEventLoop | None = None,
    *,
    timeout: float | None = None,
    what: str = "this call",
) -> T:
    """Block this thread until ``make()`` has been awaited on ``loop``; return its result.

    With ``loop=None`` a fresh loop runs here for the duration (``pstrain.run``).
    """
    if _running_loop() is not None:
        raise RuntimeError(
            f"{what} blocks, and this thread is running an event loop; use 'await' here instead"
        )
    if loop is None:
        return _run_here(make, timeout)
    if loop.is_closed():
        raise PstrainError(f"{what}: the event loop it needs is closed")
    ctx = contextvars.copy_context()
    done: concurrent.futures.Future[T] = concurrent.futures.Future()
    started: list[asyncio.Task[T]] = []

    def start() -> None:
        if done.cancelled():
            return
        try:
            task = loop.create_task(_as_coroutine(make()), context=ctx)
        except BaseException as exc:  # make() itself failed
            done.set_exception(exc)
            return
        started.append(task)
        task.add_done_callback(lambda t: _copy_outcome(t, done))

    loop.call_soon_threadsafe(start)
    try:
        return done.result(timeout)
    except concurrent.futures.TimeoutError:
        _cancel(loop, done, started)
        raise DeadlineExceededError(f"{what} did not finish within {timeout:g} s") from None
    except KeyboardInterrupt:
        _cancel(loop, done, started)
        raise


def _run_here(make: Callable[[], Awaitable[T]], timeout: float | None) -> T:
    async def main() -> T:
        if timeout is None:
            return await make()
        try:
            return await asyncio.wait_for(_as_coroutine(make()), timeout)
        except TimeoutError:
            raise DeadlineExceededError(f"did not finish within {timeout:g} s") from None

    # asyncio.Runner cancels the main task on Ctrl-C, waits for it, then raises KeyboardInterrupt.
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main())


async def _as_coroutine(awaitable: Awaitable[T]) -> T:
    return await awaitable


def _copy_outcome(task: asyncio.Task[T], done: concurrent.futures.Future[T]) -> None:
    if done.done():
        return
    if task.cancelled():
        done.cancel()
    elif task.exception() is not None:
        done.set_exception(task.exception())
    else:
        done.set_result(task.result())


def _cancel(
    loop: asyncio.AbstractEventLoop, done: concurrent.futures.Future[Any], started: list[asyncio.Task[Any]]
) -> None:
    done.cancel()
    if loop.is_closed():
        return

    def cancel_task() -> None:
        for task in started:
            task.cancel()

    loop.call_soon_threadsafe(cancel_task)


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on a new event loop (uvloop), then close the channels it left open.

    The blocking door of a program: ``pstrain.run(train())``. Ctrl-C (SIGINT) lets the
    steps in flight finish (a few seconds at most), cancels ``main``, prints one line saying
    what was kept and raises ``SystemExit(130)``; a second Ctrl-C cancels at once (see
    Operations in the docs).
    """
    if not inspect.iscoroutine(main):
        hint = f": call it, pstrain.run({main.__name__}())" if inspect.iscoroutinefunction(main) else ""
        raise TypeError(f"pstrain.run() needs a coroutine, got {main!r}{hint}")
    if _running_loop() is not None:
        main.close()  # never awaited: say why instead of warning about it
        raise RuntimeError(
            "pstrain.run() starts an event loop, and this thread is already running "
            "one; 'await' the coroutine here instead"
        )

    interruption = Interruption()

    async def closing() -> T:
        interruption.install()
        try:
            return await main
        finally:
            await interruption.uninstall()
            await close_loop_channels()

    try:
        return block_on(closing, None, what="pstrain.run()")
    except BaseException:
        if not interruption.fired:
            raise
        # Whatever the cancellation raised on its way out, the program was interrupted.
        print(interruption.line(), file=sys.stderr, flush=True)
        raise SystemExit(130) from None


expose(globals(), "pstrain", ["run"])
