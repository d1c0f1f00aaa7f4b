"""One ps's share of a checkpoint: the values a lost ps held, read back to be put elsewhere.

A ps that is lost while training runs takes its variables with it; the coordinator puts
them on the other ps from the latest checkpoint (``_coordinator/elastic/replace.py``).
:func:`read_share` gives, for the ps-side keys of the variables (sharded variables'
parts too) that ps held, their values and those of their optimizer slots, as the
checkpoint at ``path`` has them (a delta path: base and deltas applied, in order). Only
those rows are read. A variable the checkpoint does not have is an error naming it:
nothing is put anywhere. :func:`table_sources` gives, for each tracked dynamic table,
the files (base and deltas) a ps reads the rows of the lost ps's slices from.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np

from .._base.errors import FailedPreconditionError
from .._formats.files.checkpoint_files import CheckpointReader
from .._formats.files.tensor_files import read_rows
from .._formats.messages.placement_map import VariableCopy
from .object_graph import table_slots, walk
from .restore_status import targets

if TYPE_CHECKING:
    from .checkpoint import Checkpoint

__all__ = ["read_share", "table_sources"]


def table_sources(checkpoint: Checkpoint, path: str) -> dict[str, tuple[list[str], dict[str, str], Any]]:
    """Table key -> the full save's files, the slot keys (saved -> on the ps) and the deltas
    of each tracked dynamic table at ``path``, as a restore reads them."""
    reader = CheckpointReader(path)
    graph = walk(checkpoint.tracked_objects())
    slots = {v: k for k, v in table_slots(graph).items()}
    out = {}
    for where, table in graph.tables.items():
        if where not in reader.tables:
            raise FailedPreconditionError(
                f"checkpoint {path} has no dynamic table {where!r} "
                f"({table.name}): it was created after its last save"
            )
        files = [os.path.join(reader.base, f) for f in reader.tables[where]["files"]]
        out[table.key] = (files, slots, reader.table_deltas(where))
    return out


def read_share(checkpoint: Checkpoint, path: str, keys: set[str], owner: str | None) -> list[VariableCopy]:
    """The values at ``path`` of variables ``keys`` (ps-side keys) and of their optimizer
    slots. FailedPreconditionError if the checkpoint has no value for one of ``keys``."""
    reader = CheckpointReader(path)
    graph = walk(checkpoint.tracked_objects())
    out: list[VariableCopy] = []
    found: set[str] = set()
    for target in targets(graph, reader.variables, graph.entries, {}):
        entry = target.entry
        for j, (part, name) in enumerate(zip(entry.parts, target.names)):
            if part.key not in keys:
                continue
            whole = len(entry.parts) == 1
            lo, hi = entry.offsets[j], entry.offsets[j + 1]
            shape = entry.shape if whole else (hi - lo, *entry.shape[1:])
            value = read_rows(shape, entry.dtype, *reader.rows_of(target.key, lo, hi, not entry.shape))
            out.append(
                VariableCopy(
                    name=name,
                    value=np.array(value, order="C"),
                    trainable=entry.trainable and not target.slot,
                    owner=owner,
                    slot_of=part.key if target.slot else None,
                )
            )
            if not target.slot:
                found.add(part.key)
    missing = sorted(keys - found)
    if missing:
        raise FailedPreconditionError(
            f"checkpoint {path} has no value for {len(missing)} variable(s) of the lost ps "
            f"({', '.join(missing[:10])}): they are not tracked by its Checkpoint, or were created "
            "after its last save"
        )
    return out
