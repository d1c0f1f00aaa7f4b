"""Every operation on the wire, declared once: its request class (a msgspec struct tagged
with the op name), the class its reply converts to, and whether it may carry pickles or
stream partial replies.

Servers route by class (``server.route(ReadVariables, handler)``: the handler receives a
``ReadVariables``); clients send an instance (``await channel.request(ReadVariables(
names=["w"]))``) and get the reply as its declared class. Operations that change
variables derive from :class:`~pstrain._formats.messages.records.Mutation`, which carries the fence
and exactly-once fields. :data:`OPERATIONS` maps each op name to its class; ``Request`` is
the tagged union of them all. Field types and the reply records are in ``records.py``.

Adding an operation: declare its class here, and route it to a handler.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union

import msgspec
import numpy as np

from ..._base.errors import InvalidArgumentError
from .records import (
    Array,
    AsOf,
    CallReply,
    CancelReply,
    ClosureCall,
    ConfigureReply,
    Count,
    CreatedReply,
    DeletedReply,
    DroppedReply,
    DType,
    EmptyReply,
    FencedReply,
    FreeForm,
    HealthReply,
    JoinReply,
    ListReply,
    MembershipReply,
    Mutation,
    Name,
    Operation,
    OptimizerRule,
    Owned,
    Owner,
    Record,
    ResourceReply,
    ResultsReply,
    Shape,
    Step,
    StepReply,
    TableSpec,
    UpdatedReply,
    ValuesReply,
)

T = TypeVar("T")

__all__ = [
    "CREATE_CHUNK_BYTES",
    "MORE_GRADS",
    "MORE_STEPS",
    "MORE_TABLES",
    "OPERATIONS",
    "SINGLE_UPDATES",
    "Request",
    "UpdateKind",
    "operation",
]


# -- every task ---------------------------------------------------------------------------------------
class Health(Operation[HealthReply], tag="health"):
    """Is the task up: its status, role, index, pid, uptime and incarnation."""


class Statistics(Operation[FreeForm], tag="statistics"):
    """Free-form counters (``pstrain status``, ``/metrics``)."""


class Shutdown(Operation[EmptyReply], tag="server/shutdown"):
    """The job is done: a task started with ``--exit-on-shutdown`` leaves."""


# -- the parameter server: variables ---------------------------------------------------------------
#: A ``vars/create`` request may always ask for this many bytes of variables in all (clients
#: send their creations in chunks of at most this, or one larger variable); past it, at
#: most the ps's ``--max-variable-bytes``.
CREATE_CHUNK_BYTES = 8 << 20

Names = Annotated[list[Name], msgspec.Meta(max_length=1 << 16)]


class VariableSpec(Record):
    name: Name
    dtype: DType
    shape: Shape
    trainable: bool = True
    value: Array | None = None
    init: dict[str, Any] | None = None
    offset: Shape | None = None
    full_shape: Shape | None = None


class CreateVariables(Operation[CreatedReply], tag="vars/create"):
    vars: Annotated[list[VariableSpec], msgspec.Meta(max_length=1 << 16)]
    #: The strategy instance creating them: a different owner takes over same-named variables.
    owner: Owner | None = None


class ReadVariables(Operation[ValuesReply], tag="vars/read"):
    names: Names
    #: From an exactly-once closure (the channel fills it in): see ``ps/before_images.py``.
    as_of: AsOf | None = None


class DeleteVariables(Operation[DeletedReply], tag="vars/delete"):
    names: Names


class ListVariables(Operation[ListReply], tag="vars/list"):
    """The variables this ps holds: name, dtype, shape, trainable, bytes."""


class UpdateKind(enum.Enum):
    """What an update does to a variable (on the wire: its value)."""

    ASSIGN = "assign"
    ASSIGN_ADD = "assign_add"
    ASSIGN_SUB = "assign_sub"
    SCATTER_ADD = "scatter_add"
    SCATTER_SUB = "scatter_sub"
    SCATTER_MUL = "scatter_mul"
    SCATTER_DIV = "scatter_div"
    SCATTER_MIN = "scatter_min"
    SCATTER_MAX = "scatter_max"
    SCATTER_UPDATE = "scatter_update"

    @property
    def rows(self) -> bool:
        """Whether it changes rows (a scatter), not the whole variable."""
        return self.value.startswith("scatter")


class Update(Record):
    op: UpdateKind
    name: Name
    value: Array | None = None
    indices: Array | None = None
    values: Array | None = None


class UpdateVariables(Mutation[UpdatedReply], tag="vars/update"):
    """Many updates, applied in order, in one request."""

    updates: Annotated[list[Update], msgspec.Meta(max_length=1 << 16)]


class SingleUpdate(Mutation[UpdatedReply]):
    """One variable's update; its class says which (``kind``)."""

    kind: ClassVar[UpdateKind]
    name: Name
    value: Array | None = None
    indices: Array | None = None
    values: Array | None = None


