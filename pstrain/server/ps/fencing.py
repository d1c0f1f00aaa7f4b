"""Who may still write to a ps: fences per coordinator incarnation and worker, the
coordinators a newer one took over from, and the exactly-once operations already applied.

A coordinator that declares a worker lost fences it (``ps/fence``): updates of that
worker's earlier dispatches, for that coordinator, are refused from then on. A
coordinator that takes variables or tables over supersedes their old owner: every update
the old one still sends is refused (a zombie coordinator cannot write). An update sent by
an exactly-once closure is applied once per (key, sequence): a retry gets the first
attempt's reply. What was applied is kept per variable: a variable that moves to another
ps takes its records along (:meth:`Fencing.records_of`), and a retry that finds only some
of its variables applied (they were split between ps differently) applies the rest. For a
dynamic table the record also keeps the part of the table it covered (the shard, or the
slices the ps held then): slices of a table move between ps, and a retry's ids in a part
no record covers are applied, the others not.
"""

from __future__ import annotations

import collections
import functools
import inspect
import itertools
import logging
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, cast

import msgspec
import numpy as np

from ..._base.cluster import Named, named
from ..._base.errors import CancelledError
from ..._base.tags import OP_PREFIX, cause
from ..._formats.messages.operations import (
    ApplyGradients,
    CallVariables,
    Fence,
    OptimizerStep,
    SingleUpdate,
    UpdateVariables,
)
from ..._formats.messages.placement_map import FenceRecord, OnceRecord
from ..._formats.messages.records import FencedReply
from ..._formats.numerics.idhash import in_slices

logger = logging.getLogger(__name__)

#: A handler's reply, and the update it handles.
T = TypeVar("T")
M = TypeVar("M")
#: One optimizer step of an ``opt/apply``: the request's own, or one of its ``more``.
S = TypeVar("S", ApplyGradients, OptimizerStep)
#: The part of a dynamic table an update covered on a ps: ``(slices, owned)`` (its ids in
#: ``shard_of(id, slices)`` in ``owned``), or None: every id sent to it.
Scope = tuple[int, tuple[int, ...]] | None

__all__ = ["ONCE_WINDOW", "SUPERSEDED_WINDOW", "Fencing", "changed"]

#: Exactly-once closures remembered by a ps (their keys, oldest forgotten first).
ONCE_WINDOW = 100_000
#: Operations of code outside exactly-once closures remembered (``op:`` keys): only while
#: a request of theirs may be sent again after its connection dropped (seconds).
OP_WINDOW = 16_384
#: Superseded coordinator incarnations a ps remembers (each a takeover).
SUPERSEDED_WINDOW = 1024


