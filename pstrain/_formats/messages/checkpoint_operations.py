"""The parameter server's checkpoint operations: full saves of variables (``ckpt/*``) and of
dynamic tables (saved with the variables, ``dyn/restore``), and delta checkpoints (``delta/*``).
Declared as in ``operations.py``, which registers them."""

from __future__ import annotations

from typing import Annotated

import msgspec

from .placement_map import SliceSet
from .records import (
    AbortReply,
    CommitReply,
    Count,
    DType,
    HurriedReply,
    Name,
    Operation,
    Owned,
    Owner,
    Path,
    Record,
    Reply,
    RestoreReply,
    SaveReply,
    Shape,
    TableSpec,
)

__all__ = [
    "MAX_WRITE_S",
    "AbortRestore",
    "CommitRestore",
    "DeltaReply",
    "DeltaTable",
    "HurryDeltas",
    "MarkReply",
    "Patch",
    "RestoreCheckpoint",
    "RestoreSpec",
    "RestoreTable",
    "SaveCheckpoint",
    "SaveDelta",
    "TableShardFile",
    "TakeMark",
]


#: A restore's stage: what ``ckpt/commit`` or ``ckpt/abort`` of it names.
StageId = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
#: A delta file of a table: the file and the prefix of the table's keys in it.
DeltaFile = tuple[Path, Annotated[str, msgspec.Meta(max_length=64)]]


class RestoreTable(Operation[RestoreReply], tag="dyn/restore"):
    """Rows of the ids this ps holds (``shard_of(id, num_shards) == shard``), gathered
    from every listed file of a saved table, then each delta of ``deltas`` applied in
    order (its removed ids dropped, its rows put in)."""

    name: Name
    config: TableSpec
    #: the full save's files (none: the table was created after it; its deltas hold it)
    paths: Annotated[list[Path], msgspec.Meta(max_length=1 << 12)]
    shard: Annotated[int, msgspec.Meta(ge=0)]
    num_shards: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
    owner: Owner | None = None
    #: slot key in the file -> slot key on the ps; others are dropped. None: as saved.
    slots: dict[Name, Name] | None = None
    #: the delta files to apply after the base, oldest first (each delta: all its files)
    deltas: Annotated[list[list[DeltaFile]], msgspec.Meta(max_length=1 << 12)] = []
    #: the slices this ps holds, for a table part of which moved (else its ``shard``)
    owned: SliceSet | None = None
    #: put the rows of slices ``owned`` into the table here, which then serves slices
    #: ``merge`` (a lost ps's slices, replaced); else the table is replaced
    merge: SliceSet | None = None
    #: read and check the rows, and hold them until ``ckpt/commit`` of this stage puts them
    #: in place (with the share of the capacity it gives); the reply counts them as staged
    stage: StageId | None = None


class TableShardFile(Record):
    """A dynamic table's shard to write with a ``ckpt/save``, to its own file ``path``."""

    name: Name
    path: Path
    #: slot key on the ps (``<optimizer name>/<slot>``) -> its key in the file; others are
    #: not saved. None: every slot, under its own key.
    slots: dict[Name, Name] | None = None


class SaveCheckpoint(Operation[SaveReply], tag="ckpt/save"):
    """Variables (file key -> variable) to ``path``, and ``tables``' shards on this ps each to
    its own file: every value is taken at one moment (between two whole updates)."""

    path: Path
    tensors: dict[Name, Name]
    tables: list[TableShardFile] = []


Source = tuple[Path, Name, Count | None, Count | None, Count | None]
#: ``[file, rows key, idx key or None, shift]``: a delta's rows of a variable, put in after
#: the sources are read: row ``idx[i] + shift`` of this part (if in it) becomes ``rows[i]``;
#: no idx key: the whole value.
Patch = tuple[Path, Name, Name | None, int]


class RestoreSpec(Record):
    name: Name
    dtype: DType
    shape: Shape
    sources: Annotated[list[Source], msgspec.Meta(min_length=1, max_length=1 << 16)]
    trainable: bool = True
    slot_of: Name | None = None  # an optimizer slot: the variable it belongs to
    patches: Annotated[list[Patch], msgspec.Meta(max_length=1 << 16)] = []


class RestoreCheckpoint(Owned[RestoreReply], tag="ckpt/restore"):
    vars: Annotated[list[RestoreSpec], msgspec.Meta(max_length=1 << 16)]
    stage: Annotated[str, msgspec.Meta(max_length=64)] | None = None


class CommitRestore(Owned[CommitReply], tag="ckpt/commit"):
    stage: StageId
    #: table -> this ps's share of its capacity, for the tables staged here (a restore
    #: shares the capacity as a total: each ps gets at least the rows it restored)
    tables: dict[Name, Count | None] = {}


class AbortRestore(Operation[AbortReply], tag="ckpt/abort"):
    stage: StageId


# -- delta checkpoints -----------------------------------------------------------------------------
#: The most seconds a ps spreads a delta's write over (``SaveDelta.write_s``).
MAX_WRITE_S = 86400.0
Incarnation = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


class MarkReply(Reply):
    incarnation: str
    mark: Count


class TakeMark(Operation[MarkReply], tag="delta/mark"):
    """End this ps's change epoch: a later delta "since" the mark holds what changed after it."""


class DeltaTable(Record):
    """A table in a delta: the prefix of its keys in the file and its slots' keys there."""

    prefix: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    #: slot key on the ps (``<optimizer name>/<slot>``) -> its key in the file
    slots: dict[Name, Name] = {}


class DeltaReply(Reply):
    incarnation: str
    mark: Count
    bytes: Count = 0
    rows: Count = 0
    removed: Count = 0
    #: the variables' file keys written, and those written whole
    written: list[str] = []
    whole: list[str] = []
    #: the tables written whole: made on this ps after the mark (the others' rows changed since)
    whole_tables: list[str] = []
    #: each table's rows written and ids removed
    table_rows: dict[str, Count] = {}
    table_removed: dict[str, Count] = {}


class SaveDelta(Operation[DeltaReply], tag="delta/save"):
    """Write what changed after mark ``since`` of ps incarnation ``incarnation`` to a new
    file: of each variable (file key -> variable name), the rows changed and their values;
    of each table (name -> :class:`DeltaTable`), its changed rows and slots and the ids
    evicted since. Refused (nothing written) if this ps is another incarnation, or could
    not keep a table's evictions since then: a full checkpoint is needed. ``write_s`` > 0:
    the file's bytes are spread over about that many seconds (0: as fast as they go)."""

    path: Path
    since: Count
    incarnation: Incarnation
    variables: Annotated[dict[Name, Name], msgspec.Meta(max_length=1 << 16)] = {}
    tables: Annotated[dict[Name, DeltaTable], msgspec.Meta(max_length=1 << 12)] = {}
    write_s: Annotated[float, msgspec.Meta(ge=0, le=MAX_WRITE_S)] = 0.0


class HurryDeltas(Operation[HurriedReply], tag="delta/hurry"):
    """Write the rest of this ps's spread deltas as fast as the disk goes (their coordinator
    stops writing deltas and waits for the one under way); ``hurried``: how many."""
