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

import contextvars
from typing import TYPE_CHECKING

from .errors import PstrainError

if TYPE_CHECKING:
    from .rpc import ChannelPool

__all__ = ["current_channels", "get_current_worker_index", "in_closure", "worker_context"]

_worker_index: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "pstrain_worker_index", default=None)
_channels: contextvars.ContextVar[ChannelPool | None] = contextvars.ContextVar(
    "pstrain_channels", default=None)


def in_closure() -> bool:
    """True while a closure or dataset function runs (on a worker)."""
    return _worker_index.get() is not None


def get_current_worker_index() -> int:
    """The index of the worker running the current closure or dataset function.

    >>> get_current_worker_index()
    Traceback (most recent call last):
    ...
    RuntimeError: Currently accessing worker index inside non-dispatched function: get_current_worker_index() works inside closures and dataset functions
    """
    index = _worker_index.get()
    if index is None:
        raise RuntimeError("Currently accessing worker index inside non-dispatched function: "
                           "get_current_worker_index() works inside closures and dataset functions")
    return index


def current_channels() -> ChannelPool:
    """The channels of the code running now (a closure's worker); raises if there are none."""
    pool = _channels.get()
    if pool is None:
        raise PstrainError(
            "no cluster is known here: this variable handle was unpickled outside a closure. "
            "Variables reach their ps from inside closures, or through the strategy that "
            "created them")
    return pool


def worker_context(index: int, channels: ChannelPool | None) -> contextvars.Context:
    """A fresh context in which closures of worker ``index`` run.

    >>> ctx = worker_context(3, None)
    >>> ctx.run(get_current_worker_index)
    3
    """
    ctx = contextvars.copy_context()
    ctx.run(_worker_index.set, index)
    ctx.run(_channels.set, channels)
    return ctx