class Assign(SingleUpdate, tag="vars/assign"):
    kind = UpdateKind.ASSIGN


class AssignAdd(SingleUpdate, tag="vars/assign_add"):
    kind = UpdateKind.ASSIGN_ADD


class AssignSub(SingleUpdate, tag="vars/assign_sub"):
    kind = UpdateKind.ASSIGN_SUB


class ScatterAdd(SingleUpdate, tag="vars/scatter_add"):
    kind = UpdateKind.SCATTER_ADD


class ScatterSub(SingleUpdate, tag="vars/scatter_sub"):
    kind = UpdateKind.SCATTER_SUB


class ScatterMul(SingleUpdate, tag="vars/scatter_mul"):
    kind = UpdateKind.SCATTER_MUL


class ScatterDiv(SingleUpdate, tag="vars/scatter_div"):
    kind = UpdateKind.SCATTER_DIV


class ScatterMin(SingleUpdate, tag="vars/scatter_min"):
    kind = UpdateKind.SCATTER_MIN


class ScatterMax(SingleUpdate, tag="vars/scatter_max"):
    kind = UpdateKind.SCATTER_MAX


class ScatterUpdate(SingleUpdate, tag="vars/scatter_update"):
    kind = UpdateKind.SCATTER_UPDATE


#: The one-variable update of each kind.
SINGLE_UPDATES: dict[UpdateKind, type[SingleUpdate]] = {
    cls.kind: cls
    for cls in (
        Assign,
        AssignAdd,
        AssignSub,
        ScatterAdd,
        ScatterSub,
        ScatterMul,
        ScatterDiv,
        ScatterMin,
        ScatterMax,
        ScatterUpdate,
    )
}


class RowRead(Record):
    """Rows ``indices`` of variable ``name``, or (``indices`` None) the whole variable."""

    name: Name
    indices: Array | None = None


class PackedRows(Record, array_like=True):
    """Rows of several variables in one array (and their values in another), so that a
    collection's step sends a ps two or three arrays, not one or two for each table part
    there: variable ``names[i]`` has the next ``counts[i]`` of ``rows`` (and of ``values``).
    Each array costs both ends as much to encode and decode as a small one's bytes do."""

    names: Annotated[list[Name], msgspec.Meta(min_length=1, max_length=1 << 16)]
    counts: Array
    rows: Array
    values: Array | None = None

    @classmethod
    def of(cls, entries: list[Any]) -> PackedRows:
        """``[(name, rows, values or None), ...]`` packed (what :meth:`entries` gives back)."""
        return cls(
            names=[e[0] for e in entries],
            counts=np.array([e[1].shape[0] for e in entries], np.int64),
            rows=np.concatenate([e[1] for e in entries]),
            values=None if entries[0][2] is None else np.concatenate([e[2] for e in entries]),
        )

    def entries(self, what: str) -> list[tuple[str, np.ndarray, np.ndarray | None]]:
        """``(name, rows, values)`` for each variable, views of the arrays (rows as int64,
        as the ps's kernels take them), or InvalidArgumentError naming ``what``."""
        counts, rows, values = self.counts, self.rows, self.values
        if counts.ndim != 1 or counts.dtype.kind not in "iu" or counts.size != len(self.names):
            raise InvalidArgumentError(
                f"{what}: packed rows need one integer count for each of the {len(self.names)} "
                f"names, got {counts.dtype} {list(counts.shape)}"
            )
        if rows.ndim != 1 or rows.dtype.kind not in "iu":
            raise InvalidArgumentError(
                f"{what}: packed rows must be 1-D integers, got {rows.dtype} {list(rows.shape)}"
            )
        if int(counts.min()) < 0:  # (one count a name, and a name at least)
            raise InvalidArgumentError(f"{what}: packed rows have a negative count")
        ends = np.cumsum(counts, dtype=np.int64)
        if int(ends[-1]) != rows.shape[0]:
            raise InvalidArgumentError(
                f"{what}: the packed counts add up to {int(ends[-1])}, not {rows.shape[0]} rows"
            )
        if values is not None and (values.ndim < 1 or values.shape[0] != rows.shape[0]):
            raise InvalidArgumentError(
                f"{what}: packed values of shape {list(values.shape)} for {rows.shape[0]} rows"
            )
        # (an id past int64 becomes negative: out of range, as a variable's own rows are)
        rows = np.ascontiguousarray(rows, np.int64)
        out: list[tuple[str, np.ndarray, np.ndarray | None]] = []
        start = 0
        for name, end in zip(self.names, ends.tolist()):
            out.append((name, rows[start:end], None if values is None else values[start:end]))
            start = end
        return out


