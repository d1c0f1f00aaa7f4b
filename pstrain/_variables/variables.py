"""Variables: handles to arrays that live on a parameter server.

Inside ``strategy.scope()`` a :class:`Variable` is placed on a ps and the
object you hold is a handle: every operation is one request to that ps.
Outside any scope it is a local variable of the process with the same API.
Creation is lazy and batched: the handle returns at once, and the
*placement* that made it (``placement.py``) sends one creation request per
ps before anything uses the variable; :func:`ensure_created` is the one
awaitable that guarantees it (every operation here awaits it first).

A handle pickles as a small reference (name, shape, dtype, ps index), so a
closure that captures it ships no data; on a worker it binds to that
worker's channels (``context.current_channels()``).

Inside a scope, ``Variable(...)`` asks the scope's *creator* (see
:func:`creator_scope`) to build the variable.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import enum
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .._base.cluster import task_name
from .._base.context import current_channels, must_await
from .._base.errors import InvalidArgumentError
from .._base.exports import expose
from .._formats.casting import cast_value
from .._formats.initializers import Initializer

if TYPE_CHECKING:
    from .._transport.rpc import Channel, ChannelPool

__all__ = ["IndexedSlices", "Variable", "VariableAggregation", "VariableBase", "VariableCreator",
           "VariableSynchronization", "creator_scope", "current_creator", "ensure_created",
           "read_variables", "update_variables"]


class VariableAggregation(enum.Enum):
    """How updates from several replicas combine (one replica per worker here)."""

    NONE = 0
    SUM = 1
    MEAN = 2
    ONLY_FIRST_REPLICA = 3


class VariableSynchronization(enum.Enum):
    """When replicas' copies agree; every pstrain variable lives once, on its ps."""

    AUTO = 0
    NONE = 1
    ON_WRITE = 2
    ON_READ = 3


class IndexedSlices:
    """Rows of a larger tensor: ``values[i]`` is row ``indices[i]``.

    >>> s = IndexedSlices(np.ones((2, 3)), [0, 4], dense_shape=(5, 3))
    >>> s.values.shape, s.indices.tolist()
    ((2, 3), [0, 4])
    """

    __slots__ = ("values", "indices", "dense_shape")

    def __init__(self, values: Any, indices: Any, dense_shape: Sequence[int] | None = None) -> None:
        self.values = np.asarray(values)
        self.indices = np.asarray(indices)
        if self.indices.dtype.kind not in "iu":
            raise InvalidArgumentError(f"IndexedSlices indices must be integers, got {self.indices.dtype}")
        if self.indices.ndim != 1 or self.values.shape[:1] != self.indices.shape:
            raise InvalidArgumentError(
                f"IndexedSlices needs 1-D indices and one row of values per index; got indices "
                f"{self.indices.shape} and values {self.values.shape}")
        self.dense_shape = tuple(dense_shape) if dense_shape is not None else None

    def __repr__(self) -> str:
        return (f"IndexedSlices(values=<{self.values.shape} {self.values.dtype}>, "
                f"indices=<{self.indices.shape}>, dense_shape={self.dense_shape})")


class VariableCreator(Protocol):
    """What a strategy scope installs: it builds variables and sends their creation.

    ``issued`` counts the creations it has accepted, ``created_upto`` those
    it has sent; a variable with ticket ``t`` exists once ``created_upto >= t``.
    """

    issued: int
    created_upto: int

    def create_variable(self, *args: Any, **kwargs: Any) -> Any: ...

    async def ensure_created(self) -> None: ...


#: The variable creator of the active strategy scope (None outside any scope).
_creator: contextvars.ContextVar[VariableCreator | None] = contextvars.ContextVar(
    "pstrain_variable_creator", default=None)


def current_creator() -> VariableCreator | None:
    """The creator of the innermost active strategy scope (None outside any scope)."""
    return _creator.get()


@contextlib.contextmanager
def creator_scope(creator: VariableCreator | None) -> Iterator[None]:
    """Variables made inside are built by ``creator`` (None: local variables)."""
    token = _creator.set(creator)
    try:
        yield
    finally:
        _creator.reset(token)


class VariableBase:
    """What every variable (whole or sharded) is: ``isinstance(x, VariableBase)``."""

    __slots__ = ()


