"""The building blocks of every operation's messages: field types, the request base
classes, the reply records, and the one conversion at each edge.

A request body is decoded by ``wire`` (arrays stay numpy views), then converted to its
operation's class with msgspec, which checks field names (unknown ones are refused),
types (a string where a list of names is due is refused), ranges and sizes, all before a
handler runs and so before any state is touched. A refusal is an
:class:`~pstrain.errors.InvalidArgumentError` naming the operation and the field
(``vars/delete: Expected `array`, got `str` - at `$.names```).

Arrays are ``np.ndarray`` fields (a numpy scalar is accepted as a 0-d array); lists of
numbers are not arrays. Replies are declared too and converted by the client
(:func:`convert_reply`) before anyone reads them: a reply of the wrong shape is a
:class:`~pstrain.errors.ProtocolError`, not a ``KeyError`` later.

The operations themselves (each request class, its op name and its reply) are declared
in :mod:`pstrain._formats.messages.operations`.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Generic, Literal, TypeVar, get_args, get_origin

import msgspec
import numpy as np

from ..._base.errors import InvalidArgumentError, ProtocolError
from ..._base.tags import read_tags, sender_owner, update_tags
from .closures import ClosureStatus

__all__ = [
    "AsOf",
    "FreeForm",
    "Mutation",
    "OptimizerRule",
    "Operation",
    "Owned",
    "Record",
    "Reply",
    "TableSpec",
    "convert_reply",
    "sender_fields",
    "validate",
]

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
DType = Annotated[str, msgspec.Meta(min_length=1, max_length=32)]
Dim = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
Shape = Annotated[list[Dim], msgspec.Meta(max_length=32)]
Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 62)]
Step = Annotated[int, msgspec.Meta(ge=1, le=1 << 62)]
Path = Annotated[str, msgspec.Meta(min_length=1, max_length=4096)]
Array = np.ndarray
#: The coordinator incarnation (its strategy's owner id) an update works for.
Owner = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
#: ``[worker index, epoch]``: which dispatch of which worker sent an update (fencing).
Fence = tuple[Annotated[int, msgspec.Meta(ge=0)], Annotated[int, msgspec.Meta(ge=0)]]
#: ``[closure key, sequence]``: an exactly-once closure's n-th update to this ps.
Once = tuple[Annotated[str, msgspec.Meta(min_length=1, max_length=96)], Annotated[int, msgspec.Meta(ge=1)]]
#: ``[closure key, operations begun]``: a read of an exactly-once closure that had begun
#: that many of its operations (a rerun reads what its first attempt read: ``before_images``).
AsOf = tuple[Annotated[str, msgspec.Meta(min_length=1, max_length=96)], Annotated[int, msgspec.Meta(ge=0)]]


class Record(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Base of every request record and of the records inside one: unknown fields are
    refused."""


class Reply(msgspec.Struct, omit_defaults=True):
    """Base of reply records. Unknown fields are allowed: a newer server may add some."""


#: An operation's reply: a :class:`Reply` record, or a free-form mapping (``statistics``).
R = TypeVar("R", covariant=True)
#: The reply of a free-form operation (counters for ``pstrain status``, a table's export).
FreeForm = dict[str, Any]


class Operation(Record, Generic[R], tag_field="op", kw_only=True):
    """One operation, declared once: ``class ReadVariables(Operation[ValuesReply],
    tag="vars/read")``. Its msgspec tag is the op name, its type parameter the class its
    reply converts to (``reply``, set from it; ``FreeForm``: a mapping left as it is),
    ``pickle`` whether its body may carry pickles (it runs code), ``stream`` whether its
    handler sends partial replies, ``pickle_failures_kept`` whether an object of its
    request or reply that cannot be unpickled where it arrives stands as a
    ``wire.PickleFailure`` (a closure's arguments or result: that closure fails alone)
    rather than failing the whole message. The op name travels in the frame
    (or the URL), not in the body: a body without the tag is that operation's.

    Both ends are typed by the parameter: ``await channel.request(ReadVariables(...))`` is
    a ``ValuesReply``, and a handler routed to ``ReadVariables`` must return one.
    """

    reply: ClassVar[type[Reply] | None] = None
    pickle: ClassVar[bool] = False
    stream: ClassVar[bool] = False
    pickle_failures_kept: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for base in getattr(cls, "__orig_bases__", ()):
            args = get_args(base)
            if get_origin(base) is not None and args and not isinstance(args[0], TypeVar):
                reply = args[0]
                cls.reply = reply if isinstance(reply, type) and issubclass(reply, Reply) else None

    @classmethod
    def op(cls) -> str:
        tag = cls.__struct_config__.tag
        assert isinstance(tag, str), f"{cls.__name__} is not an operation (no tag)"
        return tag

    def received(self) -> Any:
        """This request as its handler takes it, once decoded and checked where it arrived
        (an ``opt/apply``'s packed gradients become entries of its ``grads``); raises
        InvalidArgumentError for what the declared types cannot say."""
        return self


