"""What an update sent from a closure carries: its dispatch (fencing) and exactly-once key.

A worker sets both in each closure's own context (:func:`set_dispatch`); the
channel adds them to every request that changes variables (:func:`update_tags`),
so no variable, optimizer or user code has to pass them along.

* ``owner``: the coordinator incarnation (its strategy's owner id) the update
  works for. Fences are kept per owner, so a fence an earlier coordinator set
  never refuses a new one's updates; and once a new coordinator has taken the
  ps over, every update of the old one (a zombie) is refused.
* ``fence = [worker index, epoch]``: when the coordinator declares a worker
  lost, it starts a new epoch for it and tells every ps to refuse the old one,
  so a worker that was only cut off cannot apply updates on top of the
  closures that were rerun elsewhere.
* ``once = [closure key, n]``: the closure's n-th variable operation (one
  ``assign_add``, one ``apply_gradients``: every request it sends, to any ps,
  carries the same n, see :func:`one_operation`); a ps applies (key, n) to each
  variable once, so an exactly-once closure rerun after its worker died does not
  apply its updates twice, also when a variable moved to another ps meanwhile
  (its record of what was applied moves with it). An operation of code that is
  not an exactly-once closure gets a key of its own (``op:...``): a request of it
  sent again because its connection dropped before the reply (its ps drained and
  left, the variable moved) is then applied once too.
* ``as_of = [closure key, n]`` on a read (:func:`read_tags`): an exactly-once
  closure's read after n operations; a rerun so reads, of what its dead attempt
  changed, the values from before (``server/ps/before_images.py``).

>>> update_tags("/job:ps/replica:0/task:0")   # outside a closure: nothing
{}
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import os
from collections.abc import Iterator
from typing import Any

__all__ = ["OP_PREFIX", "cause", "one_operation", "read_tags", "set_dispatch", "update_tags"]

#: The key of an operation outside exactly-once closures starts so (a ps keeps those
#: apart, for a short while: they matter while a request may be sent again).
OP_PREFIX = "op:"
_op_numbers = itertools.count(1)  # (next() on a count is atomic: threads share it)
_op_process = ""


def _new_process() -> None:
    """Operation keys of this process start so (again in a forked child: its keys must not
    be its parent's)."""
    global _op_process
    _op_process = f"{OP_PREFIX}{os.urandom(8).hex()}:"


_new_process()
os.register_at_fork(after_in_child=_new_process)

#: ``(owner, worker index, epoch)`` of the closure running here: the ps refuses updates
#: of epochs the coordinator has superseded (the worker was declared lost meanwhile), and
#: of owners a newer coordinator has superseded.
_fence: contextvars.ContextVar[tuple[str | None, int, int] | None] = contextvars.ContextVar(
    "pstrain_fence", default=None
)
#: An exactly-once closure's key and its operation counter (``{"n": operations so far}``).
_once: contextvars.ContextVar[tuple[str, dict[str, int]] | None] = contextvars.ContextVar(
    "pstrain_once", default=None
)
#: The number of the variable operation running here (its requests share it).
_operation: contextvars.ContextVar[int | None] = contextvars.ContextVar("pstrain_operation", default=None)


def cause(worker: int, epoch: int) -> str:
    """The cause id of what happens to dispatch ``epoch`` of worker ``worker``: the
    coordinator declaring it lost and fencing it, the worker abandoning it for a newer
    one, a ps refusing its late updates. Each of their log lines carries it (``cause=``),
    so one lost-worker incident can be followed across the coordinator's, the worker's
    and every ps's logs (as dask's ``stimulus_id``).

    >>> cause(1, 3)
    'w1.d3'
    """
    return f"w{worker}.d{epoch}"


def set_dispatch(fence: tuple[str | None, int, int] | None, once_key: str | None) -> None:
    """Called by a worker in a closure's own context, before the closure runs."""
    _fence.set(fence)
    _once.set((once_key, {}) if once_key else None)


def sender_owner(owner: str | None) -> str | None:
    """The coordinator a request sent here works for: in a closure, the one that
    dispatched it; else ``owner``, the channel's own. No counter moves (unlike
    :func:`update_tags`)."""
    fence = _fence.get()
    return (fence[0] or owner) if fence is not None else owner


def update_tags(task: str, owner: str | None = None) -> dict[str, Any]:
    """The fields an update sent to ``task`` carries here: ``owner``, ``fence`` and ``once``
    (outside closures only ``owner``, the sender's own, when it has one)."""
    tags: dict[str, Any] = {}
    fence = _fence.get()
    if fence is not None:
        fence_owner, worker, epoch = fence
        owner = fence_owner or owner
        tags["fence"] = [worker, epoch]
    if owner is not None:
        tags["owner"] = owner
    once = _once.get()
    if once is not None:
        key, counters = once
        seq = _operation.get()
        if seq is None:  # a request outside one_operation() is an operation of its own
            counters["n"] = seq = counters.get("n", 0) + 1
        tags["once"] = [key, seq]
    return tags


def read_tags() -> dict[str, Any]:
    """What a read sent here carries: in an exactly-once closure, ``as_of = [key, n]``, its
    key and the number of operations it had begun before this read (no counter moves). A ps
    answers a rerun's read of what its dead attempt's first ``n + 1``-th or later operation
    changed with the values from before that change (``server/ps/before_images.py``).

    >>> set_dispatch(None, "k")
    >>> read_tags()
    {'as_of': ['k', 0]}
    >>> with one_operation():
    ...     inside = read_tags()
    >>> inside, read_tags()
    ({'as_of': ['k', 0]}, {'as_of': ['k', 1]})
    >>> set_dispatch(None, None)
    >>> read_tags()
    {}
    """
    once = _once.get()
    if once is None or once[0].startswith(OP_PREFIX):
        return {}
    current = _operation.get()
    begun = current - 1 if current is not None else once[1].get("n", 0)
    return {"as_of": [once[0], begun]}


@contextlib.contextmanager
def one_operation() -> Iterator[None]:
    """The requests sent inside are one operation of an exactly-once closure: they carry
    the same number, however they are split between ps (a variable that moved is sent to
    its new ps under the number its first attempt had). Nested uses are the outer one.

    >>> set_dispatch(None, "k")
    >>> with one_operation():
    ...     a = update_tags("/job:ps/replica:0/task:0")["once"]
    ...     b = update_tags("/job:ps/replica:0/task:1")["once"]
    >>> a, b, update_tags("/job:ps/replica:0/task:0")["once"]
    (['k', 1], ['k', 1], ['k', 2])
    >>> set_dispatch(None, None)
    """
    once = _once.get()
    if _operation.get() is not None:
        yield
        return
    if once is None:  # not in an exactly-once closure: the operation gets a key of its own
        key = _op_process + str(next(_op_numbers))
        token_once, token_op = _once.set((key, {"n": 1})), _operation.set(1)
        try:
            yield
        finally:
            _operation.reset(token_op)
            _once.reset(token_once)
        return
    counters = once[1]
    counters["n"] = seq = counters.get("n", 0) + 1
    token = _operation.set(seq)
    try:
        yield
    finally:
        _operation.reset(token)