def infer_dtype(value: Any, dtype: Any) -> np.dtype:
    """TF's defaults: Python floats -> float32, ints -> int32; arrays keep theirs."""
    if dtype is not None:
        return np.dtype(dtype)
    if isinstance(value, (np.ndarray, np.generic)):
        return value.dtype
    arr = np.asarray(value)
    if arr.dtype == np.float64:
        return np.dtype(np.float32)
    if arr.dtype == np.int64:
        return np.dtype(np.int32)
    return arr.dtype


def to_array(value: Any, dtype: np.dtype, what: str) -> np.ndarray:
    """``value`` as an array of ``dtype``; refuses conversions that lose information
    (``casting.py``: float -> int, overflow, out-of-range integers)."""
    if isinstance(value, VariableBase):
        raise InvalidArgumentError(f"{what}: pass an array, not a variable handle "
                                   "(read it first: await v.read_value())")
    arr = value if isinstance(value, np.ndarray) else np.asarray(value)
    if arr.dtype == dtype:
        return arr
    return cast_value(arr, dtype, what)


class Variable(VariableBase):
    """A variable: on a ps when created in ``strategy.scope()``, else local.

    >>> v = Variable(1.0)                      # local: outside any scope
    >>> asyncio.run(v.assign_add(2.0)) is v
    True
    >>> float(asyncio.run(v.read_value()))
    3.0
    """

    __slots__ = ("_name", "_display", "_shape", "_dtype", "_trainable", "_aggregation",
                 "_synchronization", "_ps", "_pool", "_creator", "_ticket", "_local", "_ready",
                 "__weakref__")
    _local: np.ndarray | None

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        creator = _creator.get()
        if creator is not None and cls is Variable:
            return creator.create_variable(*args, **kwargs)  # a placed Variable, or a ShardedVariable
        return super().__new__(cls)

    def __init__(self, initial_value: Any = None, name: str | None = None, dtype: Any = None,
                 shape: Sequence[int] | None = None, trainable: bool = True,
                 aggregation: VariableAggregation | str = VariableAggregation.NONE,
                 synchronization: VariableSynchronization | str = VariableSynchronization.AUTO) -> None:
        if getattr(self, "_ready", False):
            return  # built by a strategy's creator (__new__ returned a handle)
        value = initial_value_array(initial_value, dtype, shape)
        self._setup(name or "Variable", value.shape, value.dtype, trainable, aggregation,
                    synchronization)
        # A local variable owns its memory: never an alias of the caller's array.
        shared = isinstance(initial_value, np.ndarray) and np.may_share_memory(value, initial_value)
        self._local = value.copy() if shared or not value.flags.writeable else value

    def _setup(self, name: str, shape: Sequence[int], dtype: Any, trainable: bool,
               aggregation: Any, synchronization: Any) -> None:
        self._name = name  # the key on the ps
        self._display = name  # the name TF shows (the key without a strategy's qualifier)
        self._shape = tuple(int(d) for d in shape)
        self._dtype = np.dtype(dtype)
        self._trainable = bool(trainable)
        self._aggregation = _enum(VariableAggregation, aggregation, "aggregation")
        self._synchronization = _enum(VariableSynchronization, synchronization, "synchronization")
        self._ps: int | None = None
        self._pool: ChannelPool | None = None  # None: the channels of the running closure
        self._creator: VariableCreator | None = None  # who sends its creation
        self._ticket = 0  # exists once _creator.created_upto >= _ticket
        self._local = None
        self._ready = True

    @classmethod
    def handle(cls, name: str, shape: Sequence[int], dtype: Any, ps: int,
               channels: ChannelPool | None, trainable: bool = True,
               aggregation: Any = VariableAggregation.NONE,
               synchronization: Any = VariableSynchronization.AUTO, *,
               creator: VariableCreator | None = None, ticket: int = 0,
               display_name: str | None = None) -> Variable:
        """A handle to variable ``name`` (its key) on ps ``ps`` (no request is sent).

        ``creator`` and ``ticket``: the variable exists once ``creator`` has
        sent creation ``ticket`` (see :class:`VariableCreator`). ``display_name``:
        the ``name`` it shows, when the key is qualified (a second strategy's).
        """
        self = object.__new__(cls)
        self._setup(name, shape, dtype, trainable, aggregation, synchronization)
        if display_name is not None:
            self._display = display_name
        self._ps = ps
        self._pool = channels
        self._creator = creator
        self._ticket = ticket
        return self

    # -- properties ------------------------------------------------------------------------
    @property
    def name(self) -> str:
        """The name, as TF shows it (a second strategy's variables show theirs unqualified)."""
        return self._display

    @property
    def key(self) -> str:
        """The variable's key on its ps (its name, qualified for a second strategy)."""
        return self._name

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def trainable(self) -> bool:
        return self._trainable

    @property
    def aggregation(self) -> VariableAggregation:
        return self._aggregation

    @property
    def synchronization(self) -> VariableSynchronization:
        return self._synchronization

    @property
    def device(self) -> str:
        if self._ps is None:
            return "/job:chief/replica:0/task:0/device:CPU:0"  # TF: the coordinator's
        return task_name("ps", self._ps) + "/device:CPU:0"

    @property
    def ps_index(self) -> int | None:
        """Index of the ps holding this variable (None for a local variable)."""
        return self._ps

    @property
    def creator(self) -> VariableCreator | None:
        """The placement that sends this variable's creation (None once on a worker, or local)."""
        return self._creator

    def is_created(self) -> bool:
        """Has the creation of this variable been sent (always True for a local one)?"""
        creator = self._creator
        return creator is None or creator.created_upto >= self._ticket

    def wait_for(self, ticket: int) -> None:
        """Operations on this handle first wait for its creator's ``ticket`` (a queued restore)."""
        self._ticket = max(self._ticket, ticket)

    def restore_local(self, value: np.ndarray) -> None:
        """Overwrite a local variable's value in place (a checkpoint restore; same shape)."""
        local = self.local_array()
        local[...] = value

    def local_array(self) -> np.ndarray:
        """The array of a local variable itself (not a copy): ``extended.update`` changes it in place."""
        if self._local is None:
            raise InvalidArgumentError(f"variable {self._name!r} lives on {self.device}; it has "
                                       "no local array (read it with await v.read_value())")
        return self._local

    @property
    def size(self) -> int:
        return int(np.prod(self._shape, dtype=np.int64))

    def __repr__(self) -> str:
        return (f"<pstrain.Variable {self._name!r} shape={self._shape} dtype={self._dtype} "
                f"device={self.device}>")

    def __reduce__(self) -> Any:
        if self._ps is None:
            return (_local_variable, (self._name, self._local, self._trainable))
        return (_remote_handle, (self._name, self._shape, self._dtype.str, self._ps,
                                 self._trainable, self._aggregation.value,
                                 self._synchronization.value, self._display))

    # -- transport -------------------------------------------------------------------------
    def channel(self) -> Channel:
        """The channel to this variable's ps on the running loop (for batched requests)."""
        if self._ps is None:
            raise InvalidArgumentError(f"variable {self._name!r} is local; it has no ps")
        pool = self._pool if self._pool is not None else current_channels()
        return pool.channel("ps", self._ps)

    async def _call(self, op: str, payload: Any) -> Any:
        creator = self._creator
        if creator is not None and creator.created_upto < self._ticket:
            await creator.ensure_created()
        return await self.channel().call(op, payload)

    def checked_value(self, value: Any, what: str) -> np.ndarray:
        """``value`` as an array of this variable's dtype and shape, or InvalidArgumentError."""
        arr = to_array(value, self._dtype, f"{what} of variable {self._name!r}")
        if arr.shape != self._shape:
            raise InvalidArgumentError(f"{what} of variable {self._name!r}: value has shape "
                                       f"{arr.shape}, expected {self._shape}")
        return arr

    # -- operations ------------------------------------------------------------------------
    @must_await
    async def read_value(self) -> np.ndarray:
        """The current value, as a numpy array."""
        if self._ps is None:
            return self._local.copy()  # type: ignore[union-attr]
        reply = await self._call("vars/read", {"names": [self._name]})
        return reply["values"][0]

    @must_await
    async def numpy(self) -> Any:
        """The current value; a numpy scalar for a scalar variable (like TF)."""
        value = await self.read_value()
        return value[()] if value.ndim == 0 else value

    @must_await
    async def assign(self, value: Any) -> Variable:
        """Set the value (same shape; dtype cast within its kind)."""
        return await self._update("assign", value)

    @must_await
    async def assign_add(self, delta: Any) -> Variable:
        """Add ``delta`` atomically on the ps."""
        return await self._update("assign_add", delta)

    @must_await
    async def assign_sub(self, delta: Any) -> Variable:
        """Subtract ``delta`` atomically on the ps."""
        return await self._update("assign_sub", delta)

    async def _update(self, op: str, value: Any) -> Variable:
        arr = self.checked_value(value, op)
        if self._ps is None:
            local = self._local
            assert local is not None
            if op == "assign":
                self._local = arr.copy()
            elif op == "assign_add":
                local += arr
            else:
                local -= arr
            return self
        await self._call(f"vars/{op}", {"name": self._name, "value": arr})
        return self

    def _rows(self, indices: Any, what: str) -> np.ndarray:
        idx = np.asarray(indices)
        if idx.dtype.kind not in "iu":
            raise InvalidArgumentError(f"{what} of variable {self._name!r}: row ids must be "
                                       f"integers, got {idx.dtype}")
        if not self._shape:
            raise InvalidArgumentError(f"{what}: variable {self._name!r} is a scalar and has no rows")
        return idx

    @must_await
    async def sparse_read(self, indices: Any) -> np.ndarray:
        """Rows ``indices`` (any shape of ids) -> ``indices.shape + shape[1:]``."""
        idx = self._rows(indices, "sparse_read")
        if self._ps is None:
            _check_range(idx, self._shape[0], self._name)
            return self._local[idx]  # type: ignore[index]
        reply = await self._call("vars/sparse_read", {"name": self._name, "indices": idx})
        return reply["values"][0]

    @must_await
    async def scatter_add(self, sparse_delta: IndexedSlices) -> Variable:
        """Add rows (duplicate ids add up)."""
        return await self._scatter("scatter_add", sparse_delta)

    @must_await
    async def scatter_sub(self, sparse_delta: IndexedSlices) -> Variable:
        """Subtract rows (duplicate ids add up)."""
        return await self._scatter("scatter_sub", sparse_delta)

    @must_await
    async def scatter_update(self, sparse_delta: IndexedSlices) -> Variable:
        """Replace rows."""
        return await self._scatter("scatter_update", sparse_delta)

    async def _scatter(self, op: str, delta: IndexedSlices) -> Variable:
        if not isinstance(delta, IndexedSlices):
            raise InvalidArgumentError(f"{op} takes an IndexedSlices, got {type(delta).__name__}")
        idx = self._rows(delta.indices, op)
        values = to_array(delta.values, self._dtype, f"{op} of variable {self._name!r}")
        expected = (idx.shape[0],) + self._shape[1:]
        if values.shape != expected:
            raise InvalidArgumentError(f"{op} of variable {self._name!r}: values have shape "
                                       f"{values.shape}, expected {expected}")
        if self._ps is None:
            _check_range(idx, self._shape[0], self._name)
            if op == "scatter_update":
                self._local[idx] = values  # type: ignore[index]
            else:
                np.add.at(self._local, idx, values if op == "scatter_add" else -values)  # type: ignore[arg-type]
            return self
        await self._call(f"vars/{op}", {"name": self._name, "indices": idx, "values": values})
        return self


