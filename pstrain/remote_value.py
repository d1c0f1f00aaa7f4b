"""RemoteValue: the result of a scheduled closure, resolved when it has run.

``await rv`` (or ``await rv.get()``) waits on the coordinator's loop;
``rv.fetch()`` blocks a *different* thread (TF parity) and refuses on the
loop's own thread, where blocking would deadlock. The value is stored on the
coordinator as soon as the closure finishes, so it stays readable after the
worker that produced it dies.

A RemoteValue is not an ``asyncio.Future``: it is set on the coordinator's
loop and may be awaited from any loop or waited on from any thread, and costs
nothing extra when nobody waits.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Generator
from typing import Any

__all__ = ["RemoteValue"]

_NOT_READY, _READY, _FAILED = 0, 1, 2
_lock = threading.Lock()  # guards the hand-over between a setter and a fetch() waiter


class RemoteValue:
    """The eventual result of ``coordinator.schedule(fn)``.

    >>> # rv = coordinator.schedule(step_fn)
    >>> # loss = await rv          # on the coordinator's loop
    >>> # loss = rv.fetch()        # from another thread
    """

    __slots__ = ("_state", "_value", "_waiters", "_event", "_loop", "__weakref__")

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._state = _NOT_READY
        self._value: Any = None
        self._waiters: list[asyncio.Future[None]] | None = None
        self._event: threading.Event | None = None
        self._loop = loop

    # -- producer side (coordinator loop) ---------------------------------------------------
    def _set(self, state: int, value: Any) -> bool:
        with _lock:
            if self._state != _NOT_READY:
                return False
            self._value = value
            self._state = state
            event = self._event
        if event is not None:
            event.set()
        waiters, self._waiters = self._waiters, None
        if waiters:
            for fut in waiters:
                _wake(fut)
        return True

    def _set_value(self, value: Any) -> bool:
        return self._set(_READY, value)

    def _set_error(self, error: BaseException) -> bool:
        return self._set(_FAILED, error)

    def _reset(self) -> None:
        """Back to not-ready (a per-worker resource being rebuilt)."""
        with _lock:
            self._state = _NOT_READY
            self._value = None
            self._event = None

    # -- consumer side -----------------------------------------------------------------------
    def done(self) -> bool:
        """True once the value or an error is known."""
        return self._state != _NOT_READY

    def _result(self) -> Any:
        if self._state == _FAILED:
            raise self._value
        return self._value

    def __await__(self) -> Generator[Any, None, Any]:
        if self._state == _NOT_READY:
            fut = asyncio.get_running_loop().create_future()
            with _lock:
                ready = self._state != _NOT_READY
                if not ready:
                    if self._waiters is None:
                        self._waiters = []
                    self._waiters.append(fut)
            if not ready:
                yield from fut.__await__()
        return self._result()

    async def get(self) -> Any:
        """Wait for and return the value (raises the closure's error)."""
        return await self

    def fetch(self, timeout: float | None = None) -> Any:
        """Block this thread until the value is known; not on the coordinator's loop thread."""
        loop = self._loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not None and (loop is None or running is loop):
            raise RuntimeError("RemoteValue.fetch() blocks, and this is the coordinator's event "
                               "loop thread; use 'await remote_value' here instead")
        if self._state == _NOT_READY:
            with _lock:
                if self._state == _NOT_READY and self._event is None:
                    self._event = threading.Event()
                event = self._event
            if event is not None and not event.wait(timeout):
                raise TimeoutError(f"RemoteValue not ready after {timeout} s")
        return self._result()

    def __repr__(self) -> str:
        state = {_NOT_READY: "pending", _READY: "ready", _FAILED: "failed"}[self._state]
        return f"<RemoteValue {state}>"

    def __reduce__(self) -> Any:
        raise TypeError("a RemoteValue cannot be captured by a closure; pass it as an argument "
                        "to coordinator.schedule (it is resolved before the closure runs)")


def _wake(fut: asyncio.Future[None]) -> None:
    loop = fut.get_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        if not fut.done():
            fut.set_result(None)
    else:
        loop.call_soon_threadsafe(_set_none, fut)


def _set_none(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)