class Owned(Operation[R], kw_only=True):
    """An operation that names the coordinator incarnation it works for (a move's steps, a
    new map, a restore, a table lookup; the channel fills it in), so a ps refuses it once
    a newer coordinator took that one over."""

    owner: Owner | None = None


class Mutation(Owned[R], kw_only=True):
    """An operation that changes variables: it carries who sent it, fenced per coordinator
    incarnation and worker dispatch, and, from an exactly-once closure, its key and
    position (the channel fills these in from the sender's context)."""

    fence: Fence | None = None
    once: Once | None = None


def sender_fields(operation: type[Operation[Any]], task: str, owner: str | None) -> dict[str, Any]:
    """What an operation sent to ``task`` by ``owner`` (a coordinator incarnation) carries
    of its sender: an update its owner and, in a closure, its dispatch's fence and its
    exactly-once key; another operation that names its coordinator (a move's step, a
    table lookup) the owner, in a closure the one that dispatched it; a read in an
    exactly-once closure its key and how many operations it had begun (``as_of``)."""
    if issubclass(operation, Mutation):
        return update_tags(task, owner)
    fields = read_tags() if "as_of" in operation.__struct_fields__ else {}
    if issubclass(operation, Owned) and (sender := sender_owner(owner)) is not None:
        fields["owner"] = sender
    return fields


# -- records inside requests ---------------------------------------------------------------------
Positive = Annotated[float, msgspec.Meta(gt=0)]
NonNegative = Annotated[float, msgspec.Meta(ge=0)]
Fraction = Annotated[float, msgspec.Meta(ge=0, le=1)]


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
    alpha: Fraction = 0.0
    warmup_target: Positive | None = None
    warmup_steps: NonNegative = 0.0


class CosineDecayRestartsSpec(Record, tag="cosine_decay_restarts", tag_field="type"):
    initial_learning_rate: Positive
    first_decay_steps: Positive
    t_mul: Positive = 2.0
    m_mul: NonNegative = 1.0
    alpha: Fraction = 0.0


class InverseTimeDecaySpec(Record, tag="inverse_time_decay", tag_field="type"):
    initial_learning_rate: Positive
    decay_steps: Positive
    decay_rate: NonNegative
    staircase: bool = False


class PolynomialDecaySpec(Record, tag="polynomial_decay", tag_field="type"):
    initial_learning_rate: Positive
    decay_steps: Positive
    end_learning_rate: NonNegative = 0.0001
    power: Positive = 1.0
    cycle: bool = False


Schedule = (
    ExponentialDecaySpec
    | PiecewiseConstantSpec
    | CosineDecaySpec
    | CosineDecayRestartsSpec
    | InverseTimeDecaySpec
    | PolynomialDecaySpec
)


class OptimizerRule(Record):
    kind: Literal["sgd", "adagrad", "rowwise_adagrad", "adam", "adamw", "ftrl", "rmsprop"]
    learning_rate: Positive | Schedule
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
    amsgrad: bool | None = None


class TableSpec(Record):
    """A dynamic table's fixed configuration (see ``pstrain.server.ps.tables.dynamic_table``)."""

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


# -- replies ----------------------------------------------------------------------------------------
class HealthReply(Reply):
    status: str
    task: str
    role: str | None = None
    index: int | None = None
    pid: int | None = None
    uptime_s: float | None = None
    incarnation: str | None = None


class EmptyReply(Reply):
    """Done, with nothing to say (``worker/reset_channels``, ``server/shutdown``)."""


class CreatedReply(Reply):
    """``vars/create`` and ``dyn/create``: what was created (0: it existed already)."""

    created: Count


class DeletedReply(Reply):
    deleted: Count


class UpdatedReply(Reply):
    """``vars/update`` and the one-variable updates: the updates applied."""

    updated: Count


class FencedReply(Reply):
    """``ps/fence``: the epoch the worker's updates are fenced below now."""

    fenced: Count


class CancelReply(Reply):
    """``worker/cancel``: the closures in flight that were told to stop."""

    cancelling: Count


class DroppedReply(Reply):
    """``worker/drop_resources``: the resources the worker still holds."""

    resources: Count


class HurriedReply(Reply):
    """``delta/hurry``: the spread writes told to go at once."""

    hurried: Count


class RestoreReply(Reply):
    """``ckpt/restore`` and ``dyn/restore``: values restored now, or staged as ``stage``
    (committed or aborted later)."""

    restored: Count | None = None
    staged: Count | None = None
    stage: str | None = None


class CommitReply(Reply):
    """``ckpt/commit``: what the staged restore put in place, and the ps's incarnation,
    which now holds restored state."""

    restored: Count
    incarnation: str


class AbortReply(Reply):
    """``ckpt/abort``: whether anything was staged to drop."""

    aborted: bool


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
    #: the steps of an ``opt/apply``'s ``more``, in order
    more: list[Step] | None = None


