"""Ctrl-C on the coordinator: no closure is sent any more and new ones are refused, those
in flight get a few seconds to finish (the drain hook of :mod:`pstrain._transport.interrupt`,
which ``pstrain.run`` runs on SIGINT); once what they did is kept (a last delta), the
queued ones are cancelled (its stop hook)."""

from __future__ import annotations

import asyncio
import weakref
from typing import Any, Protocol

from .._transport.interrupt import DRAIN_HOOKS, STOP_HOOKS
from .scheduling import ClosureQueue

__all__ = ["INTERRUPTED", "track"]


class ClusterCoordinator(Protocol):  # what this module uses of one (no import: no cycle)
    queue: ClosureQueue
    closed: bool
    interrupted: str | None
    resources: Any


#: What the closures cancelled by Ctrl-C, and a ``schedule`` after it, raise.
INTERRUPTED = "The program was interrupted (Ctrl-C): the closure was not run."

_live: weakref.WeakSet[ClusterCoordinator] = weakref.WeakSet()


def track(coordinator: ClusterCoordinator) -> None:
    """``coordinator`` finishes its steps when its program is interrupted."""
    _live.add(coordinator)


async def _interrupt(coordinator: ClusterCoordinator, grace_s: float) -> tuple[int, int, int]:
    """(finished, to cancel, abandoned) closures of ``coordinator``. Nothing new is sent
    while those in flight finish, and ``schedule`` refuses new ones from then on; the
    program, awaiting its closures, goes on meanwhile: it must not unwind, stopping its
    cluster, before they are done and kept (``_stop`` cancels the rest after that)."""
    queue = coordinator.queue
    queue.paused = True
    running = queue.in_flight
    await queue.wait_drained(grace_s)
    left = queue.in_flight
    coordinator.interrupted = INTERRUPTED
    _stopping.add(coordinator)
    return running - left, queue.waiting, left


async def _drain(grace_s: float) -> str | None:
    loop = asyncio.get_running_loop()
    mine = [c for c in list(_live) if not c.closed and c.resources.loop is loop]
    if not mine:
        return None
    counts = await asyncio.gather(*(_interrupt(c, grace_s) for c in mine))
    finished, cancelled, left = (sum(c[i] for c in counts) for i in range(3))
    said = f"{finished} step(s) in flight finished, {cancelled} queued step(s) cancelled"
    return said + (f", {left} still running abandoned" if left else "")


def _stop() -> None:
    """The queued closures of the coordinators drained are cancelled (what was done is kept)."""
    while _stopping:
        _stopping.pop().queue.cancel_queued(INTERRUPTED)


_stopping: weakref.WeakSet[ClusterCoordinator] = weakref.WeakSet()
DRAIN_HOOKS.append(_drain)
STOP_HOOKS.append(_stop)