def _check_range(idx: np.ndarray, n: int, name: str) -> None:
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
        bad = idx[(idx < 0) | (idx >= n)].reshape(-1)[0]
        raise InvalidArgumentError(f"variable {name!r}: row id {int(bad)} out of range [0, {n})")


def _enum(cls: Any, value: Any, what: str) -> Any:
    if isinstance(value, cls):
        return value
    try:
        return cls[str(value).upper()]
    except KeyError:
        raise InvalidArgumentError(f"unknown {what} {value!r}; one of {[m.name for m in cls]}") from None


def initial_value_array(initial_value: Any, dtype: Any, shape: Sequence[int] | None) -> np.ndarray:
    """Evaluate an initial value locally (array-like, initializer or callable)."""
    if initial_value is None:
        raise InvalidArgumentError("Variable needs an initial_value")
    if isinstance(initial_value, Initializer):
        if shape is None:
            raise InvalidArgumentError(f"{initial_value!r} needs shape= to build a variable")
        return initial_value(shape, np.dtype(dtype) if dtype is not None else np.float32)
    if callable(initial_value) and not isinstance(initial_value, VariableBase):
        initial_value = initial_value()
    value = to_array(initial_value, infer_dtype(initial_value, dtype), "initial_value")
    if shape is not None and tuple(shape) != value.shape:
        raise InvalidArgumentError(f"initial_value has shape {value.shape}, shape= says {tuple(shape)}")
    return value