class SaveReply(Reply):
    path: str
    bytes: Count
    #: rows written of each table shard saved with the variables (``ckpt/save``'s ``tables``)
    table_rows: dict[str, Count] = {}
    #: files each of those shards linked rather than wrote (``_formats/files/table_links.py``)
    table_links: dict[str, Count] = {}


class CallReply(Reply):
    result: Any = None


class ConfigureReply(Reply):
    incarnation: str
    index: Count


class ClosureCall(Record, array_like=True):
    """One closure of a ``worker/run`` batch: its id, its function's digest (the function
    travels once per worker, in ``fns``), its arguments, and whether they hold resource
    references. On the wire an array, in this order."""

    id: Count
    fn: bytes
    args: Any
    kwargs: Any
    has_refs: bool = False


class ClosureResult(Reply, array_like=True):
    """How one closure ended (``status``) and its value: what it returned, the exception it
    raised (as :func:`~pstrain._formats.messages.closures.exception_payload` made it), or
    None (cancelled). On the wire an array, in this order."""

    id: Count
    status: ClosureStatus
    value: Any = None


class ResultsReply(Reply):
    results: list[ClosureResult]
    #: scalars closures logged with ``pstrain.summary``: ``[name, value, step, wall_time]``
    #: (each checked where it is recorded: one malformed scalar does not lose the results)
    scalars: list[Annotated[list[Any], msgspec.Meta(max_length=4)]] | None = None
    #: the worker is draining (SIGTERM): it takes no new closures and leaves once these are
    #: back, so its going is no failure even if a batch was already on its way to it
    leaving: bool = False


class ResourceReply(Reply):
    rid: Count
    error: dict[str, Any] | None = None


class JoinReply(Reply):
    index: Count


class MembershipReply(Reply):
    workers: list[dict[str, Any]]
    #: the placement map: its version, each ps's address and share, the move under way
    ps: dict[str, Any] | None = None


# -- the conversions at each edge -------------------------------------------------------------------
def _dec_hook(tp: type, obj: Any) -> Any:
    if tp is np.ndarray:
        if isinstance(obj, np.ndarray):
            return obj
        if isinstance(obj, np.generic):
            return np.asarray(obj)
        raise ValueError(f"expected an array, got {type(obj).__name__}")
    raise ValueError(f"unsupported type {tp!r}")


def convert(payload: Any, record: type[Any]) -> Any:
    """``msgspec.convert(payload, record)``, raising ``msgspec.ValidationError`` for every
    payload that does not fit.

    msgspec 0.23 reads a Struct's fields from any object with ``__getitem__``, so an array or
    a numpy scalar sent where an object belongs raises numpy's ``IndexError`` out of msgspec
    instead of a ValidationError. That is the sender's fault, and reported as msgspec reports
    the others.

    >>> convert(np.zeros(2), TableSpec)
    Traceback (most recent call last):
    ...
    msgspec.ValidationError: Expected `object`, got `numpy.ndarray`
    """
    try:
        return msgspec.convert(payload, record, dec_hook=_dec_hook)
    except msgspec.ValidationError:
        raise
    except (IndexError, KeyError, ValueError) as exc:
        if isinstance(payload, np.ndarray | np.generic):
            got = f"`numpy.{type(payload).__name__}`"
        else:
            got = "an array or a numpy scalar in one of its fields"
        raise msgspec.ValidationError(f"Expected `object`, got {got}") from exc


def validate(op: str, record: type[Record], payload: Any) -> Any:
    """``payload`` as ``record``, or InvalidArgumentError naming the op and the field.

    >>> from pstrain._formats.messages.operations import DeleteVariables, ReadVariables
    >>> validate("vars/read", ReadVariables, {"names": ["w"], "as_of": ["k", 0]})
    ReadVariables(names=['w'], as_of=('k', 0))
    >>> validate("vars/delete", DeleteVariables, {"names": "w"})
    Traceback (most recent call last):
    ...
    pstrain.errors.InvalidArgumentError: vars/delete: Expected `array`, got `str` - at `$.names`
    """
    if payload is None and not record.__struct_fields__:
        return record()
    try:
        return convert(payload, record)
    except msgspec.ValidationError as exc:
        raise InvalidArgumentError(f"{op}: {exc}") from None


def convert_reply(op: str, record: type[Reply] | None, payload: Any, task: str) -> Any:
    """``payload`` as ``record`` (a free-form reply, ``record`` None, as it is), else
    ProtocolError naming the op, the peer and the field.

    >>> convert_reply("opt/apply", StepReply, {"t": 3}, "ps0")
    StepReply(t=3, more=None)
    >>> convert_reply("opt/apply", StepReply, {"t": "3"}, "ps0")
    Traceback (most recent call last):
    ...
    pstrain.errors.ProtocolError: malformed reply to opt/apply from ps0: Expected `int`, got `str` - at `$.t`
    """
    if record is None:
        return payload
    try:
        return convert(payload, record)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"malformed reply to {op} from {task}: {exc}") from None
