"""``pstrain.run``: run a coroutine on a fresh uvloop loop, then close its connections.

With ``RemoteValue.fetch()`` (which refuses the loop's own thread) this is one
of the two blocking doors of the API.
"""

from __future__ import annotations

import asyncio
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
