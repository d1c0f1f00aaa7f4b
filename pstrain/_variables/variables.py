"""Variables: handles to arrays that live on a parameter server.

Inside ``strategy.scope()`` a :class:`Variable` is placed on a ps and the
object you hold is a handle: every operation is one request to that ps.
Outside any scope it is a local variable of the process with the same API.
Creation is lazy and batched: the handle returns at once, and the
*placement* that made it (``placement.py``) sends one creation request per
ps before anything uses the variable; ``batched.ensure_created`` is the one
awaitable that guarantees it (every operation here awaits it first).

A handle pickles as a small reference (name, shape, dtype, ps index), so a
closure that captures it ships no data; on a worker it binds to that
worker's channels (``context.current_channels()``).

Inside a scope, ``Variable(...)`` asks the scope's *creator* (see
``arrays.creator_scope``) to build the variable. Many variables are read or updated in
one request per ps with ``batched.py``.
"""

from __future__ import annotations

import asyncio  # noqa: F401 - the doctests use it
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._base.checks import variable_name
from .._base.cluster import task_name
from .._base.context import current_channels, must_await
from .._base.errors import InvalidArgumentError, PstrainError
from .._base.exports import expose, internal
from .._formats.messages.operations import SINGLE_UPDATES, ReadVariables, SparseRead, UpdateKind
from .._formats.messages.records import Operation, R
from .._formats.numerics import scatter as scatter_rule
from .arrays import (
    IndexedSlices,
    VariableAggregation,
    VariableBase,
    VariableCreator,
    VariableSynchronization,
    as_enum,
    check_range,
    creator_scope,
    current_creator,
    initial_value_array,
    to_array,
)
from .routing import routed

if TYPE_CHECKING:
    from .._transport.channels import Channel, ChannelPool

__all__ = ["Variable"]


