"""The placement map: which ps holds which variable, versioned, and the operations that move
variables between ps while training runs.

A variable is created on a ps (its *home*, which its handle remembers); the map lists
only the variables that live elsewhere now (``moved``), so a job that never moves
anything carries an empty map, and a handle finds its ps with one dict lookup. ``ps``
lists every ps's address by index (``""`` for one that left: indices are never reused);
``version`` grows with every change. The coordinator owns the map and pushes each
version to every ps; clients learn it from the ps themselves, in the error a request
sent to the wrong ps gets (:class:`~pstrain.errors.PlacementChangedError`).

A move of some variables from ps A to ps B (the coordinator drives it):

1. ``ps/move_pull`` on B: B asks A for the copies itself (``ps/move_out`` on A: their
   arrays and optimizer slots as they are now, and a mark of A's change clock; A keeps
   training them) and stages them, as ``ps/install`` (staged) would: B holds the copies
   but does not serve them yet. The bytes go from A to B once, not through the
   coordinator; the coordinator gets the mark. A tiered table's rows do not come in the
   answer: B pulls them a block at a time (``ps/move_records``), writing each to its disk
   as it comes, before it answers.
2. (Kept for a coordinator that relays the copy itself: ``ps/move_out`` on A, then
   ``ps/install`` on B, staged.)
3. ``ps/move_finish`` on A, one step on its loop: A stops serving them (requests are
   refused with the new map) and answers with the rows changed since the mark, and
   the exactly-once records of those variables.
4. ``ps/install`` on B (activate): B applies those rows and serves the variables.
5. ``ps/move_end`` on A: it drops its copies (or, if the move failed, serves them again).

Nothing is applied twice or lost: A refuses from step 3 on, B serves from step 4 on,
and a request refused by either (or sent between the two) is sent again, by the
client, where the newest map says.

A dynamic table part of which moved is listed in ``tables``: its hash space cut in
``slices`` (an id is in slice ``shard_of(id, slices)``) and the ps of each slice. Its
slices move by the same steps (``tables`` of ``ps/move_out`` and ``ps/move_finish``):
a :class:`TableCopy` of their rows, then a :class:`TablePatch` of what changed since.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from ..._base.errors import ProtocolError
from .records import Count, Name, Operation, Owned, Owner, Record, Reply, TableSpec, convert

__all__ = [
    "EndMove",
    "EndReply",
    "FinishMove",
    "FinishReply",
    "InstallReply",
    "InstallVariables",
    "MoveOut",
    "MoveOutReply",
    "MoveRecords",
    "PullMove",
    "PullReply",
    "PlacementMap",
    "PlacementReply",
    "ReadPlacement",
    "ReadRecords",
    "RecordsBlock",
    "RecordsReply",
    "SLICES_PER_PS",
    "SetPlacement",
    "SliceSet",
    "TableCopy",
    "TablePatch",
    "TableSlices",
    "VariableCopy",
    "VersionReply",
    "first_slices",
]

Address = Annotated[str, msgspec.Meta(max_length=300)]
PsIndex = Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]
Stage = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
#: What changed of a variable moved since its copy: ``[name, rows (None: all of it), values]``.
VariablePatch = tuple[Name, Any, Any]
#: An exactly-once record a move takes along: ``[closure key, operation, [variables],
#: reply, {table: [[shard, [slices]] of the ids it covered, or None: all of them]}]``.
OnceRecord = tuple[Name, Count, list[Name], Any, dict[Name, list[tuple[Count, list[Count]] | None]]]
#: ``[coordinator incarnation (None: none named), worker, epoch]``.
FenceRecord = tuple[Owner | None, Count, Count]
Keys = Annotated[list[Name], msgspec.Meta(max_length=1 << 16)]
NumSlices = Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
Slices = Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]], msgspec.Meta(max_length=1 << 16)]


class TableSlices(Record):
    """Which ps holds each slice of a dynamic table's hash space (an id is in slice
    ``shard_of(id, slices)``), for a table part of which moved: ``owners[s]``."""

    slices: NumSlices
    owners: Annotated[list[PsIndex], msgspec.Meta(max_length=1 << 16)]

    def __post_init__(self) -> None:
        if len(self.owners) != self.slices:
            raise ValueError(f"{len(self.owners)} owners for {self.slices} slices")

    def held_by(self, ps: int) -> list[int]:
        return [s for s, owner in enumerate(self.owners) if owner == ps]


#: A dynamic table is cut into this many slices per ps it was created on, at its first move.
SLICES_PER_PS = 64


def first_slices(num_ps: int, active: list[int] | None = None) -> TableSlices:
    """A table's slices before any of them moved: slice ``s`` on ps ``s % num_ps``, the
    shard its ids hash to. With ``active``, the ps in the job when the table is created
    (some of the first ``num_ps`` gone, or others joined): each slice of a ps gone goes to
    the active ps holding the fewest, then a ps below its even share (one that joined)
    takes slices from the ps holding the most, as a move to a ps that joins would.

    >>> first_slices(2).owners[:4], first_slices(3, [0, 2]).owners[:6]
    ([0, 1, 0, 1], [0, 0, 2, 0, 2, 2])
    >>> sorted(set(first_slices(3, [0, 2, 3]).owners[1::3]))  # ps 1's slices, on ps 3
    [3]
    >>> [first_slices(2, [0, 1, 2]).owners.count(k) for k in range(3)]
    [43, 43, 42]
    """
    count = num_ps * min(SLICES_PER_PS, (1 << 16) // num_ps)
    owners = [s % num_ps for s in range(count)]
    if active is None:
        return TableSlices(slices=count, owners=owners)
    held: dict[int, list[int]] = {k: list(range(k, count, num_ps)) if k < num_ps else [] for k in active}
    for s in range(count):
        if owners[s] not in held:
            owners[s] = min(held, key=lambda k: (len(held[k]), k))
            held[owners[s]].append(s)
    for k in active:
        while len(held[k]) < count // len(active):
            src = max(held, key=lambda p: (len(held[p]), -p))
            owners[held[src][-1]] = k
            held[k].append(held[src].pop())
    return TableSlices(slices=count, owners=owners)


class SliceSet(Record):
    """Part of a table's hash space: slices ``owned`` of ``slices``."""

    slices: NumSlices
    owned: Slices

    def __post_init__(self) -> None:
        if any(s >= self.slices for s in self.owned):
            raise ValueError(f"a slice of {self.owned} is not below {self.slices}")


