"""The declared request and reply of every operation, validated once at each edge.

A request body is decoded by ``wire`` (arrays stay numpy views), then
converted to its operation's record here with msgspec, which checks field
names (unknown ones are refused), types (a string where a list of names is
due is refused), ranges and sizes, all before a handler runs and so before
any state is touched. A refusal is an
:class:`~pstrain.errors.InvalidArgumentError` naming the operation and the
field (``vars/delete: Expected `array`, got `str` - at `$.names```).

Arrays are ``np.ndarray`` fields (a numpy scalar is accepted as a 0-d
array); lists of numbers are not arrays. Handlers then read attributes, never
``dict`` keys with defaults. Replies are declared too and checked by the
client (:func:`check_reply`) before anyone reads them: a reply of the wrong
shape is a :class:`~pstrain.errors.ProtocolError`, not a ``KeyError`` later.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
import numpy as np

from .._base.errors import InvalidArgumentError, ProtocolError

__all__ = ["CREATE_CHUNK_BYTES", "REPLIES", "REQUESTS", "check_reply", "validate"]

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
DType = Annotated[str, msgspec.Meta(min_length=1, max_length=32)]
Dim = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
Shape = Annotated[list[Dim], msgspec.Meta(max_length=32)]
Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 62)]
Step = Annotated[int, msgspec.Meta(ge=1, le=1 << 62)]
Array = np.ndarray


class Record(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Base of every request record: unknown fields are refused."""


class Empty(Record):
    """``health``, ``statistics``, ``vars/list``: no fields."""


# -- the parameter server -----------------------------------------------------------------------
class VariableSpec(Record):
    name: Name
    dtype: DType
    shape: Shape
    trainable: bool = True
    value: Array | None = None
    init: dict[str, Any] | None = None
    offset: Shape | None = None
    full_shape: Shape | None = None


class CreateRequest(Record):
    vars: Annotated[list[VariableSpec], msgspec.Meta(max_length=1 << 16)]
    #: The strategy instance creating them: a different owner takes over same-named variables.
    owner: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] | None = None


class NamesRequest(Record):
    """``vars/read`` and ``vars/delete``."""

    names: Annotated[list[Name], msgspec.Meta(max_length=1 << 16)]


UpdateOp = Literal["assign", "assign_add", "assign_sub", "scatter_add", "scatter_sub", "scatter_update"]


class Update(Record):
    op: UpdateOp
    name: Name
    value: Array | None = None
    indices: Array | None = None
    values: Array | None = None


#: The coordinator incarnation (its strategy's owner id) an update works for.
Owner = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
#: ``[worker index, epoch]``: which dispatch of which worker sent an update (fencing).
Fence = tuple[Annotated[int, msgspec.Meta(ge=0)], Annotated[int, msgspec.Meta(ge=0)]]
#: ``[closure key, sequence]``: an exactly-once closure's n-th update to this ps.
Once = tuple[Annotated[str, msgspec.Meta(min_length=1, max_length=96)], Annotated[int, msgspec.Meta(ge=1)]]


#: A ``vars/create`` request may always ask for this many bytes of variables in all (clients
#: send their creations in chunks of at most this, or one larger variable); past it, at
#: most the ps's ``--max-variable-bytes``.
CREATE_CHUNK_BYTES = 8 << 20


class UpdateRequest(Record):
    updates: Annotated[list[Update], msgspec.Meta(max_length=1 << 16)]
    owner: Owner | None = None
    fence: Fence | None = None
    once: Once | None = None


class SingleUpdate(Record):
    """``vars/assign`` and the other one-variable updates (the op is the route's)."""

    name: Name
    value: Array | None = None
    indices: Array | None = None
    values: Array | None = None
    owner: Owner | None = None
    fence: Fence | None = None
    once: Once | None = None


class RowRead(Record):
    name: Name
    indices: Array


class SparseReadRequest(Record):
    """Either ``{"reads": [{name, indices}, ...]}`` or one ``{name, indices}``."""

    reads: Annotated[list[RowRead], msgspec.Meta(max_length=1 << 16)] | None = None
    name: Name | None = None
    indices: Array | None = None


Positive = Annotated[float, msgspec.Meta(gt=0)]


class ExponentialDecaySpec(Record, tag="exponential_decay", tag_field="type"):
    initial_learning_rate: Positive
    decay_steps: Positive
    decay_rate: Positive
    staircase: bool = False