class Variable(VariableBase):
    """A variable: on a ps when created in ``strategy.scope()``, else local.

    >>> v = Variable(1.0)                      # local: outside any scope
    >>> asyncio.run(v.assign_add(2.0)) is v
    True
    >>> float(asyncio.run(v.read_value()))
    3.0
    """

    __slots__ = (
        "_name",
        "_display",
        "_shape",
        "_dtype",
        "_trainable",
        "_aggregation",
        "_synchronization",
        "_ps",
        "_pool",
        "_creator",
        "_ticket",
        "_local",
        "_ready",
        "__weakref__",
    )
    _local: np.ndarray | None

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        creator = current_creator()
        if creator is not None and cls is Variable:
            return creator.create_variable(*args, **kwargs)  # a placed Variable, or a ShardedVariable
        return super().__new__(cls)

    def __init__(
        self,
        initial_value: Any = None,
        name: str | None = None,
        dtype: Any = None,
        shape: Sequence[int] | None = None,
        trainable: bool = True,
        aggregation: VariableAggregation | str = VariableAggregation.NONE,
        synchronization: VariableSynchronization | str = VariableSynchronization.AUTO,
    ) -> None:
        if getattr(self, "_ready", False):
            return  # built by a strategy's creator (__new__ returned a handle)
        variable_name(name)
        value = initial_value_array(initial_value, dtype, shape)
        self._setup(name or "Variable", value.shape, value.dtype, trainable, aggregation, synchronization)
        # A local variable owns its memory: never an alias of the caller's array.
        shared = isinstance(initial_value, np.ndarray) and np.may_share_memory(value, initial_value)
        self._local = value.copy() if shared or not value.flags.writeable else value

    def _setup(
        self,
        name: str,
        shape: Sequence[int],
        dtype: Any,
        trainable: bool,
        aggregation: Any,
        synchronization: Any,
    ) -> None:
        self._name = name  # the key on the ps
        self._display = name  # the name TF shows (the key without a strategy's qualifier)
        self._shape = tuple(int(d) for d in shape)
        self._dtype = np.dtype(dtype)
        self._trainable = bool(trainable)
        self._aggregation = as_enum(VariableAggregation, aggregation, "aggregation")
        self._synchronization = as_enum(VariableSynchronization, synchronization, "synchronization")
        self._ps: int | None = None
        self._pool: ChannelPool | None = None  # None: the channels of the running closure
        self._creator: VariableCreator | None = None  # who sends its creation
        self._ticket = 0  # exists once _creator.created_upto >= _ticket
        self._local = None
        self._ready = True

    @classmethod
    def handle(
        cls,
        name: str,
        shape: Sequence[int],
        dtype: Any,
        ps: int,
        channels: ChannelPool | None,
        trainable: bool = True,
        aggregation: Any = VariableAggregation.NONE,
        synchronization: Any = VariableSynchronization.AUTO,
        *,
        creator: VariableCreator | None = None,
        ticket: int = 0,
        display_name: str | None = None,
    ) -> Variable:
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
    @internal
    def key(self) -> str:
        """The variable's key on its ps (its name, qualified for a second strategy)."""
        return self._name

    @property
    def shape(self) -> tuple[int, ...]:
        """The variable's shape."""
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        """The element type."""
        return self._dtype

    @property
    def trainable(self) -> bool:
        """Whether ``trainable_variables`` lists it."""
        return self._trainable

    @property
    def aggregation(self) -> VariableAggregation:
        """How replicas' updates combine (TF's ``VariableAggregation``; kept for TF's API)."""
        return self._aggregation

    @property
    def synchronization(self) -> VariableSynchronization:
        """TF's ``VariableSynchronization`` (kept for TF's API)."""
        return self._synchronization

    @property
    def device(self) -> str:
        """The device name of the ps holding it (``/job:ps/replica:0/task:<i>/device:CPU:0``; the
        coordinator's for a variable made outside a strategy)."""
        if self._ps is None:
            return "/job:chief/replica:0/task:0/device:CPU:0"  # TF: the coordinator's
        return task_name("ps", self._ps) + "/device:CPU:0"

    @property
    @internal
    def ps_index(self) -> int | None:
        """Index of the ps holding this variable now (None for a local variable): where it
        was created unless an elastic ps change moved it (the placement map says)."""
        if self._ps is None:
            return None
        try:
            pool = self.channels()
        except PstrainError:  # no closure running: the map of this process is unknown
            return self._ps
        return pool.session.routes.moved.get(self._name, self._ps)

    @property
    @internal
    def home_ps(self) -> int | None:
        """Index of the ps this variable was created on (None for a local variable)."""
        return self._ps

    @property
    @internal
    def creator(self) -> VariableCreator | None:
        """The placement that sends this variable's creation (None once on a worker, or local)."""
        return self._creator

    @internal
    def is_created(self) -> bool:
        """Has the creation of this variable been sent (always True for a local one)?"""
        creator = self._creator
        return creator is None or creator.created_upto >= self._ticket

    @internal
    def wait_for(self, ticket: int) -> None:
        """Operations on this handle first wait for its creator's ``ticket`` (a queued restore)."""
        self._ticket = max(self._ticket, ticket)

    @internal
    def restore_local(self, value: np.ndarray) -> None:
        """Overwrite a local variable's value in place (a checkpoint restore; same shape)."""
        local = self.local_array()
        local[...] = value

    @internal
    def local_array(self) -> np.ndarray:
        """The array of a local variable itself (not a copy): ``extended.update`` changes it in place."""
        if self._local is None:
            raise InvalidArgumentError(
                f"variable {self._name!r} lives on {self.device}; it has "
                "no local array (read it with await v.read_value())"
            )
        return self._local

    @property
    def size(self) -> int:
        """The number of elements."""
        return int(np.prod(self._shape, dtype=np.int64))

    def __repr__(self) -> str:
        return (
            f"<pstrain.Variable {self._name!r} shape={self._shape} dtype={self._dtype} device={self.device}>"
        )

    def __reduce__(self) -> Any:
        if self._ps is None:
            return (_local_variable, (self._name, self._local, self._trainable))
        return (
            _remote_handle,
            (
                self._name,
                self._shape,
                self._dtype.str,
                self._ps,
                self._trainable,
                self._aggregation.value,
                self._synchronization.value,
                self._display,
            ),
        )

    # -- transport -------------------------------------------------------------------------
    @internal
    def channel(self) -> Channel:
        """The channel to this variable's ps on the running loop (for batched requests)."""
        if self._ps is None:
            raise InvalidArgumentError(f"variable {self._name!r} is local; it has no ps")
        pool = self._pool if self._pool is not None else current_channels()
        return pool.channel("ps", pool.session.routes.moved.get(self._name, self._ps))

    @internal
    def channels(self) -> ChannelPool:
        """The channel pool this handle uses on the running loop (its placement map too)."""
        return self._pool if self._pool is not None else current_channels()

    async def _request(self, message: Operation[R]) -> R:
        creator = self._creator
        if creator is not None and creator.created_upto < self._ticket:
            await creator.ensure_created()

        async def send(channel: Channel, _: Any) -> Any:
            return await channel.request(message)

        (reply,) = await routed(self.channels(), (self,), Variable.channel, send)
        return reply

    @internal
    def checked_value(self, value: Any, what: str) -> np.ndarray:
        """``value`` as an array of this variable's dtype and shape, or InvalidArgumentError."""
        arr = to_array(value, self._dtype, f"{what} of variable {self._name!r}")
        if arr.shape != self._shape:
            raise InvalidArgumentError(
                f"{what} of variable {self._name!r}: value has shape {arr.shape}, expected {self._shape}"
            )
        return arr

    # -- operations ------------------------------------------------------------------------
    @must_await
    async def read_value(self) -> np.ndarray:
        """The current value, as a numpy array."""
        if self._ps is None:
            return self._local.copy()  # type: ignore[union-attr]
        reply = await self._request(ReadVariables(names=[self._name]))
        return reply.values[0]

    @must_await
    async def numpy(self) -> Any:
        """The current value; a numpy scalar for a scalar variable (like TF)."""
        value = await self.read_value()
        return value[()] if value.ndim == 0 else value

    @must_await
    async def assign(self, value: Any) -> Variable:
        """Set the value (same shape; dtype cast within its kind)."""
        return await self._update(UpdateKind.ASSIGN, value)

    @must_await
    async def assign_add(self, delta: Any) -> Variable:
        """Add ``delta`` atomically on the ps."""
        return await self._update(UpdateKind.ASSIGN_ADD, delta)

    @must_await
    async def assign_sub(self, delta: Any) -> Variable:
        """Subtract ``delta`` atomically on the ps."""
        return await self._update(UpdateKind.ASSIGN_SUB, delta)

    async def _update(self, kind: UpdateKind, value: Any) -> Variable:
        op = kind.value
        arr = self.checked_value(value, op)
        if self._ps is None:
            local = self._local
            assert local is not None
            if kind is UpdateKind.ASSIGN:
                self._local = arr.copy()
            elif kind is UpdateKind.ASSIGN_ADD:
                local += arr
            else:
                local -= arr
            return self
        await self._request(SINGLE_UPDATES[kind](name=self._name, value=arr))
        return self

    def _rows(self, indices: Any, what: str) -> np.ndarray:
        idx = np.asarray(indices)
        if idx.dtype.kind not in "iu":
            raise InvalidArgumentError(
                f"{what} of variable {self._name!r}: row ids must be integers, got {idx.dtype}"
            )
        if not self._shape:
            raise InvalidArgumentError(f"{what}: variable {self._name!r} is a scalar and has no rows")
        return idx

    @must_await
    async def sparse_read(self, indices: Any) -> np.ndarray:
        """Rows ``indices`` (any shape of ids) -> ``indices.shape + shape[1:]``."""
        idx = self._rows(indices, "sparse_read")
        if self._ps is None:
            check_range(idx, self._shape[0], self._name)
            return self._local[idx]  # type: ignore[index]
        reply = await self._request(SparseRead(name=self._name, indices=idx))
        return reply.values[0]

    @must_await
    async def scatter_add(self, sparse_delta: IndexedSlices) -> Variable:
        """Add rows (duplicate ids add up)."""
        return await self._scatter(UpdateKind.SCATTER_ADD, sparse_delta)

    @must_await
    async def scatter_sub(self, sparse_delta: IndexedSlices) -> Variable:
        """Subtract rows (duplicate ids add up)."""
        return await self._scatter(UpdateKind.SCATTER_SUB, sparse_delta)

    @must_await
    async def scatter_mul(self, sparse_delta: IndexedSlices) -> Variable:
        """Multiply rows (duplicate ids multiply in turn)."""
        return await self._scatter(UpdateKind.SCATTER_MUL, sparse_delta)

    @must_await
    async def scatter_div(self, sparse_delta: IndexedSlices) -> Variable:
        """Divide rows (duplicate ids divide in turn; a floating-point variable)."""
        return await self._scatter(UpdateKind.SCATTER_DIV, sparse_delta)

    @must_await
    async def scatter_min(self, sparse_delta: IndexedSlices) -> Variable:
        """Each value the smaller of it and the update's (duplicate ids: the least)."""
        return await self._scatter(UpdateKind.SCATTER_MIN, sparse_delta)

    @must_await
    async def scatter_max(self, sparse_delta: IndexedSlices) -> Variable:
        """Each value the larger of it and the update's (duplicate ids: the greatest)."""
        return await self._scatter(UpdateKind.SCATTER_MAX, sparse_delta)

    @must_await
    async def scatter_update(self, sparse_delta: IndexedSlices) -> Variable:
        """Replace rows."""
        return await self._scatter(UpdateKind.SCATTER_UPDATE, sparse_delta)

    @must_await
    async def batch_scatter_update(self, sparse_delta: IndexedSlices) -> Variable:
        """TF's ``batch_scatter_update``: :meth:`scatter_update` (an :class:`IndexedSlices`
        holds 1-D row ids, no batch dimensions)."""
        return await self._scatter(UpdateKind.SCATTER_UPDATE, sparse_delta)

    async def _scatter(self, kind: UpdateKind, delta: IndexedSlices) -> Variable:
        op = kind.value
        if not isinstance(delta, IndexedSlices):
            raise InvalidArgumentError(f"{op} takes an IndexedSlices, got {type(delta).__name__}")
        idx = self._rows(delta.indices, op)
        values = to_array(delta.values, self._dtype, f"{op} of variable {self._name!r}")
        expected = (idx.shape[0],) + self._shape[1:]
        if values.shape != expected:
            raise InvalidArgumentError(
                f"{op} of variable {self._name!r}: values have shape {values.shape}, expected {expected}"
            )
        scatter_rule.check(op, self._dtype, self._name)
        if self._ps is None:
            check_range(idx, self._shape[0], self._name)
            assert self._local is not None
            scatter_rule.scatter(self._local, idx, values, op)
            return self
        await self._request(SINGLE_UPDATES[kind](name=self._name, indices=idx, values=values))
        return self


def _remote_handle(
    name: str,
    shape: tuple[int, ...],
    dtype: str,
    ps: int,
    trainable: bool,
    aggregation: int,
    synchronization: int,
    display: str | None = None,
) -> Variable:
    return Variable.handle(
        name,
        shape,
        dtype,
        ps,
        None,
        trainable,
        VariableAggregation(aggregation),
        VariableSynchronization(synchronization),
        display_name=display,
    )


def _local_variable(name: str, value: np.ndarray, trainable: bool) -> Variable:
    with creator_scope(None):
        return Variable(np.array(value), name=name, trainable=trainable)


expose(globals(), "pstrain", ["Variable"])
