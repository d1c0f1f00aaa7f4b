"""A ps's side of moving variables to another ps while training runs (an elastic ps joined
or leaves); ``_formats/placement_map.py`` gives the steps, the coordinator drives them.

On the ps that gives variables away: :meth:`Moves.move_out` copies them (pinned, not
copied until an update writes them) and marks the change clock; :meth:`Moves.finish`
stops serving them, in one step on the loop, and answers with the rows changed since the
mark; :meth:`Moves.end` drops them (or serves them again if the move failed). On the ps
that receives them: :meth:`Moves.install` stages the copies, then applies the changed
rows and serves them. Between the two, each side refuses the variables with
:class:`~pstrain.errors.PlacementChangedError` carrying its newest map, so a client sends
its request where they are now.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..._base.errors import FailedPreconditionError, InvalidArgumentError
from ..._formats.placement_map import (
    EndMove,
    FinishMove,
    InstallVariables,
    MoveOut,
    PlacementMap,
    ReadPlacement,
    SetPlacement,
    VariableCopy,
)
from ..._serving.core import Pinned
from .fencing import Fencing
from .store import VariableRecord, VariableStore

__all__ = ["Moves"]


class Moves:
    """The moves in and out of one ps."""

    def __init__(self, store: VariableStore, fencing: Fencing, max_store_bytes: int) -> None:
        self.store = store
        self.fencing = fencing
        self.max_store_bytes = max_store_bytes
        #: stage -> the keys being moved out (copied, still served) or parked (no longer served)
        self.outgoing: dict[str, list[str]] = {}
        self.parked: dict[str, list[tuple[VariableRecord, str | None]]] = {}
        #: stage -> the copies staged here, not served yet: (copy, its slots)
        self.incoming: dict[str, list[VariableCopy]] = {}

    def routes(self) -> dict[type, Any]:
        return {SetPlacement: self.set_placement, ReadPlacement: self.read_placement,
                MoveOut: self.move_out, FinishMove: self.finish, InstallVariables: self.install,
                EndMove: self.end}

    def set_placement(self, req: SetPlacement) -> dict[str, Any]:
        self._adopt(req.placement)
        return {"version": self.store.placement.version}

    def read_placement(self, _: ReadPlacement) -> dict[str, Any]:
        return {"placement": self.store.placement}

    def _adopt(self, placement: PlacementMap) -> None:
        if placement.version <= self.store.placement.version:
            return
        self.store.placement = placement
        task = self.store.task
        mine = int(task.rsplit(":", 1)[1]) if task.startswith("/job:ps/") else len(placement.ps)
        if mine < len(placement.ps) and not placement.ps[mine]:
            self._retire()

    def _retire(self) -> None:
        """The map says this ps left the job: it was lost, and its variables were put on the
        others from a checkpoint (a partition that healed). It serves none of them from now
        on: a client still routing here by an older map is refused with the new one."""
        slots = {s.name for r in self.store for s in self.store.slots_of(r.name)}
        for name in [r.name for r in self.store if r.name not in slots]:
            self.store.take(name)
            self.store.away[name] = "was replaced on the other ps: it no longer lives on"

    def move_out(self, req: MoveOut) -> Pinned:
        """Step 1: each variable with its slots, as it is now (pinned), and the clock's mark."""
        if req.stage in self.outgoing or req.stage in self.parked:
            raise InvalidArgumentError(f"ps/move_out: stage {req.stage!r} is already in use")
        records = [self.store.get(k) for k in req.keys]  # all or nothing
        copies, releases = [], []
        for record in records:
            for r, slot_of in [(record, None)] + [(s, record.name)
                                                    for s in self.store.slots_of(record.name)]:
                releases.append(r.pin())
                copies.append({"name": r.name, "value": r.array, "trainable": r.trainable,
                               "owner": r.owner, "slot_of": slot_of})
        mark = self.store.clock.mark()
        self.outgoing[req.stage] = list(req.keys)

        def release() -> None:
            for r in releases:
                r()

        return Pinned({"mark": mark, "vars": copies}, release)

    def finish(self, req: FinishMove) -> dict[str, Any]:
        """Step 3, atomic on the loop: stop serving the variables and answer with what
        changed since the mark, and their exactly-once records."""
        keys = self.outgoing.get(req.stage)
        if keys is None or sorted(keys) != sorted(req.keys):
            raise FailedPreconditionError(f"ps/move_finish: no move {req.stage!r} of these "
                                          "variables started here")
        self._adopt(req.placement)
        patches: list[list[Any]] = []
        parked: list[tuple[VariableRecord, str | None]] = []
        for key in keys:
            for i, record in enumerate(self.store.take(key)):
                rows = record.changed_rows(req.mark)
                if rows is None:
                    patches.append([record.name, None, record.array])
                elif rows.size:
                    patches.append([record.name, rows, record.array[rows]])
                parked.append((record, key if i else None))  # the first is the variable
            self.store.away[key] = "moved away from"
        del self.outgoing[req.stage]
        self.parked[req.stage] = parked
        fences, superseded = self.fencing.state()
        return {"patches": patches, "once": self.fencing.records_of(set(keys)),
                "fences": fences, "superseded": superseded}

    def install(self, req: InstallVariables) -> dict[str, Any]:
        """Steps 2 (stage copies) and 4 (apply the changed rows, serve them)."""
        if not req.activate:
            if req.stage in self.incoming:
                raise InvalidArgumentError(f"ps/install: stage {req.stage!r} is already in use")
            for copy in req.vars:
                if not isinstance(copy.value, np.ndarray):
                    raise InvalidArgumentError(f"ps/install: {copy.name!r} carries no array")
                if copy.name in self.store:
                    raise InvalidArgumentError(f"ps/install: {copy.name!r} already exists on "
                                               f"{self.store.task}")
            added = sum(c.value.nbytes for c in req.vars)
            if self.store.nbytes + self.staged_bytes() + added > self.max_store_bytes:
                raise FailedPreconditionError(
                    f"{self.store.task} cannot take {added} bytes more: it holds "
                    f"{self.store.nbytes} of its {self.max_store_bytes} (--max-store-bytes)")
            self.incoming[req.stage] = list(req.vars)
            for copy in req.vars:
                if copy.slot_of is None:
                    self.store.away[copy.name] = "is arriving at"
            return {"staged": len(req.vars)}
        staged = self.incoming.pop(req.stage, None)
        if staged is None:
            raise FailedPreconditionError(f"ps/install: nothing staged as {req.stage!r}")
        # the received arrays are this ps's own (a large body lands in a buffer of its own):
        # kept as they are, not copied (a copy of 1 GiB into fresh pages takes seconds here)
        arrays = {c.name: c.value if c.value.flags.writeable else np.array(c.value) for c in staged}
        for name, rows, values in req.patches:
            if name not in arrays:
                raise InvalidArgumentError(f"ps/install: a patch names {name!r}, not staged")
            try:
                if rows is None:
                    arrays[name] = np.array(values).reshape(arrays[name].shape)
                else:
                    arrays[name][np.asarray(rows)] = values
            except (IndexError, ValueError, TypeError) as exc:  # nothing is served yet
                raise InvalidArgumentError(f"ps/install: a bad patch of {name!r}: {exc}") from None
        for copy in staged:
            self.store.put(copy.name, arrays[copy.name], copy.trainable, slot_of=copy.slot_of)
            record = self.store.get(copy.name)
            record.owner = copy.owner
            self.store.away.pop(copy.name, None)
        self.fencing.adopt(req.once, req.fences, req.superseded)
        if req.placement is not None:
            self._adopt(req.placement)
        return {"installed": len(staged)}

    def end(self, req: EndMove) -> dict[str, Any]:
        """Step 5: drop the parked copies (committed) or serve them again (aborted); on the
        receiving side, aborted: drop what was staged."""
        parked = self.parked.pop(req.stage, None)
        keys = self.outgoing.pop(req.stage, None)
        if parked is not None and not req.commit:
            for record, slot_of in parked:
                self.store.away.pop(record.name, None)
                self.store.put(record.name, record.array, record.trainable, slot_of=slot_of)
                self.store.get(record.name).owner = record.owner
        staged = self.incoming.pop(req.stage, None)
        for copy in staged or ():  # clients may route here by the aborted move's map
            if copy.slot_of is None:
                self.store.away[copy.name] = "moved away from"
        return {"ended": parked is not None or keys is not None or staged is not None}

    def staged_bytes(self) -> int:
        return sum(c.value.nbytes for copies in self.incoming.values() for c in copies)

    def statistics(self) -> dict[str, Any]:
        return {"placement_version": self.store.placement.version,
                "placement_refusals": self.store.refusals,
                "moves_in_progress": len(self.outgoing) + len(self.parked) + len(self.incoming)}

