"""Who may still write to a ps: fences per coordinator incarnation and worker, the
coordinators a newer one took over from, and the exactly-once operations already applied.

A coordinator that declares a worker lost fences it (``ps/fence``): updates of that
worker's earlier dispatches, for that coordinator, are refused from then on. A
coordinator that takes variables or tables over supersedes their old owner: every update
the old one still sends is refused (a zombie coordinator cannot write). An update sent by
an exactly-once closure is applied once per (key, sequence): a retry gets the first
attempt's reply. What was applied is kept per variable: a variable that moves to another
ps takes its records along (:meth:`Fencing.records_of`), and a retry that finds only some
of its variables applied (they were split between ps differently) applies the rest.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from ..._base.errors import CancelledError
from ..._formats.operations import ApplyGradients, Fence, SingleUpdate, UpdateVariables

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
        #: closure key -> operation number -> (variables it was applied to here, the reply)
        self._done: collections.OrderedDict[str, dict[int, tuple[set[str], Any]]] = \
            collections.OrderedDict()

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
            if key is None:
                return fn(req)
            names = _names(req)
            done = self._done.get(key[0], {}).get(key[1])
            if done is not None:
                self._done.move_to_end(key[0])
                rest = [n for n in names if n not in done[0]]
                if not rest:
                    return done[1]  # applied by an earlier attempt of this closure
                req = _narrowed(req, done[0])  # the rest moved here since that attempt
            reply = fn(req)
            self._record(key[0], key[1], names, reply)
            return reply

        handler.__name__ = getattr(fn, "__name__", "update")
        return handler

    def _record(self, key: str, seq: int, names: Iterable[str], reply: Any) -> None:
        entry = self._done.setdefault(key, {})
        applied = entry.get(seq)
        if applied is None:
            entry[seq] = (set(names), reply)
        else:
            applied[0].update(names)
        self._done.move_to_end(key)
        while len(self._done) > ONCE_WINDOW:
            self._done.popitem(last=False)

    def records_of(self, names: set[str]) -> list[list[Any]]:
        """The exactly-once records of variables ``names`` (a move takes them along):
        ``[closure key, operation, [variables], reply]``."""
        out = []
        for key, entry in self._done.items():
            for seq, (applied, reply) in entry.items():
                mine = applied & names
                if mine:
                    out.append([key, seq, sorted(mine), reply])
        return out

    def adopt(self, records: list[list[Any]], fences: list[list[Any]], superseded: list[str]) -> None:
        """Take over what another ps knew of the variables moved here: their exactly-once
        records, and the fences and takeovers (the later of each)."""
        for key, seq, names, reply in records:
            self._record(str(key), int(seq), [str(n) for n in names], reply)
        for owner, worker, epoch in fences:
            k = (owner, int(worker))
            self.fences[k] = max(self.fences.get(k, 0), int(epoch))
        self.supersede(set(superseded), None)

    def state(self) -> tuple[list[list[Any]], list[str]]:
        """The fences (``[owner, worker, epoch]``) and superseded owners, to pass along."""
        return ([[o, w, e] for (o, w), e in self.fences.items()], list(self.superseded))


def _names(req: Any) -> list[str]:
    """The variables (and tables) an update names: what its exactly-once record is kept by."""
    if isinstance(req, ApplyGradients):
        names = [g[0] for g in req.grads] + [t[0] for t in req.tables or ()]
        return names + [req.iterations] if req.iterations else names
    if isinstance(req, UpdateVariables):
        return list(dict.fromkeys(u.name for u in req.updates))
    if isinstance(req, SingleUpdate):
        return [req.name]
    return [getattr(req, "op", "request")]


def _narrowed(req: Any, applied: set[str]) -> Any:
    """``req`` without the parts already applied (to the variables of ``applied``)."""
    if isinstance(req, ApplyGradients):
        return msgspec.structs.replace(
            req, grads=[g for g in req.grads if g[0] not in applied],
            tables=[t for t in req.tables or () if t[0] not in applied] or None,
            iterations=None if req.iterations in applied else req.iterations)
    if isinstance(req, UpdateVariables):
        return msgspec.structs.replace(req, updates=[u for u in req.updates if u.name not in applied])
    return req