def most_alike(items: list[T], kind: Callable[[T], Hashable]) -> list[T]:
    """The most of ``items`` of one ``kind`` (a dtype and a row shape), if two or more: those
    that travel as one :class:`PackedRows`; else none."""
    kinds: dict[Hashable, list[T]] = {}
    for item in items:
        kinds.setdefault(kind(item), []).append(item)
    most = max(kinds.values(), key=len, default=[])
    return most if len(most) > 1 else []


class SparseRead(Operation[ValuesReply], tag="vars/sparse_read"):
    """Either ``{"reads": [{name, indices}, ...]}`` or one ``{name, indices}``; with
    ``packed``, rows of more variables (ids unique per variable), whose rows come back as one
    array after the values of ``reads`` (the variables' dtypes and row shapes must agree)."""

    reads: Annotated[list[RowRead], msgspec.Meta(max_length=1 << 16)] | None = None
    name: Name | None = None
    indices: Array | None = None
    as_of: AsOf | None = None
    packed: PackedRows | None = None


class CallVariables(Mutation[CallReply], tag="vars/call"):
    """Run a function on the ps, next to the variables it names (pickled: runs code)."""

    pickle = True
    fn: Any
    vars: Annotated[list[Name], msgspec.Meta(min_length=1, max_length=1 << 10)]
    args: Any = ()
    kwargs: dict[str, Any] = {}


class Fence(Operation[FencedReply], tag="ps/fence"):
    """Refuse updates of ``worker``'s dispatches before ``epoch`` (those sent for ``owner``;
    fences of other coordinators are their own)."""

    worker: Annotated[int, msgspec.Meta(ge=0)]
    epoch: Annotated[int, msgspec.Meta(ge=0)]
    owner: Owner | None = None


# -- the parameter server: optimizers and dynamic tables -----------------------------------------
#: Other optimizers' steps one ``opt/apply`` may carry (its ``more``), and the gradients of
#: variables and of tables each of those may name: together, at most a few times the
#: entries of the request's own step (a request's decoded entries follow the bytes sent).
MORE_STEPS = 1 << 5
MORE_GRADS = 1 << 12
MORE_TABLES = 1 << 10


class OptimizerStep(Record):
    """Another optimizer's step in an ``opt/apply`` (its ``more``): the fields of the
    request's own step, applied after it, all or nothing together."""

    rule: OptimizerRule
    prefix: Name
    grads: Annotated[list[tuple[Name, Array | None, Array]], msgspec.Meta(max_length=MORE_GRADS)]
    tables: Annotated[list[tuple[Name, Array, Array]], msgspec.Meta(max_length=MORE_TABLES)] | None = None
    unique_rows: bool = False
    iterations: Name | None = None
    t: Step | None = None
    mirror: Name | None = None
    packed: PackedRows | None = None


