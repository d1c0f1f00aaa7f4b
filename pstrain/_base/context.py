"""Where the running code stands: which worker it runs on, which channels it uses.

Both are ``contextvars``, set by a worker for each closure and dataset
function it runs (whatever thread or loop that is), never process globals, so
two workers, a ps and a coordinator can share one process (and one test).

* :func:`get_current_worker_index` answers "which worker am I" inside a
  closure or a ``dataset_fn``, as in TF.
* :func:`current_channels` is the channel pool that variable handles
  unpickled inside a closure use to reach their ps.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import warnings
from collections.abc import Callable, Coroutine, Generator, Iterator
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from .errors import PstrainError
from .exports import expose

if TYPE_CHECKING:
    from .._transport.channels import ChannelPool

__all__ = [
    "current_channels",
    "get_current_worker_index",
    "in_closure",
    "must_await",
    "watch_unawaited",
    "worker_context",
]

P = ParamSpec("P")
T = TypeVar("T")

_worker_index: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "pstrain_worker_index", default=None
)
_channels: contextvars.ContextVar[ChannelPool | None] = contextvars.ContextVar(
    "pstrain_channels", default=None
)


def in_closure() -> bool:
    """True while a closure or dataset function runs (on a worker)."""
    return _worker_index.get() is not None


def get_current_worker_index() -> int:
    """The index of the worker running the current closure or dataset function.

    >>> get_current_worker_index()  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    RuntimeError: Currently accessing worker index inside non-dispatched function: ...
    """
    index = _worker_index.get()
    if index is None:
        raise RuntimeError(
            "Currently accessing worker index inside non-dispatched function: "
            "get_current_worker_index() works inside closures and dataset functions"
        )
    return index


def current_channels() -> ChannelPool:
    """The channels of the code running now (a closure's worker); raises if there are none."""
    pool = _channels.get()
    if pool is None:
        raise PstrainError(
            "no cluster is known here: this variable handle was unpickled outside a closure. "
            "Variables reach their ps from inside closures, or through the strategy that "
            "created them"
        )
    return pool


def worker_context(
    index: int, channels: ChannelPool | None, scalars: ScalarSink | None = None
) -> contextvars.Context:
    """A fresh context in which closures of worker ``index`` run (``scalars``: where the
    scalars they log with ``pstrain.summary`` go).

    >>> ctx = worker_context(3, None)
    >>> ctx.run(get_current_worker_index)
    3
    """
    ctx = contextvars.copy_context()
    ctx.run(_worker_index.set, index)
    ctx.run(_channels.set, channels)
    ctx.run(_scalar_sink.set, scalars)
    return ctx


#: ``sink(name, value, step, wall_time)``: where a closure's scalars go (its worker's outbox).
ScalarSink = Callable[[str, float, int, float], None]
_scalar_sink: contextvars.ContextVar[ScalarSink | None] = contextvars.ContextVar(
    "pstrain_scalar_sink", default=None
)


def scalar_sink() -> ScalarSink | None:
    """Inside a closure: where ``pstrain.summary.scalar`` sends its scalars (None elsewhere)."""
    return _scalar_sink.get()


# -- operations that must be awaited ------------------------------------------------------------
#: Inside a closure: the pstrain operations it created and dropped without awaiting.
_unawaited: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "pstrain_unawaited", default=None
)


@contextlib.contextmanager
def watch_unawaited() -> Iterator[list[str]]:
    """Collect the pstrain operations created and dropped unawaited inside (a closure)."""
    missed: list[str] = []
    token = _unawaited.set(missed)
    try:
        yield missed
    finally:
        _unawaited.reset(token)


class _Operation(Coroutine[Any, Any, T]):
    """A pstrain operation's coroutine that knows if it was dropped without ``await``: inside
    a closure that fails the closure (a forgotten ``await`` silently drops an update
    otherwise); elsewhere it warns, naming the operation."""

    __slots__ = ("_coro", "_what", "_used")

    def __init__(self, coro: Coroutine[Any, Any, T], what: str) -> None:
        self._coro = coro
        self._what = what
        self._used = False

    def __await__(self) -> Generator[Any, None, T]:
        self._used = True
        return self._coro.__await__()

    def send(self, value: Any) -> Any:
        self._used = True
        return self._coro.send(value)

    def throw(self, *args: Any) -> Any:
        self._used = True
        return self._coro.throw(*args)

    def close(self) -> None:
        self._used = True
        self._coro.close()

    def __del__(self) -> None:
        if self._used:
            return
        self._coro.close()  # reported here, not by Python's generic warning
        missed = _unawaited.get()
        if missed is not None:
            missed.append(self._what)
        else:
            warnings.warn(
                f"{self._what} was never awaited: it did nothing (add `await`)", RuntimeWarning, stacklevel=2
            )


def must_await(fn: Callable[P, Coroutine[Any, Any, T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """Decorate an ``async def`` operation so that dropping its coroutine unawaited is caught."""
    what = fn.__qualname__ + "()"

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, T]:
        return _Operation(fn(*args, **kwargs), what)

    return wrapper


expose(globals(), "pstrain", ["get_current_worker_index"])