class PiecewiseConstantSpec(Record, tag="piecewise_constant", tag_field="type"):
    boundaries: Annotated[list[float], msgspec.Meta(max_length=1024)]
    values: Annotated[list[Positive], msgspec.Meta(min_length=1, max_length=1025)]


class CosineDecaySpec(Record, tag="cosine_decay", tag_field="type"):
    initial_learning_rate: Positive
    decay_steps: Positive
    alpha: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0


class OptimizerRule(Record):
    kind: Literal["sgd", "adagrad", "adam", "adamw", "ftrl", "rmsprop"]
    learning_rate: Positive | ExponentialDecaySpec | PiecewiseConstantSpec | CosineDecaySpec
    momentum: float | None = None
    nesterov: bool | None = None
    initial_accumulator_value: float | None = None
    epsilon: float | None = None
    beta_1: float | None = None
    beta_2: float | None = None
    learning_rate_power: float | None = None
    l1_regularization_strength: float | None = None
    l2_regularization_strength: float | None = None
    l2_shrinkage_regularization_strength: float | None = None
    beta: float | None = None
    rho: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    centered: bool | None = None
    weight_decay: Annotated[float, msgspec.Meta(ge=0)] | None = None


class ApplyRequest(Record):
    rule: OptimizerRule
    prefix: Name
    grads: Annotated[list[tuple[Name, Array | None, Array]], msgspec.Meta(max_length=1 << 16)]
    #: ``[table, ids, values]``: sparse gradients of dynamic tables (ids unique).
    tables: Annotated[list[tuple[Name, Array, Array]], msgspec.Meta(max_length=1 << 12)] | None = None
    unique_rows: bool = False
    iterations: Name | None = None
    t: Step | None = None
    owner: Owner | None = None
    fence: Fence | None = None
    once: Once | None = None


# -- dynamic embedding tables --------------------------------------------------------------------
class TableSpec(Record):
    """A dynamic table's fixed configuration (see ``pstrain.server.ps.dynamic_table``)."""

    dim: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    dtype: DType = "float32"
    seed: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)] = 0
    init_low: float = -0.05
    init_high: float = 0.05
    default_value: float = 0.0
    capacity: Annotated[int, msgspec.Meta(ge=1, le=1 << 40)] | None = None
    evict: Literal["lru", "lfu"] = "lru"
    max_age: Annotated[int, msgspec.Meta(ge=1, le=1 << 62)] | None = None
    admit_after: Annotated[int, msgspec.Meta(ge=1, le=1 << 30)] | None = None
    admit_probability: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    max_candidates: Annotated[int, msgspec.Meta(ge=1, le=1 << 30)] = 1 << 20


class TableCreateRequest(Record):
    name: Name
    config: TableSpec
    owner: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] | None = None


class TableLookupRequest(Record):
    name: Name
    ids: Array
    train: bool = True


class TableRequest(Record):
    """``dyn/stats`` and ``dyn/export``: one table by name."""

    name: Name


class TableSaveRequest(Record):
    name: Name
    path: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    #: slot key on the ps (``<optimizer name>/<slot>``) -> its key in the file; others are
    #: not saved. None: every slot, under its own key.
    slots: dict[Name, Name] | None = None


class TableRestoreRequest(Record):
    """Rows of the ids this ps holds (``shard_of(id, num_shards) == shard``), gathered
    from every listed file of a saved table."""

    name: Name
    config: TableSpec
    paths: Annotated[list[Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]],
                     msgspec.Meta(min_length=1, max_length=1 << 12)]
    shard: Annotated[int, msgspec.Meta(ge=0)]
    num_shards: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
    owner: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] | None = None
    #: slot key in the file -> slot key on the ps; others are dropped. None: as saved.
    slots: dict[Name, Name] | None = None


class SaveRequest(Record):
    path: Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
    tensors: dict[Name, Name]


Source = tuple[Annotated[str, msgspec.Meta(min_length=1, max_length=4096)], Name,
               Count | None, Count | None, Count | None]


class RestoreSpec(Record):
    name: Name
    dtype: DType
    shape: Shape
    sources: Annotated[list[Source], msgspec.Meta(min_length=1, max_length=1 << 16)]
    trainable: bool = True
    slot_of: Name | None = None  # an optimizer slot: the variable it belongs to


class RestoreRequest(Record):
    vars: Annotated[list[RestoreSpec], msgspec.Meta(max_length=1 << 16)]
    stage: Annotated[str, msgspec.Meta(max_length=64)] | None = None


class StageRequest(Record):
    """``ckpt/commit`` and ``ckpt/abort`` of a staged restore."""

    stage: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