class ApplyGradients(Mutation[StepReply], tag="opt/apply"):
    """One optimizer step of the variables and tables on this ps; with ``more``, the steps
    of several optimizers (a collection whose tables have their own), in one request."""

    rule: OptimizerRule
    prefix: Name
    grads: Annotated[list[tuple[Name, Array | None, Array]], msgspec.Meta(max_length=1 << 16)]
    #: ``[table, ids, values]``: sparse gradients of dynamic tables (ids unique).
    tables: Annotated[list[tuple[Name, Array, Array]], msgspec.Meta(max_length=1 << 12)] | None = None
    unique_rows: bool = False
    iterations: Name | None = None
    t: Step | None = None
    #: a second step counter (on another ps than ``iterations``) counted in the same step
    mirror: Name | None = None
    #: other optimizers' steps, each applied after the one before (the reply's ``more``
    #: gives their steps, in this order)
    more: Annotated[list[OptimizerStep], msgspec.Meta(max_length=MORE_STEPS)] | None = None
    #: more sparse gradients (rows unique per variable, names not in ``grads``), applied
    #: after ``grads``: one pair of arrays for every table part of a collection on the ps
    packed: PackedRows | None = None

    def received(self) -> ApplyGradients:
        """Each step's ``packed`` gradients as entries of its ``grads`` (views): what the
        ps's handlers, its exactly-once records and its moves read."""
        for step in self.steps():
            if step.packed is not None:
                if step.packed.values is None:
                    raise InvalidArgumentError("opt/apply: packed gradients need their values")
                if step is not self and len(step.grads) + len(step.packed.names) > MORE_GRADS:
                    raise InvalidArgumentError(
                        f"opt/apply: a step in 'more' names at most {MORE_GRADS} variables, "
                        "packed ones included"
                    )
                step.grads = [*step.grads, *step.packed.entries("opt/apply")]  # type: ignore[list-item]
                step.packed = None
        return self

    def steps(self) -> list[ApplyGradients | OptimizerStep]:
        """This request's optimizer steps: its own, then ``more``'s."""
        return [self, *(self.more or ())]

    def table_gradients(self) -> list[tuple[str, Any, Any]]:
        """Every step's ``[table, ids, values]``, in order."""
        return [entry for step in self.steps() for entry in step.tables or ()]


class CreateTable(Operation[CreatedReply], tag="dyn/create"):
    name: Name
    config: TableSpec
    owner: Owner | None = None
    #: which shard of how many this ps holds (ids with ``shard_of(ids, num_shards) == shard``)
    shard: Annotated[int, msgspec.Meta(ge=0)] | None = None
    num_shards: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)] | None = None
    #: or which slices (a table created after a ps left or joined: sliced from the start)
    owned: SliceSet | None = None


class LookupTable(Owned[ValuesReply], tag="dyn/lookup"):
    """A training lookup admits, evicts and stamps rows: it names its coordinator (from
    a closure, the one that dispatched it), refused once a newer one took the ps over."""

    name: Name
    ids: Array
    train: bool = True
    as_of: AsOf | None = None


class TableIds(Record):
    name: Name
    ids: Array


class LookupTables(Owned[ValuesReply], tag="dyn/lookup_many"):
    """Several tables' rows in one request (a collection's step): each entry as one
    ``dyn/lookup``, and ``reads`` as ``vars/sparse_read``'s (rows of variables, or whole
    ones), every entry checked before any row is admitted. The values come in that order:
    the tables', then the reads'."""

    lookups: Annotated[list[TableIds], msgspec.Meta(min_length=1, max_length=1 << 12)]
    reads: Annotated[list[RowRead], msgspec.Meta(max_length=1 << 16)] | None = None
    train: bool = True
    as_of: AsOf | None = None


class TableStatistics(Operation[FreeForm], tag="dyn/stats"):
    """Free-form counters of one table."""

    name: Name


class ExportTable(Operation[FreeForm], tag="dyn/export"):
    """Every row of one table's shard (free-form: ids, values, slots)."""

    name: Name


# -- the worker ---------------------------------------------------------------------------------------
Incarnation = Annotated[str, msgspec.Meta(max_length=64)]


class Configure(Operation[ConfigureReply], tag="worker/configure"):
    """The coordinator tells a worker where the tasks are."""

    cluster: dict[Name, list[Annotated[str, msgspec.Meta(min_length=1, max_length=300)]]]
    #: the coordinator had lost this worker (the connections it has may stall), or reaches
    #: it for the first time (it may have served another one, whose maps it knows): drop
    #: every connection and map it has
    fresh: bool = False
    #: the slot the coordinator addresses; a worker that joined (``--join``) takes it
    index: Annotated[int, msgspec.Meta(ge=0)] | None = None


