"""The one blocking bridge: run a coroutine on uvloop, or wait from another thread.

``pstrain.run(coro)`` starts a loop (uvloop when installed) and runs
``coro`` to completion. :func:`wait_from_thread` blocks a thread other than
the loop's own until a result arrives; on the loop's thread it refuses,
because blocking there would deadlock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["run"]


def run(main: Coroutine[Any, Any, T], *, debug: bool = False) -> T:
    """Run ``main`` on a new event loop (uvloop if available) and return its result.

    >>> async def answer():
    ...     return 42
    >>> run(answer())
    42
    """
    main = _closing_channels(main)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep a door open
        return asyncio.run(main, debug=debug)
    loop = uvloop.new_event_loop()
    runner = asyncio.Runner(loop_factory=lambda: loop, debug=debug) if hasattr(asyncio, "Runner") else None
    if runner is not None:
        with runner:
            return runner.run(main)
    asyncio.set_event_loop(loop)  # pragma: no cover - Python 3.10
    try:
        return loop.run_until_complete(main)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
        asyncio.set_event_loop(None)


async def _closing_channels(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main``, then close the connections it left open on this loop."""
    from .rpc import close_loop_channels

    try:
        return await main
    finally:
        await close_loop_channels()


def wait_from_thread(fut: concurrent.futures.Future[T] | Any, loop: asyncio.AbstractEventLoop,
                     what: str, timeout: float | None = None) -> T:
    """Block this thread on ``fut``; refuse on ``loop``'s own thread."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop and loop is not None:
        raise RuntimeError(f"{what} would block the event loop that has to deliver it; "
                           "use 'await' instead")
    return fut.result(timeout)
