"""Who may still write to a ps: fences per coordinator incarnation and worker, the
coordinators a newer one took over from, and the exactly-once keys already applied.

A coordinator that declares a worker lost fences it (``ps/fence``): updates of that
worker's earlier dispatches, for that coordinator, are refused from then on. A
coordinator that takes variables or tables over supersedes their old owner: every update
the old one still sends is refused (a zombie coordinator cannot write). An update sent by
an exactly-once closure is applied once per (key, sequence): a retry gets the first
attempt's reply.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from ..._base.errors import CancelledError
from ..._formats.operations import Fence

__all__ = ["ONCE_WINDOW", "SUPERSEDED_WINDOW", "Fencing"]

#: Exactly-once closures remembered by a ps (their keys, oldest forgotten first).
ONCE_WINDOW = 100_000
#: Superseded coordinator incarnations a ps remembers (each a takeover).
SUPERSEDED_WINDOW = 1024


class Fencing:
    """The fences, takeovers and exactly-once keys of one ps (``task``)."""

    def __init__(self, task: str) -> None:
        self.task = task
        #: (owner, worker) -> the first epoch of that worker's dispatches accepted from that
        #: coordinator incarnation: a new coordinator starts with no fences of its own.
        self.fences: dict[tuple[str | None, int], int] = {}
        #: Coordinator incarnations a newer one took over from (their variables replaced).
        self.superseded: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._done: collections.OrderedDict[str, dict[int, Any]] = collections.OrderedDict()

    def fence(self, req: Fence) -> dict[str, Any]:
        """From now on, refuse updates sent for ``owner`` by ``worker``'s dispatches before
        ``epoch`` (that coordinator declared it lost: its closures run elsewhere)."""
        self.refuse_superseded(req.owner, f"a fence of worker {req.worker}")
        key = (req.owner, req.worker)
        self.fences[key] = max(self.fences.get(key, 0), req.epoch)
        return {"fenced": self.fences[key]}

    def supersede(self, owners: set[str | None], by: str | None) -> None:
        """A coordinator ``by`` took over variables or tables of ``owners``: from now on
        their updates are refused, and their fences are dropped."""
        for owner in owners - {None, by}:
            assert owner is not None
            self.superseded[owner] = None
            self.superseded.move_to_end(owner)
            while len(self.superseded) > SUPERSEDED_WINDOW:
                self.superseded.popitem(last=False)
            for key in [k for k in self.fences if k[0] == owner]:
                del self.fences[key]

    def refuse_superseded(self, owner: str | None, what: str) -> None:
        if owner is not None and owner in self.superseded:
            raise CancelledError(
                f"{self.task} refused {what} from coordinator {owner[:8]}: a newer coordinator "
                "took this ps over (the old one must stop; its work is the new one's now)")

    def guarded(self, fn: Callable[[Any], dict[str, Any]], once: bool = True
                 ) -> Callable[[Any], dict[str, Any]]:
        """``fn`` behind the fence, and, with ``once``, applied once per exactly-once key and
        sequence number (a retry gets the first attempt's reply)."""
        def handler(req: Any) -> dict[str, Any]:
            self.refuse_superseded(req.owner, "an update")
            fence = req.fence
            if fence is not None and fence[1] < self.fences.get((req.owner, fence[0]), 0):
                raise CancelledError(
                    f"{self.task} refused an update of worker {fence[0]}'s dispatch {fence[1]}: the "
                    f"coordinator declared that worker lost (its work runs elsewhere)")
            key = req.once if once else None
            if key is not None:
                done = self._done.get(key[0])
                if done is not None and key[1] in done:
                    self._done.move_to_end(key[0])
                    return done[key[1]]  # applied by an earlier attempt of this closure
            reply = fn(req)
            if key is not None:
                self._done.setdefault(key[0], {})[key[1]] = reply
                self._done.move_to_end(key[0])
                while len(self._done) > ONCE_WINDOW:
                    self._done.popitem(last=False)
            return reply

        handler.__name__ = getattr(fn, "__name__", "update")
        return handler
