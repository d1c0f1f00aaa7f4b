"""A worker's training steps read what its earlier steps wrote, even with several closures
in flight.

TensorFlow's coordinator runs one closure at a time on a worker, so a step's reads always
follow that worker's previous update. pstrain runs up to ``max_inflight_per_worker``
closures at once (one computes while another's batch and bags are built); without an order
a step could read rows before its own worker's previous update reached them, which on W8
raised the held-out log loss (``docs/benchmarks.md``).

The order, per event loop (a worker's closures share one):

* a training step's first table read (:func:`read_in_order`, called by
  :meth:`EmbeddingCollection.gather <pstrain.EmbeddingCollection.gather>` after its bags are
  built, before anything is sent) takes the next place in line and waits until the step
  before it in line has sent its update;
* a step leaves its place once :meth:`Optimizer.apply_gradients
  <pstrain.optimizers.Optimizer.apply_gradients>` has written its request to every ps
  (:func:`updated`): a ps serves one connection's requests in order, and an update whose
  rows are all in RAM is applied before the next request is read (a collection's tables
  with optimizers of their own update in the same requests: ``apply_together``). A step
  also leaves when its update fails, or when the task that took the place ends, whatever
  way (an error, a cancel, a step that never updates).

The place is kept in a context variable, so tasks a step starts (``asyncio.gather``) read
and update as that step, and never wait on their own step. Evaluation reads
(``training=False``) take no place and wait for nothing.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import weakref

__all__ = ["read_in_order", "updated"]


class _Place:
    """A step's place in line: ``done`` is set when the step has updated (or ended)."""

    __slots__ = ("done",)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.done: asyncio.Future[None] = loop.create_future()

    def leave(self) -> None:
        if not self.done.done():
            self.done.set_result(None)


#: The last place taken on each loop (the next step waits on it).
_last: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Place] = weakref.WeakKeyDictionary()
#: The running step's place (inherited by the tasks it starts).
_mine: contextvars.ContextVar[_Place | None] = contextvars.ContextVar("pstrain_step_place", default=None)
#: Each task's latest place, which it leaves when it ends (one callback per task, however
#: many steps it runs: a coordinator's main task may run millions).
_held: weakref.WeakKeyDictionary[asyncio.Task[object], list[_Place]] = weakref.WeakKeyDictionary()


async def read_in_order() -> None:
    """Take this step's place in line and wait for the step before it. A step already in
    line (a second read, or a task it started) waits for nothing; a task whose step has
    updated starts a new one (a closure that runs several steps)."""
    mine = _mine.get()
    if mine is not None and not mine.done.done():
        return
    loop = asyncio.get_running_loop()
    place = _Place(loop)
    before = _last.get(loop)
    _last[loop] = place
    _mine.set(place)
    task = asyncio.current_task()
    if task is not None:
        held = _held.get(task)
        if held is None:
            held = _held[task] = [place]
            task.add_done_callback(functools.partial(_leave_held, held))
        else:
            held[0] = place
    if before is not None and not before.done.done():
        await asyncio.shield(before.done)  # (a cancelled wait leaves the step before in line)


def _leave_held(held: list[_Place], _: object) -> None:
    held[0].leave()


def updated() -> None:
    """The running step's update is on its way to every ps (or failed): the next step in
    line may read."""
    place = _mine.get()
    if place is not None:
        place.leave()