class PlacementMap(Record):
    """One version of the map.

    >>> m = PlacementMap(version=1, ps=["h:1", "h:2"])
    >>> m.ps_of("w", 1), m.moved_to({"w": 0}).ps_of("w", 1), m.moved_to({"w": 0}).version
    (1, 0, 2)
    """

    version: Count = 0
    ps: Annotated[list[Address], msgspec.Meta(max_length=1 << 16)] = []
    #: variable key -> the ps holding it, where that is not the ps it was created on
    moved: dict[Name, PsIndex] = {}
    #: variable key -> ps it was created on (for the keys of ``moved``: a move home drops them)
    home: dict[Name, PsIndex] = {}
    #: dynamic table key -> the owner of each slice, for the tables part of which moved
    tables: dict[Name, TableSlices] = {}

    def ps_of(self, key: str, home: int) -> int:
        """The ps holding variable ``key``, created on ps ``home``."""
        return self.moved.get(key, home)

    def active(self) -> list[int]:
        """The ps that are part of the job (those that left have no address)."""
        return [i for i, address in enumerate(self.ps) if address]

    def moved_to(self, where: dict[str, int], homes: dict[str, int] | None = None) -> PlacementMap:
        """The next version, with each variable of ``where`` on its ps (``homes``: the
        ps each was created on, for those not moved before)."""
        moved, home = dict(self.moved), dict(self.home)
        for key, ps in where.items():
            origin = home.get(key, (homes or {}).get(key, -1))
            if ps == origin:
                moved.pop(key, None)
                home.pop(key, None)
            else:
                moved[key] = ps
                home[key] = origin
        return PlacementMap(
            version=self.version + 1, ps=list(self.ps), moved=moved, home=home, tables=dict(self.tables)
        )

    def with_tables(self, tables: dict[str, TableSlices]) -> PlacementMap:
        """The next version, with these tables' slices where ``tables`` says."""
        return PlacementMap(
            version=self.version + 1,
            ps=list(self.ps),
            moved=dict(self.moved),
            home=dict(self.home),
            tables={**self.tables, **tables},
        )

    def bumped(self, version: int) -> PlacementMap:
        """This map as version ``version`` (a move that failed after it was announced)."""
        return msgspec.structs.replace(self, version=version)

    def grown(self, known: list[str]) -> list[str] | None:
        """The ps addresses to dial, if this map has more ps than ``known`` (those that
        left keep their known address: their index is never dialled for a variable)."""
        if len(self.ps) <= len(known):
            return None
        return [
            address or (known[i] if i < len(known) else "127.0.0.1:1") for i, address in enumerate(self.ps)
        ]

    def with_ps(self, ps: list[str]) -> PlacementMap:
        """The next version, with these ps addresses (a ps joined or left)."""
        return PlacementMap(
            version=self.version + 1,
            ps=list(ps),
            moved=dict(self.moved),
            home=dict(self.home),
            tables=dict(self.tables),
        )

    def to_builtins(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)

    @classmethod
    def from_builtins(cls, value: Any) -> PlacementMap:
        """A map sent by a peer (``ProtocolError`` if it is malformed)."""
        try:
            return convert(value, cls)
        except msgspec.ValidationError as exc:
            raise ProtocolError(f"malformed placement map: {exc}") from None


