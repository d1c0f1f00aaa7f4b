"""RemoteValue: the result of a scheduled closure, resolved when it has run.

A closure's result has two sides. The coordinator holds the producer side,
an :class:`Outcome`, and sets it once (value or error); the user holds the
:class:`RemoteValue`, which only reads it: ``await rv`` (or ``await
rv.get()``) on any loop, ``rv.fetch()`` from a thread that runs no loop (TF
parity, through the one blocking bridge). The value is stored on the
coordinator as soon as the closure finishes, so it stays readable after the
worker that produced it dies.

Neither is an ``asyncio.Future``: an Outcome is set on the coordinator's loop
and may be awaited from any loop, and costs nothing extra when nobody waits.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Generator
from typing import Any

from .._base.exports import expose
from .._transport.bridge import block_on

__all__ = ["Outcome", "RemoteValue"]

_NOT_READY, _READY, _FAILED = 0, 1, 2
_lock = threading.Lock()  # guards the hand-over between a setter and waiters on other loops


class Outcome:
    """The producer side of a RemoteValue: set once with a value or an error.

    The RemoteValue refers to its outcome, never the other way round: a
    cycle would keep every result alive until the cyclic garbage collector
    runs.

    >>> out = Outcome()
    >>> rv = RemoteValue(out)
    >>> out.set_value(3), out.set_value(4), rv.done()
    (True, False, True)
    >>> asyncio.run(rv.get())
    3
    """

    __slots__ = ("state", "value", "waiters", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.state = _NOT_READY
        self.value: Any = None
        self.waiters: list[asyncio.Future[None]] | None = None
        self.loop = loop  # the loop that sets it (the coordinator's), once known

    def _set(self, state: int, value: Any) -> bool:
        with _lock:
            if self.state != _NOT_READY:
                return False
            self.value = value
            self.state = state
            waiters, self.waiters = self.waiters, None
        if waiters:
            for fut in waiters:
                _wake(fut)
        return True

    def set_value(self, value: Any) -> bool:
        """Resolve with ``value``; False if it was already resolved."""
        return self._set(_READY, value)

    def set_error(self, error: BaseException) -> bool:
        """Fail with ``error``; False if it was already resolved."""
        return self._set(_FAILED, error)

    def reset(self) -> None:
        """Back to not-ready (a per-worker resource being rebuilt)."""
        with _lock:
            self.state = _NOT_READY
            self.value = None

    def done(self) -> bool:
        return self.state != _NOT_READY

    def failed(self) -> bool:
        return self.state == _FAILED

    def result(self) -> Any:
        """The value, or raise the error; only once :meth:`done`."""
        if self.state == _FAILED:
            raise self.value
        return self.value

    def wait(self) -> Generator[Any, None, Any]:
        """``yield from outcome.wait()``: suspend until resolved, then its result."""
        if self.state == _NOT_READY:
            fut = asyncio.get_running_loop().create_future()
            with _lock:
                ready = self.state != _NOT_READY
                if not ready:
                    if self.waiters is None:
                        self.waiters = []
                    self.waiters.append(fut)
            if not ready:
                yield from fut.__await__()
        return self.result()


class RemoteValue:
    """The eventual result of ``coordinator.schedule(fn)``.

    On the coordinator's loop, ``await rv``; from another thread, ``rv.fetch()``::

        rv = coordinator.schedule(step_fn)
        loss = await rv
    """

    __slots__ = ("_outcome", "__weakref__")

    def __init__(self, outcome: Outcome) -> None:
        self._outcome = outcome

    def done(self) -> bool:
        """True once the value or an error is known."""
        return self._outcome.state != _NOT_READY

    def __await__(self) -> Generator[Any, None, Any]:
        return self._outcome.wait()

    async def get(self) -> Any:
        """Wait for and return the value (raises the closure's error)."""
        return await self

    def fetch(self, timeout: float | None = None) -> Any:
        """Block this thread until the value is known; refused on a thread running a loop.

        Raises :class:`~pstrain.errors.DeadlineExceededError` after ``timeout`` seconds.
        """
        outcome = self._outcome
        if outcome.state != _NOT_READY:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                return outcome.result()
        return block_on(self.get, outcome.loop, timeout=timeout, what="RemoteValue.fetch()")

    def __repr__(self) -> str:
        state = {_NOT_READY: "pending", _READY: "ready", _FAILED: "failed"}[self._outcome.state]
        return f"<RemoteValue {state}>"

    def __reduce__(self) -> Any:
        raise TypeError(
            "a RemoteValue cannot be captured by a closure; pass it as an argument "
            "to coordinator.schedule (it is resolved before the closure runs)"
        )


def _wake(fut: asyncio.Future[None]) -> None:
    loop = fut.get_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        if not fut.done():
            fut.set_result(None)
    elif not loop.is_closed():
        loop.call_soon_threadsafe(_set_none, fut)


def _set_none(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


expose(globals(), "pstrain", ["RemoteValue"])
