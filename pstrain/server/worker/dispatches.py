"""One dispatch of a coordinator at a time on a worker: a newer epoch ends the older ones.

When the coordinator declares a worker lost with closures in flight, it fences that
dispatch (its *epoch*) off every ps and requeues its closures; once the worker answers
again it sends it closures under a newer epoch. The worker may not have died: it was
cut off, or too slow to answer a health check. Its old closures may then still be
running, or not even started. Their updates are refused by every ps, but they share
this process with the new ones (a ``torch.nn.Module`` a step pulls into and computes
gradients in, an iterator, any state the user's closure keeps), and the same closure,
rerun here, would run twice at once. So a batch of a newer epoch (per coordinator
incarnation, the *owner*, and worker slot):

* marks every open batch of an older epoch *abandoned*: its closures not yet started
  never start, those running are cancelled (``async def`` closures at their next
  ``await``; a plain ``def`` closure runs to its end);
* starts once those batches have ended, or after ``grace_s`` (then with a warning
  naming what still runs: a closure stuck in code that never awaits);
* and a batch that arrives with an epoch older than one seen here is answered
  ``CANCELLED`` without running (its dispatch is fenced everywhere already).

A batch whose connection ends is abandoned too: the coordinator put its closures back
in its queue (it found the worker unreachable), or it died (SIGKILLed, its successor
takes the ps over and refuses its updates). Every new batch, of any coordinator, starts
once the abandoned ones have ended (or ``grace_s`` passed).

Batches without an epoch (a coordinator's own calls outside its dispatch) are never
abandoned and never wait.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..._base.cluster import Named, named
from ..._base.tags import cause
from .closures import Batch

logger = logging.getLogger(__name__)

__all__ = ["Dispatches"]

Key = tuple[str | None, int]  # (owner, worker slot)


class Dispatches:
    """The newest epoch seen per (owner, slot) and the batches still open (serving loop)."""

    def __init__(self, task: str | Named, grace_s: float = 10.0) -> None:
        self._name = named(task)  # the worker's name as it is now (a joined worker takes a slot)
        self.grace_s = grace_s
        self.newest: dict[Key, int] = {}
        self.open: dict[Batch, Key] = {}

    @property
    def task(self) -> str:
        return self._name.task

    def arrive(self, batch: Batch, key: Key) -> list[Batch]:
        """Record ``batch`` (with ``batch.epoch`` set); return the open batches it abandons.
        Call on arrival, before anything is awaited: an older batch still loading its
        functions then finds itself abandoned before it starts."""
        epoch = batch.epoch
        assert epoch is not None
        if epoch < self.newest.get(key, -1):
            batch.abandoned = True
            return []
        self.newest[key] = epoch
        older = [
            b
            for b, k in self.open.items()
            if k == key and not b.abandoned and b.epoch is not None and b.epoch < epoch
        ]
        for b in older:
            b.abandoned = True
            logger.info(
                "%s: dispatch %d of the coordinator ends dispatch %d's closures (cause=%s)",
                self.task,
                epoch,
                b.epoch,
                cause(key[1], b.epoch or 0),
            )
        older += [b for b in self.open if b.abandoned and b not in older and not b.done.done()]
        self.open[batch] = key
        return older

    def connection_ended(self, connection: Any, loop: asyncio.AbstractEventLoop | None) -> None:
        """The batches that came over ``connection`` are abandoned: their closures not yet
        started never start, those running are cancelled (on the closure ``loop``)."""
        gone = [b for b in self.open if not b.abandoned and getattr(b.emit, "connection", None) is connection]
        for b in gone:
            b.abandoned = True
        if gone and loop is not None:
            loop.call_soon_threadsafe(_cancel, gone)

    def close(self, batch: Batch) -> None:
        """``batch`` is answered: a newer one waiting for it goes on (also when it never
        started: abandoned while its functions loaded, or refused)."""
        self.open.pop(batch, None)
        if not batch.done.done():
            batch.done.cancel()

    async def wait_ended(self, older: list[Batch], loop: asyncio.AbstractEventLoop | None) -> None:
        """Cancel the closures of ``older`` (their tasks run on the closure ``loop``) and
        wait, at most ``grace_s``, until they have ended."""
        if not older:
            return
        if loop is not None:
            loop.call_soon_threadsafe(_cancel, older)
        pending: set[asyncio.Future[Any]] = {b.done for b in older if not b.done.done()}
        if not pending:
            return
        _, still = await asyncio.wait(pending, timeout=self.grace_s)
        if still:
            logger.warning(
                "%s: %d closure(s) of an earlier dispatch, abandoned by the coordinator, still "
                "run after %.0f s (code that never awaits?); the new dispatch starts beside them",
                self.task,
                sum(b.remaining for b in older if b.done in still),
                self.grace_s,
            )


def _cancel(batches: list[Batch]) -> None:
    for batch in batches:
        for task in list(batch.tasks):
            task.cancel()