class Fencing:
    """The fences, takeovers and exactly-once keys of one ps (``task``)."""

    def __init__(
        self,
        task: str | Named,
        *,
        scope_of: Callable[[str, Any], Scope] | None = None,
        before_update: Callable[[Any, Any], Callable[[], None] | None] | None = None,
    ) -> None:
        self._name = named(task)  # the ps's name as it is now (a ps that joined is renamed)
        #: (owner, worker) -> the first epoch of that worker's dispatches accepted from that
        #: coordinator incarnation: a new coordinator starts with no fences of its own.
        self.fences: dict[tuple[str | None, int], int] = {}
        #: Coordinator incarnations a newer one took over from (their variables replaced).
        self.superseded: collections.OrderedDict[str, None] = collections.OrderedDict()
        #: closure key -> operation number -> (variables it was applied to here, the reply,
        #: the parts of each table it covered)
        self._done: collections.OrderedDict[str, dict[int, tuple[set[str], Any, dict[str, list[Scope]]]]] = (
            collections.OrderedDict()
        )
        self._ops: collections.OrderedDict[str, dict[int, tuple[set[str], Any, dict[str, list[Scope]]]]] = (
            collections.OrderedDict()
        )  # the same for ``op:`` keys
        #: The part of a table an update of these ids covers here (the ps's tables: its
        #: shard, or the slices of the ids; None: not known).
        self.scope_of: Callable[[str, Any], Scope] = scope_of or (lambda name, ids: None)
        #: Called with the owners each takeover supersedes (what they left half done goes).
        self.on_supersede: list[Callable[[set[str]], None]] = []
        #: Called with an update's ``once`` and the update before it is applied; what it
        #: returns (if anything) once it has been (the ps's before images).
        self.before_update: Callable[[Any, Any], Callable[[], None] | None] = before_update or (
            lambda once, req: None
        )

    @property
    def task(self) -> str:
        return self._name.task

    def fence(self, req: Fence) -> FencedReply:
        """From now on, refuse updates sent for ``owner`` by ``worker``'s dispatches before
        ``epoch`` (that coordinator declared it lost: its closures run elsewhere). A
        superseded coordinator's fence is refused before this (``ParameterServer.route``)."""
        key = (req.owner, req.worker)
        if req.epoch > self.fences.get(key, 0):
            logger.info(
                "%s: worker %d's updates from dispatches before %d refused from now on (cause=%s)",
                self.task,
                req.worker,
                req.epoch,
                cause(req.worker, req.epoch - 1),
            )
        self.fences[key] = max(self.fences.get(key, 0), req.epoch)
        return FencedReply(fenced=self.fences[key])

    def supersede(self, owners: set[str | None], by: str | None) -> None:
        """A coordinator ``by`` took over variables or tables of ``owners``: from now on
        their updates are refused, and their fences are dropped."""
        gone = {owner for owner in owners - {None, by} if owner is not None}
        for owner in gone:
            self.superseded[owner] = None
            self.superseded.move_to_end(owner)
            while len(self.superseded) > SUPERSEDED_WINDOW:
                self.superseded.popitem(last=False)
            for key in [k for k in self.fences if k[0] == owner]:
                del self.fences[key]
        if gone:
            for listener in self.on_supersede:
                listener(gone)

    def refuse_superseded(self, owner: str | None, what: str) -> None:
        if owner is not None and owner in self.superseded:
            raise CancelledError(
                f"{self.task} refused {what} from coordinator {owner[:8]}: a newer coordinator "
                "took this ps over (the old one must stop; its work is the new one's now)"
            )

    def owned(self, fn: Callable[..., T], what: str) -> Callable[..., T]:
        """``fn`` (a handler, plain or async) refusing first a request sent for a coordinator
        a newer one took this ps over from: a zombie coordinator creates, restores or moves
        nothing here (nor takes the ps back by creating its variables again)."""
        if inspect.iscoroutinefunction(fn):

            async def handler(req: Any, *rest: Any) -> Any:
                self.refuse_superseded(req.owner, what)
                return await fn(req, *rest)
        else:

            def handler(req: Any, *rest: Any) -> Any:  # type: ignore[misc]
                self.refuse_superseded(req.owner, what)
                return fn(req, *rest)

        return cast(Callable[..., T], functools.wraps(fn)(handler))  # plain or async, as fn

    def guarded(self, fn: Callable[[M], T], once: bool = True) -> Callable[[M], T]:
        """``fn`` behind the fence, and, with ``once``, applied once per exactly-once key and
        sequence number (a retry gets the first attempt's reply)."""

        def handler(req: Any) -> T:
            self.refuse_superseded(req.owner, "an update")
            fence = req.fence
            if fence is not None and fence[1] < self.fences.get((req.owner, fence[0]), 0):
                logger.info("%s: refused an update of a fenced dispatch (cause=%s)", self.task, cause(*fence))
                raise CancelledError(
                    f"{self.task} refused an update of worker {fence[0]}'s dispatch {fence[1]}: the "
                    f"coordinator declared that worker lost (its work runs elsewhere), or gave "
                    f"up on that dispatch's closures after an error (cause={cause(*fence)})"
                )
            key = req.once if once else None
            if key is None:
                return _applied(fn, req, self.before_update(None, req))
            book = self._book(key[0])
            done = book.get(key[0], {}).get(key[1])
            if done is not None:
                book.move_to_end(key[0])
                req = _narrowed(req, done[0], done[2], done[1])  # the rest moved here since that attempt
                if not _names(req):
                    return cast(T, done[1])  # applied by an earlier attempt of this closure
            reply = _applied(fn, req, self.before_update(key, req))
            tables = req.table_gradients() if isinstance(req, ApplyGradients) else ()
            self._record(
                key[0], key[1], _names(req), reply, {t[0]: [self.scope_of(t[0], t[1])] for t in tables}
            )
            return reply

        handler.__name__ = getattr(fn, "__name__", "update")
        handler.__wrapped__ = fn  # type: ignore[attr-defined]  # (its declared reply, for tests)
        return handler

    def _record(
        self, key: str, seq: int, names: Iterable[str], reply: Any, scopes: dict[str, list[Scope]]
    ) -> None:
        book = self._book(key)
        entry = book.setdefault(key, {})
        applied = entry.get(seq)
        if applied is None:
            entry[seq] = (set(names), reply, scopes)
        else:
            applied[0].update(names)
            for table, parts in scopes.items():
                applied[2].setdefault(table, []).extend(parts)
        book.move_to_end(key)
        while len(book) > (OP_WINDOW if book is self._ops else ONCE_WINDOW):
            book.popitem(last=False)

    def _book(self, key: str) -> collections.OrderedDict[str, Any]:
        return self._ops if key.startswith(OP_PREFIX) else self._done

    def records_of(self, names: set[str]) -> list[OnceRecord]:
        """The exactly-once records of variables and tables ``names`` (a move takes them
        along): ``[closure key, operation, [names], reply, {table: [part covered]}]`` (lists
        on the wire, as the declared tuples are)."""
        out = []
        for key, entry in itertools.chain(self._done.items(), self._ops.items()):
            for seq, (applied, reply, scopes) in entry.items():
                mine = applied & names
                if mine:
                    parts = {
                        t: [list(p) if p is not None else None for p in ps]
                        for t, ps in scopes.items()
                        if t in mine
                    }
                    out.append([key, seq, sorted(mine), reply, parts])
        return cast(list[OnceRecord], out)

    def adopt(self, records: list[OnceRecord], fences: list[FenceRecord], superseded: list[str]) -> None:
        """Take over what another ps knew of the variables moved here: their exactly-once
        records, and the fences and takeovers (the later of each). The records arrive
        checked (``InstallVariables``): nothing here can fail half-way."""
        for key, seq, names, reply, parts in records:
            scopes = {
                t: [(p[0], tuple(p[1])) if p is not None else None for p in ps] for t, ps in parts.items()
            }
            self._record(key, seq, names, reply, scopes)
        for owner, worker, epoch in fences:
            self.fences[owner, worker] = max(self.fences.get((owner, worker), 0), epoch)
        self.supersede(set(superseded), None)

    def state(self) -> tuple[list[FenceRecord], list[str]]:
        """The fences (``[owner, worker, epoch]``) and superseded owners, to pass along."""
        return (
            cast(list[FenceRecord], [[o, w, e] for (o, w), e in self.fences.items()]),
            list(self.superseded),
        )


