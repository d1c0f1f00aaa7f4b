"""Counting the requests code sends, and their bytes: ``with pstrain.count_requests() as
counts:`` around a step (in a closure, on the worker) tells how many requests it sent to
each task and how many bytes went each way, what W8 reports per step.

Counting follows the code, not the process: requests sent by tasks the block starts
(``asyncio.gather``, ``create_task``) count too, other closures' do not.

>>> import asyncio
>>> async def nothing():
...     with count_requests() as counts:
...         await asyncio.sleep(0)
...     return counts.requests, counts.as_dict()["bytes_sent"]
>>> asyncio.run(nothing())
(0, 0)
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

from .._base.exports import expose

__all__ = ["RequestCounts", "count_requests", "counted", "counting"]

#: The counters open in this context, innermost last.
_open: contextvars.ContextVar[tuple[RequestCounts, ...]] = contextvars.ContextVar(
    "pstrain_request_counts", default=()
)


class RequestCounts:
    """Requests sent and bytes moved inside a :func:`count_requests` block: ``per_task``
    maps a task (``"/job:ps/replica:0/task:0"``) to its requests, ``per_op`` an operation
    (``"vars/sparse_read"``) to its; bytes are frame bodies (what the wire carries, less
    the 16-byte headers)."""

    __slots__ = ("per_task", "per_op", "bytes_sent", "bytes_received")

    def __init__(self) -> None:
        self.per_task: dict[str, int] = {}
        self.per_op: dict[str, int] = {}
        self.bytes_sent = 0
        self.bytes_received = 0

    @property
    def requests(self) -> int:
        """Requests sent to every task while counting."""
        return sum(self.per_task.values())

    def to(self, job: str) -> int:
        """Requests sent to the tasks of ``job`` (``"ps"``)."""
        return sum(n for task, n in self.per_task.items() if task.startswith(f"/job:{job}/"))

    def as_dict(self) -> dict[str, Any]:
        """The counts as a dictionary: ``requests``, ``per_task``, ``per_op``, ``bytes_sent`` and
        ``bytes_received``."""
        return {
            "requests": self.requests,
            "per_task": dict(self.per_task),
            "per_op": dict(self.per_op),
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
        }

    def __repr__(self) -> str:
        return (
            f"RequestCounts(requests={self.requests}, bytes_sent={self.bytes_sent}, "
            f"bytes_received={self.bytes_received})"
        )


@contextlib.contextmanager
def count_requests() -> Iterator[RequestCounts]:
    """Count the requests sent (and their bytes) until the block ends."""
    counts = RequestCounts()
    token = _open.set(_open.get() + (counts,))
    try:
        yield counts
    finally:
        _open.reset(token)


def counting() -> bool:
    """Whether some :func:`count_requests` block is open here."""
    return bool(_open.get())


def counted(task: str, op: str, sent: int) -> list[RequestCounts]:
    """Count one request to ``task``; returns the counters that then take its reply's bytes."""
    counters = _open.get()
    for c in counters:
        c.per_task[task] = c.per_task.get(task, 0) + 1
        c.per_op[op] = c.per_op.get(op, 0) + 1
        c.bytes_sent += sent
    return list(counters)


expose(globals(), "pstrain")