# -- the operations of a move --------------------------------------------------------------------
class VersionReply(Reply):
    """``ps/placement``: the map version the ps holds now."""

    version: int


class InstallReply(Reply):
    """``ps/install``: copies staged (the first step), or variables, slots and tables served
    from now on (``activate``)."""

    staged: int = 0
    installed: int = 0


class EndReply(Reply):
    """``ps/move_end``: whether there was such a move here."""

    ended: bool


class PullReply(Reply):
    """``ps/move_pull``: the source's mark (for ``ps/move_finish``), the copies staged, and
    the bytes of their arrays."""

    mark: int
    staged: int
    nbytes: int


class RecordsBlock(Reply):
    """``ps/move_records``: records laid out as a segment's on disk (each the id, the epoch,
    pad, last lookup and lookup count, the row, then a value per slot of ``record_slots``),
    packed (bytes); fewer than asked where the copy ends."""

    records: Any
    record_slots: Annotated[list[Name], msgspec.Meta(max_length=64)] = []


class VariableCopy(Record):
    """One variable (or optimizer slot) in a move."""

    name: Name
    value: Any  # an array
    trainable: bool = True
    owner: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    slot_of: Name | None = None  # the variable this is an optimizer slot of


class TableCopy(Record):
    """The rows of some slices of a dynamic table's shard, in a move (arrays by row)."""

    name: Name
    config: TableSpec  # the shard's TableConfig, its capacity the receiver's after the move
    owner: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    moving: SliceSet | None = None  # the slices moved
    serving: SliceSet | None = None  # on the receiver: every slice it holds after the move
    ids: Any = None
    rows: Any = None
    slots: dict[Name, Any] = {}
    slot_init: dict[Name, float] = {}
    #: More rows, those the source holds on disk (a tiered table), as their records lie
    #: there: each the id, the epoch, pad, last lookup and lookup count, the row, then a
    #: value per slot of ``record_slots`` (in that order), packed (bytes)
    records: Any = None
    record_slots: Annotated[list[Name], msgspec.Meta(max_length=64)] = []
    #: Rows of the copy the receiver pulls a block at a time (``ps/move_records``) rather
    #: than carries here: a tiered source's, rows in RAM and on disk alike
    record_count: Count = 0

    @property
    def nbytes(self) -> int:
        """The bytes of its arrays (ids, rows, slots, records) as received."""
        arrays = (self.ids, self.rows, self.records, *self.slots.values())
        return sum(int(getattr(a, "nbytes", 0)) for a in arrays)


class TablePatch(Record):
    """What changed in the slices of a table moved since the copy: ``live`` every id in
    them now, with ``ages`` (training lookups since each one's last: LRU) and ``freq``
    (LFU); ``ids`` the rows changed, with ``rows`` and ``slots``; the sightings of ids not
    admitted yet (``cand_ids``, ``cand_counts``)."""

    name: Name
    live: Any
    ages: Any
    freq: Any
    ids: Any
    rows: Any
    slots: dict[Name, Any] = {}
    cand_ids: Any = None
    cand_counts: Any = None
    removed: Any = None  # ids of these slices evicted since the source's last delta
    slot_init: dict[Name, float] = {}  # the slots' initial values (a slot made since the copy)


class MoveOutReply(Reply):
    mark: int
    vars: list[VariableCopy]
    tables: list[TableCopy] = []


class FinishReply(Reply):
    patches: list[VariablePatch]
    once: list[OnceRecord]
    fences: list[FenceRecord]
    superseded: list[str]
    tables: list[TablePatch] = []


class PlacementReply(Reply):
    placement: PlacementMap


class ReadPlacement(Operation[PlacementReply], tag="ps/placement/read"):
    """The newest map this ps knows (a client whose ps left asks another)."""