class CallRequest(Record):
    fn: Any
    vars: Annotated[list[Name], msgspec.Meta(min_length=1, max_length=1 << 10)]
    args: Any = ()
    kwargs: dict[str, Any] = {}
    owner: Owner | None = None
    fence: Fence | None = None
    once: Once | None = None


class FenceRequest(Record):
    """``ps/fence``: refuse updates of ``worker``'s dispatches before ``epoch`` (those sent
    for ``owner``; fences of other coordinators are their own)."""

    worker: Annotated[int, msgspec.Meta(ge=0)]
    epoch: Annotated[int, msgspec.Meta(ge=0)]
    owner: Owner | None = None


# -- the worker ---------------------------------------------------------------------------------------
class ConfigureRequest(Record):
    cluster: dict[Name, list[Annotated[str, msgspec.Meta(min_length=1, max_length=300)]]]
    #: the coordinator had lost this worker: drop every connection it has (they may stall)
    fresh: bool = False
    #: the slot the coordinator addresses; a worker that joined (``--join``) takes it
    index: Annotated[int, msgspec.Meta(ge=0)] | None = None


ClosureEntry = tuple[Count, bytes, Any, Any, bool]


class RunRequest(Record):
    closures: Annotated[list[ClosureEntry], msgspec.Meta(max_length=1 << 16)]
    fns: dict[bytes, bytes] = {}
    incarnation: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    epoch: Annotated[int, msgspec.Meta(ge=0)] | None = None
    #: the coordinator incarnation the closures' updates work for (fenced per owner)
    owner: Owner | None = None
    #: closure id -> key, for the closures scheduled exactly-once
    once: dict[Count, Annotated[str, msgspec.Meta(min_length=1, max_length=96)]] = {}


class ResetRequest(Record):
    """``worker/reset_channels``: drop the worker's connections to one task (a partition)."""

    job: Literal["ps", "worker", "chief"]
    index: Annotated[int, msgspec.Meta(ge=0)]


class CancelRequest(Record):
    ids: Annotated[list[Count], msgspec.Meta(max_length=1 << 16)]


class ResourceRequest(Record):
    rid: Count
    kind: Literal["dataset", "iterator"]
    fn: Any
    of: Count | None = None
    incarnation: Annotated[str, msgspec.Meta(max_length=64)] | None = None


class DropRequest(Record):
    rids: Annotated[list[Count], msgspec.Meta(max_length=1 << 16)]


# -- the coordinator's endpoint ---------------------------------------------------------------------
class JoinRequest(Record):
    """``coordinator/join``: a worker started with ``--join`` asks for a slot."""

    address: Annotated[str, msgspec.Meta(min_length=1, max_length=300)]


#: The record of each operation's request.
REQUESTS: dict[str, type[Record]] = {
    "health": Empty,
    "statistics": Empty,
    "vars/create": CreateRequest,
    "vars/read": NamesRequest,
    "vars/delete": NamesRequest,
    "vars/list": Empty,
    "vars/update": UpdateRequest,
    "vars/sparse_read": SparseReadRequest,
    "opt/apply": ApplyRequest,
    "dyn/create": TableCreateRequest,
    "dyn/lookup": TableLookupRequest,
    "dyn/stats": TableRequest,
    "dyn/export": TableRequest,
    "dyn/save": TableSaveRequest,
    "dyn/restore": TableRestoreRequest,
    "ckpt/save": SaveRequest,
    "ckpt/restore": RestoreRequest,
    "ckpt/commit": StageRequest,
    "ckpt/abort": StageRequest,
    "vars/call": CallRequest,
    "ps/fence": FenceRequest,
    "worker/configure": ConfigureRequest,
    "worker/run": RunRequest,
    "worker/cancel": CancelRequest,
    "worker/reset_channels": ResetRequest,
    "server/shutdown": Empty,
    "worker/resource": ResourceRequest,
    "worker/drop_resources": DropRequest,
    "coordinator/join": JoinRequest,
    "coordinator/membership": Empty,
    **{f"vars/{op}": SingleUpdate for op in ("assign", "assign_add", "assign_sub", "scatter_add",
                                             "scatter_sub", "scatter_update")},
}


def _dec_hook(tp: type, obj: Any) -> Any:
    if tp is np.ndarray:
        if isinstance(obj, np.ndarray):
            return obj
        if isinstance(obj, np.generic):
            return np.asarray(obj)
        raise ValueError(f"expected an array, got {type(obj).__name__}")
    raise ValueError(f"unsupported type {tp!r}")


