"""PlacementLock: moves of variables between ps alone, checkpoint saves together.

A move between ps (an elastic ps joining or leaving, a lost ps replaced) must not
run while a save reads the variables it moves, nor a restore while anything else
does; saves need not keep each other out: a compaction writes a full checkpoint
for seconds, and the deltas it must not hold up (each bounds what a SIGKILL
loses) go on meanwhile. So the lock has two modes: ``async with lock`` takes it
alone (a move, a restore), ``async with lock.shared()`` with other sharers (a
save, full or delta). It is fair: whoever asks first gets it first, so a move
waits for the saves under way, and saves asked for after it wait for the move.

>>> import asyncio
>>> async def main():
...     lock = PlacementLock()
...     async with lock.shared(), lock.shared():  # two saves at once
...         busy = lock.locked()
...     async with lock:
...         alone = lock.locked()
...     return busy, alone, lock.locked()
>>> asyncio.run(main())
(True, True, False)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator
from typing import Any

__all__ = ["PlacementLock"]


class PlacementLock:
    """Held alone by a move or restore, shared by saves (module docstring)."""

    def __init__(self) -> None:
        self._sharers = 0
        self._alone = False
        self._waiting: collections.deque[tuple[bool, asyncio.Future[None]]] = collections.deque()

    def locked(self) -> bool:
        """Held, in either mode."""
        return self._alone or self._sharers > 0

    async def __aenter__(self) -> None:
        await self._acquire(alone=True)

    async def __aexit__(self, *exc: Any) -> None:
        self._alone = False
        self._wake()

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        """Held with other sharers (a save): ``async with lock.shared(): ...``."""
        await self._acquire(alone=False)
        try:
            yield
        finally:
            self._sharers -= 1
            self._wake()

    def _free_for(self, alone: bool) -> bool:
        return not self._alone and (not alone or self._sharers == 0)

    def _grant(self, alone: bool) -> None:
        if alone:
            self._alone = True
        else:
            self._sharers += 1

    async def _acquire(self, alone: bool) -> None:
        if not self._waiting and self._free_for(alone):
            self._grant(alone)
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (alone, waiter)
        self._waiting.append(entry)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # granted as it was cancelled: give back
                if alone:
                    self._alone = False
                else:
                    self._sharers -= 1
            else:
                self._waiting.remove(entry)
            self._wake()
            raise

    def _wake(self) -> None:
        """Grant the lock to the waiters at the head of the queue that it is free for."""
        while self._waiting:
            alone, waiter = self._waiting[0]
            if waiter.done():  # cancelled, not yet taken out
                self._waiting.popleft()
                continue
            if not self._free_for(alone):
                return
            self._waiting.popleft()
            self._grant(alone)
            waiter.set_result(None)
