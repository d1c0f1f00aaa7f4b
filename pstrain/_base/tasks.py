"""TaskOwner: the one owner of a component's background tasks.

Servers, the coordinator and channels start tasks that outlive the call that
started them (a handler still running, a dispatcher, a connection attempt).
Each such task belongs to exactly one :class:`TaskOwner`, which

* keeps a reference (the event loop only keeps weak ones),
* cancels and waits for every task on :meth:`TaskOwner.close`, and
* *reports* a task that fails: ``on_failure(exc)`` is called, so a failure
  reaches something that acts on it (the coordinator raises it from
  ``join()``) instead of only being logged when the task is collected.

A task whose outcome somebody awaits (``observed=True``) is not reported:
its awaiter gets the error. The owner only makes sure it is not leaked.

This is ``asyncio.TaskGroup`` without its "one failure cancels the rest"
rule, which is wrong for a server (one bad request must not stop the others).

>>> import asyncio
>>> async def main():
...     owner = TaskOwner("example")
...     task = owner.spawn(asyncio.sleep(0, result=7))
...     value = await task
...     await owner.close()
...     return value, len(owner)
>>> asyncio.run(main())
(7, 0)
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from .errors import PstrainError

logger = logging.getLogger(__name__)

__all__ = ["TaskOwner", "best_effort"]

T = TypeVar("T")


class TaskOwner:
    """Owns background tasks: keeps them, cancels them on close, reports their failures."""

    def __init__(self, name: str, on_failure: Callable[[BaseException], None] | None = None) -> None:
        self.name = name
        self.on_failure = on_failure
        self.failures = 0
        self.closed = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._observed: set[asyncio.Task[Any]] = set()

    def spawn(
        self,
        coro: Coroutine[Any, Any, T],
        *,
        observed: bool = False,
        context: contextvars.Context | None = None,
    ) -> asyncio.Task[T]:
        """Run ``coro`` as a task of this owner (in ``context``, if given).

        ``observed``: the caller awaits the task and handles its error itself.
        """
        if self.closed:
            coro.close()
            raise PstrainError(f"{self.name} is closed; it cannot start new work")
        task = asyncio.get_running_loop().create_task(coro, context=context)
        self._tasks.add(task)
        if observed:
            self._observed.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        observed = task in self._observed
        self._observed.discard(task)
        if task.cancelled():
            return
        exc = task.exception()  # also marks it retrieved for an observed task nobody awaited
        if exc is None or observed:
            return
        self.failures += 1
        if self.on_failure is not None:
            self.on_failure(exc)
        else:
            logger.error("%s: background task failed", self.name, exc_info=exc)

    @property
    def tasks(self) -> frozenset[asyncio.Task[Any]]:
        """The tasks still running."""
        return frozenset(self._tasks)

    def __len__(self) -> int:
        return len(self._tasks)

    async def close(self) -> None:
        """Cancel every task and wait until they have all ended; no new task starts after."""
        self.closed = True
        while self._tasks:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def __repr__(self) -> str:
        return f"<TaskOwner {self.name!r} tasks={len(self._tasks)}>"


async def best_effort(step: Awaitable[Any], what: str, log: logging.Logger) -> bool:
    """Await ``step``; if it fails, log that ``what`` failed and return False (a step whose
    failure must not hide the error being handled, such as undoing part of a move)."""
    try:
        await step
        return True
    except Exception as exc:
        log.warning("%s failed: %s", what, exc)
        return False