def validate(op: str, record: type[Record], payload: Any) -> Any:
    """``payload`` as ``record``, or InvalidArgumentError naming the op and the field.

    >>> validate("vars/read", NamesRequest, {"names": ["w"]})
    NamesRequest(names=['w'])
    >>> validate("vars/delete", NamesRequest, {"names": "w"})
    Traceback (most recent call last):
    ...
    pstrain.errors.InvalidArgumentError: vars/delete: Expected `array`, got `str` - at `$.names`
    """
    if payload is None and record is Empty:
        return Empty()
    try:
        return msgspec.convert(payload, record, dec_hook=_dec_hook)
    except msgspec.ValidationError as exc:
        raise InvalidArgumentError(f"{op}: {exc}") from None


# -- replies (validated by the client, at the same edge) ---------------------------------------------
class Reply(msgspec.Struct, omit_defaults=True):
    """Base of reply records. Unknown fields are allowed: a newer server may add some."""


class HealthReply(Reply):
    status: str
    task: str
    role: str | None = None
    index: int | None = None
    pid: int | None = None
    uptime_s: float | None = None
    incarnation: str | None = None


class CountReply(Reply):
    created: Count | None = None
    updated: Count | None = None
    deleted: Count | None = None
    restored: Count | None = None
    staged: Count | None = None
    stage: str | None = None
    aborted: bool | None = None
    cancelling: Count | None = None
    resources: Count | None = None
    fenced: Count | None = None


class ValuesReply(Reply):
    values: list[Array]


class VariableInfo(Reply):
    name: str
    dtype: str
    shape: list[Dim]
    trainable: bool
    nbytes: Count


class ListReply(Reply):
    variables: list[VariableInfo]


class StepReply(Reply):
    t: Step


class SaveReply(Reply):
    path: str
    bytes: Count


class CallReply(Reply):
    result: Any = None


class ConfigureReply(Reply):
    incarnation: str
    index: Count


class ResultsReply(Reply):
    results: list[tuple[Count, Annotated[int, msgspec.Meta(ge=0, le=2)], Any]]


class JoinReply(Reply):
    index: Count


class MembershipReply(Reply):
    workers: list[dict[str, Any]]


class ResourceReply(Reply):
    rid: Count
    error: dict[str, Any] | None = None


#: The record of each operation's reply (``statistics`` is free-form).
REPLIES: dict[str, type[Reply]] = {
    "health": HealthReply,
    "vars/create": CountReply,
    "vars/read": ValuesReply,
    "vars/delete": CountReply,
    "vars/list": ListReply,
    "vars/update": CountReply,
    "vars/sparse_read": ValuesReply,
    "opt/apply": StepReply,
    "dyn/create": CountReply,
    "dyn/lookup": ValuesReply,
    "dyn/save": SaveReply,
    "dyn/restore": CountReply,
    "ckpt/save": SaveReply,
    "ckpt/restore": CountReply,
    "ckpt/commit": CountReply,
    "ckpt/abort": CountReply,
    "vars/call": CallReply,
    "ps/fence": CountReply,
    "worker/configure": ConfigureReply,
    "worker/run": ResultsReply,
    "worker/cancel": CountReply,
    "worker/reset_channels": CountReply,
    "server/shutdown": CountReply,
    "worker/resource": ResourceReply,
    "worker/drop_resources": CountReply,
    "coordinator/join": JoinReply,
    "coordinator/membership": MembershipReply,
    **{f"vars/{op}": CountReply for op in ("assign", "assign_add", "assign_sub", "scatter_add",
                                           "scatter_sub", "scatter_update")},
}


def check_reply(op: str, payload: Any, task: str) -> Any:
    """``payload`` if it is what ``op`` replies, else ProtocolError (the original is returned:
    callers read the decoded structure).

    >>> check_reply("opt/apply", {"t": 3}, "ps0")
    {'t': 3}
    >>> check_reply("opt/apply", {"t": "3"}, "ps0")
    Traceback (most recent call last):
    ...
    pstrain.errors.ProtocolError: malformed reply to opt/apply from ps0: Expected `int`, got `str` - at `$.t`
    """
    record = REPLIES.get(op)
    if record is not None:
        try:
            msgspec.convert(payload, record, dec_hook=_dec_hook)
        except msgspec.ValidationError as exc:
            raise ProtocolError(f"malformed reply to {op} from {task}: {exc}") from None
    return payload