class SetPlacement(Owned[VersionReply], tag="ps/placement"):
    """The coordinator's newest map: the ps refuses requests for the variables it no
    longer holds with it."""

    placement: PlacementMap


class MoveOut(Owned[MoveOutReply], tag="ps/move_out"):
    """Step 1: copies of variables ``keys`` and of their optimizer slots, and a mark of the
    change clock."""

    keys: Keys
    stage: Stage
    #: dynamic table key -> the slices of it to move
    tables: dict[Name, SliceSet] = {}
    #: The receiver pulls a tiered table's rows itself, a block at a time
    #: (``ps/move_records``); else they come in the reply, whole
    pull_records: bool = False


class MoveRecords(Owned[RecordsBlock], tag="ps/move_records"):
    """Rows ``start`` on of the copy of table ``name`` that ``ps/move_out`` (with
    ``pull_records``) took in ``stage``, as records of one layout: at most ``count`` of
    them, and at most ``max_bytes``. The ps that pulls them writes them to its own disk as
    they come; the copy is of the moment of the mark, however late they are pulled."""

    stage: Stage
    name: Name
    start: Count
    count: Annotated[int, msgspec.Meta(ge=1, le=1 << 24)]
    max_bytes: Annotated[int, msgspec.Meta(ge=1 << 12, le=1 << 30)] = 4 << 20


class PullMove(Owned[PullReply], tag="ps/move_pull"):
    """Steps 1 and 2 on the receiving ps: ask ps ``source`` (index ``source_index``, at
    ``source_address``) for ``ps/move_out`` of ``keys`` and table slices ``tables``, and
    stage what it answers as ``ps/install`` would, each table's copy serving ``serving``
    here after the move, with capacity ``capacity``. ``timeout``: seconds the source has
    to answer."""

    stage: Stage
    source_index: PsIndex
    source_address: Address
    keys: Keys
    tables: dict[Name, SliceSet] = {}
    serving: dict[Name, SliceSet] = {}
    capacity: dict[Name, Annotated[int, msgspec.Meta(ge=1)] | None] = {}
    timeout: Annotated[float, msgspec.Meta(gt=0, le=86400)] = 120.0


class FinishMove(Owned[FinishReply], tag="ps/move_finish"):
    """Step 3: stop serving ``keys`` (refusing them with ``placement``); reply with the rows
    changed since ``mark``, the variables' exactly-once records, and the fences."""

    keys: Keys
    stage: Stage
    mark: Count
    placement: PlacementMap
    tables: dict[Name, SliceSet] = {}  # as MoveOut's
    #: dynamic table key -> the slices this ps holds once the move ends
    serving: dict[Name, SliceSet] = {}
    #: dynamic table key -> this ps's capacity of it once the move ends
    capacity: dict[Name, Annotated[int, msgspec.Meta(ge=1)] | None] = {}


class RecordsReply(Reply):
    once: list[OnceRecord]


class ReadRecords(Operation[RecordsReply], tag="ps/records"):
    """The exactly-once records of variables ``names`` on this ps: a replacement hands them
    to a lost optimizer step counter's copy, with the value of the counter that survived,
    so that a step counted on the survivor before the loss is not counted again on it."""

    names: Keys


class InstallVariables(Owned[InstallReply], tag="ps/install"):
    """Steps 2 and 4 on the receiving ps: ``vars`` staged (not served); then, with
    ``activate``, ``patches`` applied, the exactly-once records and fences merged, and the
    variables served under ``placement``."""

    stage: Stage
    vars: Annotated[list[VariableCopy], msgspec.Meta(max_length=1 << 16)] = []
    activate: bool = False
    patches: Annotated[list[VariablePatch], msgspec.Meta(max_length=1 << 16)] = []
    once: Annotated[list[OnceRecord], msgspec.Meta(max_length=1 << 22)] = []
    fences: Annotated[list[FenceRecord], msgspec.Meta(max_length=1 << 16)] = []
    superseded: Annotated[list[str], msgspec.Meta(max_length=1 << 12)] = []
    placement: PlacementMap | None = None
    tables: Annotated[list[TableCopy], msgspec.Meta(max_length=1 << 12)] = []  # staged
    table_patches: Annotated[list[TablePatch], msgspec.Meta(max_length=1 << 12)] = []  # activate


class EndMove(Owned[EndReply], tag="ps/move_end"):
    """Step 5: ``commit``: drop the copies of the variables moved out in ``stage``; else
    (the move failed) serve them again. On a receiving ps, not committed: drop what was
    staged."""

    stage: Stage
    commit: bool