def _remote_handle(name: str, shape: tuple[int, ...], dtype: str, ps: int, trainable: bool,
                   aggregation: int, synchronization: int, display: str | None = None) -> Variable:
    return Variable.handle(name, shape, dtype, ps, None, trainable,
                           VariableAggregation(aggregation), VariableSynchronization(synchronization),
                           display_name=display)


def _local_variable(name: str, value: np.ndarray, trainable: bool) -> Variable:
    with creator_scope(None):
        return Variable(np.array(value), name=name, trainable=trainable)


async def ensure_created(variables: Iterable[Any]) -> None:
    """Wait until every one of ``variables`` (sharded ones included) exists on its ps.

    Every operation of a variable does this itself; call it before sending
    requests of your own (``channel().call``) for variables just created.
    """
    creators: dict[int, VariableCreator] = {}
    for v in variables:
        for part in getattr(v, "variables", None) or [v]:
            creator = getattr(part, "creator", None)
            if creator is not None and not part.is_created():
                creators[id(creator)] = creator
    for creator in creators.values():
        await creator.ensure_created()


@must_await
async def read_variables(variables: Iterable[Any]) -> list[np.ndarray]:
    """Read many variables with one request per ps, concurrently.

    >>> w, b = Variable([1.0, 2.0]), Variable(3)       # local variables: no cluster needed
    >>> [a.tolist() for a in asyncio.run(read_variables([w, b]))]
    [[1.0, 2.0], 3]
    """
    variables = list(variables)
    out: list[Any] = [None] * len(variables)
    groups: dict[Channel, list[int]] = {}
    sharded: list[tuple[int, Any]] = []
    for i, v in enumerate(variables):
        if not isinstance(v, VariableBase):
            raise InvalidArgumentError(f"read_variables takes variables, got {type(v).__name__}")
        if not isinstance(v, Variable):  # a ShardedVariable: read its parts, then join
            sharded.append((i, v))
        elif v.ps_index is None:
            out[i] = v.local_array().copy()
        else:
            groups.setdefault(v.channel(), []).append(i)
    await ensure_created(variables[i] for indices in groups.values() for i in indices)

    async def read_group(channel: Channel, indices: list[int]) -> None:
        names = list(dict.fromkeys(variables[i].key for i in indices))  # each read once
        reply = await channel.call("vars/read", {"names": names})
        got = dict(zip(names, reply["values"]))
        for i in indices:
            out[i] = got[variables[i].key]

    await asyncio.gather(*(read_group(ch, idx) for ch, idx in groups.items()),
                         *(_read_sharded(out, i, v) for i, v in sharded))
    return out