def _applied(fn: Callable[[Any], T], req: Any, then: Callable[[], None] | None) -> T:
    reply = fn(req)
    if then is not None:
        then()
    return reply


def changed(req: Any) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """What an update changes: its variables, each with its rows (None: all of it), and its
    dynamic tables, each with its ids."""
    if isinstance(req, ApplyGradients):
        variables: list[tuple[str, Any]] = []
        for step in req.steps():
            variables += [(name, rows) for name, rows, _ in step.grads]
            variables += [(counter, None) for counter in (step.iterations, step.mirror) if counter]
        return variables, [(name, ids) for name, ids, _ in req.table_gradients()]
    if isinstance(req, UpdateVariables):
        return [(u.name, u.indices if u.op.rows else None) for u in req.updates], []
    if isinstance(req, SingleUpdate):
        return [(req.name, req.indices if req.kind.rows else None)], []
    if isinstance(req, CallVariables):  # any of them, whole
        return [(name, None) for name in req.vars], []
    return [], []


def _names(req: Any) -> list[str]:
    """The variables (and tables) an update names: what its exactly-once record is kept by
    (none: nothing is left of it to apply)."""
    if req is None:
        return []
    if not isinstance(req, (ApplyGradients, UpdateVariables, SingleUpdate, CallVariables)):
        return [type(req).__name__]
    variables, tables = changed(req)
    return list(dict.fromkeys([name for name, _ in variables] + [name for name, _ in tables]))


def _narrowed(req: Any, applied: set[str], scopes: dict[str, list[Scope]], reply: Any = None) -> Any:
    """``req`` without the parts already applied: to the variables of ``applied``, and to
    the ids of each table in the parts ``scopes`` covered. An optimizer step whose counter
    was counted by the earlier attempt (``reply``: that attempt's) applies the rest at the
    step counted then, not at a step it would count again."""
    if isinstance(req, ApplyGradients):
        counted = [getattr(reply, "t", None), *(getattr(reply, "more", None) or ())]
        more = [
            _narrowed_step(step, applied, scopes, counted[i] if i < len(counted) else None)
            for i, step in enumerate(req.more or (), 1)
        ]
        return _narrowed_step(req, applied, scopes, counted[0], more=more or None)
    if isinstance(req, UpdateVariables):
        return msgspec.structs.replace(req, updates=[u for u in req.updates if u.name not in applied])
    return None if set(_names(req)) <= applied else req


def _narrowed_step(
    step: S, applied: set[str], scopes: dict[str, list[Scope]], counted: Any, **more: Any
) -> S:
    """One optimizer step of an ``opt/apply`` without the parts already applied, at the
    step ``counted`` by the earlier attempt if that attempt counted its counter."""
    at = step.t
    if at is None and step.iterations in applied and isinstance(counted, int):
        at = counted
    tables = [
        left
        for t in step.tables or ()  # (a record from before scopes covers all)
        if (left := _uncovered(t, scopes.get(t[0], [None] if t[0] in applied else []))) is not None
    ]
    return msgspec.structs.replace(
        step,
        grads=[g for g in step.grads if g[0] not in applied],
        tables=tables or None,
        iterations=None if step.iterations in applied else step.iterations,
        mirror=None if step.mirror in applied else step.mirror,
        t=at,
        **more,
    )


def _uncovered(entry: Any, scopes: list[Scope]) -> Any:
    """A table's ``[name, ids, values]`` without the ids of the parts ``scopes`` covered."""
    if not scopes:
        return entry
    name, ids, values = entry
    ids = np.asarray(ids)
    done = np.zeros(ids.size, bool)
    for scope in scopes:
        if scope is None:
            return None
        done |= in_slices(ids.astype(np.int64, copy=False), scope[0], list(scope[1]))
    if bool(np.all(done)):
        return None
    return [name, ids[~done], np.asarray(values)[~done]]
