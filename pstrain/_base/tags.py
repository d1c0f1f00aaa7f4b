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
* ``once = [closure key, n]``: the closure's n-th update to that ps; a ps
  applies a (key, n) once, so an exactly-once closure rerun after its worker
  died does not apply its updates twice.

>>> update_tags("/job:ps/replica:0/task:0")   # outside a closure: nothing
{}
"""

from __future__ import annotations

import contextvars
from typing import Any

__all__ = ["set_dispatch", "update_tags"]

#: ``(owner, worker index, epoch)`` of the closure running here: the ps refuses updates
#: of epochs the coordinator has superseded (the worker was declared lost meanwhile), and
#: of owners a newer coordinator has superseded.
_fence: contextvars.ContextVar[tuple[str | None, int, int] | None] = contextvars.ContextVar(
    "pstrain_fence", default=None)
#: An exactly-once closure's key and its per-ps update counters.
_once: contextvars.ContextVar[tuple[str, dict[str, int]] | None] = contextvars.ContextVar(
    "pstrain_once", default=None)

def set_dispatch(fence: tuple[str | None, int, int] | None, once_key: str | None) -> None:
    """Called by a worker in a closure's own context, before the closure runs."""
    _fence.set(fence)
    _once.set((once_key, {}) if once_key else None)


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
        counters[task] = seq = counters.get(task, 0) + 1
        tags["once"] = [key, seq]
    return tags