class RunClosures(Operation[ResultsReply], tag="worker/run"):
    """A batch of closures; results stream back as they finish."""

    pickle = True
    stream = True
    pickle_failures_kept = True  # arguments or a result that cannot be unpickled: that closure fails
    closures: Annotated[list[ClosureCall], msgspec.Meta(max_length=1 << 16)]
    fns: dict[bytes, bytes] = {}
    incarnation: Incarnation | None = None
    epoch: Annotated[int, msgspec.Meta(ge=0)] | None = None
    #: the coordinator incarnation the closures' updates work for (fenced per owner)
    owner: Owner | None = None
    #: closure id -> key, for the closures scheduled exactly-once
    once: dict[Count, Annotated[str, msgspec.Meta(min_length=1, max_length=96)]] = {}
    #: the coordinator's placement map, when it changed since its last batch to this worker:
    #: the worker routes by it (one idle through joins, leaves and a lost ps replaced would
    #: otherwise know only ps that are gone, and none to ask for the newest map)
    placement: PlacementMap | None = None


class ResetChannels(Operation[EmptyReply], tag="worker/reset_channels"):
    """Drop the worker's connections to one task (a partition)."""

    job: Literal["ps", "worker", "chief"]
    index: Annotated[int, msgspec.Meta(ge=0)]


class CancelClosures(Operation[CancelReply], tag="worker/cancel"):
    ids: Annotated[list[Count], msgspec.Meta(max_length=1 << 16)]


class CreateResource(Operation[ResourceReply], tag="worker/resource"):
    """A per-worker dataset (``fn()``) or an iterator of one (pickled: runs code)."""

    pickle = True
    rid: Count
    kind: Literal["dataset", "iterator"]
    fn: Any
    of: Count | None = None
    incarnation: Incarnation | None = None


class DropResources(Operation[DroppedReply], tag="worker/drop_resources"):
    rids: Annotated[list[Count], msgspec.Meta(max_length=1 << 16)]


# -- the coordinator's endpoint ---------------------------------------------------------------------
class Join(Operation[JoinReply], tag="coordinator/join"):
    """A worker started with ``--join`` asks for a slot."""

    address: Annotated[str, msgspec.Meta(min_length=1, max_length=300)]


class Membership(Operation[MembershipReply], tag="coordinator/membership"):
    """The workers a coordinator knows, and its placement map."""


class JoinPs(Operation[JoinReply], tag="coordinator/join_ps"):
    """An empty ps started with ``--join`` asks for an index (no ``index``), takes it, then
    asks again with it: it joins, and a share of the variables moves to it."""

    address: Annotated[str, msgspec.Meta(min_length=1, max_length=300)]
    index: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)] | None = None


class LeavePs(Operation[JoinReply], tag="coordinator/leave_ps"):
    """A ps told to stop (SIGTERM) asks the coordinator to move its variables away first;
    the reply comes once they have."""

    index: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)]


# declares the ckpt/*, delta/*, ps/placement and ps/move_* ops
from . import checkpoint_operations, placement_map  # noqa: E402, F401, I001
from .placement_map import PlacementMap, SliceSet  # noqa: E402  (dyn/create's slices, worker/run's map)


def _operations(base: type[Operation[Any]]) -> dict[str, type[Operation[Any]]]:
    found: dict[str, type[Operation[Any]]] = {}
    for cls in base.__subclasses__():
        tag = cls.__struct_config__.tag
        if isinstance(tag, str) and tag != cls.__name__:  # a base (Mutation) has its name as tag
            assert tag not in found, f"two operations named {tag!r}"
            found[tag] = cls
        found.update(_operations(cls))
    return found


#: Every operation by its name.
OPERATIONS: dict[str, type[Operation[Any]]] = _operations(Operation)
#: The tagged union of every request (the tag is ``op``, the operation's name).
Request = Union[tuple(OPERATIONS.values())]  # type: ignore[valid-type]  # noqa: UP007


def operation(op: str) -> type[Operation[Any]]:
    """The class of operation ``op`` (KeyError if there is none)."""
    return OPERATIONS[op]