@must_await
async def update_variables(updates: Iterable[tuple[Variable, str, Any]]) -> None:
    """Apply ``(variable, op, value)`` updates with one request per ps, all or nothing per ps.

    ``op`` is ``assign``, ``assign_add`` or ``assign_sub``.

    >>> total, count = Variable(0.0), Variable(0.0)
    >>> asyncio.run(update_variables([(total, "assign_add", 3.0), (count, "assign_add", 1.0)]))
    >>> float(asyncio.run(total.numpy())), float(asyncio.run(count.numpy()))
    (3.0, 1.0)
    """
    groups: dict[Channel, list[dict[str, Any]]] = {}
    local = []
    placed = []
    for var, op, value in updates:
        if op not in ("assign", "assign_add", "assign_sub"):
            raise InvalidArgumentError(f"update_variables: unknown op {op!r}")
        if not isinstance(var, Variable):
            raise InvalidArgumentError(f"update_variables takes Variables, got {type(var).__name__}")
        arr = var.checked_value(value, op)
        if var.ps_index is None:
            local.append((var, op, arr))
            continue
        placed.append(var)
        groups.setdefault(var.channel(), []).append({"op": op, "name": var.key, "value": arr})
    for var, op, arr in local:
        await getattr(var, op)(arr)
    await ensure_created(placed)
    await asyncio.gather(*(ch.call("vars/update", {"updates": entries})
                           for ch, entries in groups.items()))


async def _read_sharded(out: list[Any], i: int, v: Any) -> None:
    out[i] = await v.read_value()


expose(globals(), "pstrain", ['IndexedSlices', 'Variable', 'VariableAggregation', 'VariableSynchronization', 'read_variables', 'update_variables'])
