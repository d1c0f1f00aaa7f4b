"""The ps's side of delta checkpoints: what changed since a mark, written to one file.

Every change on a ps is stamped with the epoch of its
:class:`~pstrain.server.ps.store.ChangeClock` (a variable's rows in
``VariableRecord.row_epochs`` or its whole array in ``changed``; a table's rows
in ``DynamicTable.epochs``, its evictions in a log). ``delta/mark`` ends an
epoch and returns its number: a save that starts after a mark ``m`` holds every
change stamped up to ``m``. ``delta/save`` since ``m`` ends the epoch and takes,
in one step on the serving loop (no ``await``: nothing changes meanwhile), a copy
of everything stamped after ``m``, then writes the copy to a new file under the
checkpoint root on the save thread while training goes on. A large variable's
changed rows are not even found on the loop: the save thread finds them (a pass
over the row stamps) and gathers them, through a snapshot of the rows stamped
between ``m`` and the mark just taken (:class:`~.snapshots.ChangedRows`), so what
a delta costs the serving loop does not grow with the rows a ps holds. A dynamic
table's changed rows are found on the loop (one pass over its stamps) and gathered
on the save thread, through snapshots of those rows of its ids, rows and slots:

* of a variable under file key ``k``: ``v:<k>:rows`` (the rows changed) and
  ``v:<k>:idx`` (their row numbers in this ps's part), or ``v:<k>:rows``
  alone, the whole value;
* of a table with prefix ``p``: ``<p>:ids``, ``<p>:rows``, ``<p>:slot:<key>``
  and ``<p>:init:<key>`` for its changed rows, and ``<p>:removed``, the ids
  evicted since and not admitted again.

A mark is only good on the ps that gave it: a delta asked of another
incarnation (the ps restarted) or of a table whose evictions since the mark were
not all kept is refused with :class:`~pstrain.errors.FailedPreconditionError`,
nothing written, and the coordinator writes a full checkpoint instead. The
coordinator only moves its mark on once the delta's index is written, so a
delta that fails on one ps is simply taken again, larger, by the next one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...._base.errors import FailedPreconditionError, NotFoundError
from ...._formats.files.direct_writes import ahead_for
from ...._formats.files.tensor_files import whole
from ...._formats.messages.checkpoint_operations import (
    DeltaReply,
    HurryDeltas,
    MarkReply,
    SaveDelta,
    TakeMark,
)
from ...._formats.messages.records import HurriedReply
from ...._serving.core import Router
from ..store import Snapshot, VariableRecord
from ..tables.dynamic_table import DynamicTable
from ..tables.handlers import shard_tensors
from .feed import TableFeed
from .saves import CheckpointFiles
from .snapshots import ChangedRows

__all__ = ["Deltas"]

Tensors = list[tuple[str, np.dtype, tuple[int, ...], Any]]


class Deltas:
    """Marks and delta files of one ps."""

    def __init__(self, checkpoints: CheckpointFiles, feed: TableFeed, incarnation: str) -> None:
        self.checkpoints = checkpoints
        self.store = checkpoints.store
        self.feed = feed  # told where each table's deltas go
        self.tables: dict[str, DynamicTable] = feed.tables
        self.incarnation = incarnation

    def install(self, route: Router) -> None:
        """Route the delta operations to their handlers here."""
        route(TakeMark, self.take_mark)
        route(SaveDelta, self.save_delta)
        route(HurryDeltas, self.hurry)

    def hurry(self, req: HurryDeltas) -> HurriedReply:
        return HurriedReply(hurried=self.checkpoints.hurry())

    def take_mark(self, req: TakeMark) -> MarkReply:
        return MarkReply(incarnation=self.incarnation, mark=self.store.clock.mark())

    async def save_delta(self, req: SaveDelta) -> DeltaReply:
        if req.incarnation != self.incarnation:
            raise FailedPreconditionError(
                f"delta/save: {self.store.task} is incarnation {self.incarnation}, not "
                f"{req.incarnation} (it restarted since the save this delta would extend): "
                "write a full checkpoint"
            )
        records = {key: self.store.get(name) for key, name in req.variables.items()}
        tables = {}
        for name, spec in req.tables.items():
            table = self.tables.get(name)
            if table is None:
                raise NotFoundError(f"delta/save: dynamic table {name!r} not found on {self.store.task}")
            if req.since < table.removed.since:
                raise FailedPreconditionError(
                    f"delta/save: table {name!r} on {self.store.task} did not keep its "
                    f"evictions since mark {req.since} (more than it keeps, or it was "
                    "restored since): write a full checkpoint"
                )
            tables[name] = (table, spec)
        # -- one step: end the epoch, copy what changed (no await until the write) --------------
        mark = self.store.clock.mark()
        tensors: Tensors = []
        snaps: list[tuple[VariableRecord, Snapshot]] = []
        found: list[tuple[str, ChangedRows]] = []  # rows the save thread finds, then writes
        rows = removed = 0
        written: list[str] = []
        written_whole: list[str] = []
        for key, record in records.items():
            arr = record.array
            if record.changed > req.since or record.row_epochs is None:
                if record.changed <= req.since:
                    continue  # a small array, unchanged
                tensors.append(whole(f"v:{key}:rows", arr.copy()))
                written.append(key)
                written_whole.append(key)
                if arr.ndim:
                    tensors.append(whole(f"v:{key}:idx", np.arange(arr.shape[0], dtype=np.int64)))
                rows += arr.shape[0] if arr.ndim else 1
                continue
            # Its changed rows are found and gathered by the save thread, block by block; an
            # update meanwhile keeps the old values of the rows it changes first.
            lazy = record.changes_snapshot(req.since, mark, self.checkpoints.block_bytes)
            if lazy is not None:
                snaps.append((record, lazy))
                found.append((key, lazy))
                continue
            changed = record.changed_rows(req.since)  # not contiguous: copied here, now
            if changed is not None and changed.size:
                tensors.append(whole(f"v:{key}:rows", arr[changed]))
                tensors.append(whole(f"v:{key}:idx", changed))
                written.append(key)
                rows += changed.size
        table_saves: list[tuple[DynamicTable, dict[str, Snapshot]]] = []
        table_rows: dict[str, int] = {}
        table_removed: dict[str, int] = {}
        for name, (table, spec) in tables.items():
            changes = table.changes(req.since)  # its rows gathered by the save thread too
            assert changes is not None  # removed_since was checked above
            save, gone = changes
            table_saves.append((table, save))
            tensors.extend(shard_tensors(table, save, spec.slots, f"{spec.prefix}:"))
            tensors.append(whole(f"{spec.prefix}:removed", gone))
            table_rows[name], table_removed[name] = int(save["ids"].shape[0]), int(gone.size)
            rows += table_rows[name]
            removed += table_removed[name]

        def everything() -> Tensors:  # on the save thread: the rows each snapshot finds
            nonlocal rows
            for key, lazy in found:
                picked = lazy.prepare()
                if picked.size:
                    tensors.append((f"v:{key}:rows", lazy.array.dtype, lazy.shape, lazy))
                    tensors.append(whole(f"v:{key}:idx", picked))
                    written.append(key)
                    rows += int(picked.size)
            return tensors

        # Spread over some seconds: the rows are gathered at once (up to a quarter of what
        # the ps holds), then sent at the rate, so updates meanwhile keep few old rows.
        ahead = 0
        if req.write_s > 0:
            ahead = ahead_for(self.store.nbytes + sum(t.nbytes for t in self.tables.values()))
        try:
            saved = await self.checkpoints.save_streamed(req.path, everything, req.write_s, ahead)
        finally:
            for record, snap in snaps:
                record.end_snapshot(snap)
            for table, save in table_saves:
                table.end_snapshot(save)
        for name in tables:
            self.feed.saved(name, req.path)
        return DeltaReply(
            incarnation=self.incarnation,
            mark=mark,
            bytes=saved["bytes"],
            rows=rows,
            removed=removed,
            written=written,
            whole=written_whole,
            whole_tables=[name for name, (table, _) in tables.items() if table.made > req.since],
            table_rows=table_rows,
            table_removed=table_removed,
        )
