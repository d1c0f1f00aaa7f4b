"""Which strategy is current, and which context: TF's ``tf.distribute`` module functions.

* inside ``strategy.scope()``: ``get_strategy()`` is that strategy,
  ``has_strategy()`` is True, ``in_cross_replica_context()`` is True and
  ``get_replica_context()`` is None;
* inside ``strategy.run(fn)``: ``get_replica_context()`` is the replica's
  :class:`ReplicaContext` and ``in_cross_replica_context()`` is False;
  ``ReplicaContext.merge_call(merge_fn)`` runs ``merge_fn(strategy, ...)`` in
  cross-replica context;
* outside any scope: TF's *default strategy* (no distribution: one replica,
  variables local), a default replica context, ``has_strategy()`` False.

>>> get_strategy().num_replicas_in_sync, has_strategy(), in_cross_replica_context()
(1, False, False)
>>> get_replica_context().replica_id_in_sync_group
0
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from .._base.errors import InvalidArgumentError
from .._base.exports import expose
from .values import DistributedValues, PerReplica, ValueContext

__all__ = [
    "ReduceOp",
    "ReplicaContext",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
]


class ReduceOp(enum.Enum):
    """How to combine values across replicas; ``"sum"``/``"MEAN"`` strings work too."""

    SUM = "SUM"
    MEAN = "MEAN"

    @classmethod
    def parse(cls, op: ReduceOp | str) -> ReduceOp:
        if isinstance(op, ReduceOp):
            return op
        try:
            return cls[str(op).upper()]
        except KeyError:
            raise InvalidArgumentError(f"unknown reduce op {op!r}; use 'SUM' or 'MEAN'") from None


class Strategy(Protocol):
    """What a context knows of a strategy."""

    @property
    def num_replicas_in_sync(self) -> int: ...


class ReplicaContext:
    """The replica a function runs as inside ``strategy.run`` (one per worker)."""

    def __init__(self, strategy: Any, replica_id: int = 0) -> None:
        self.strategy = strategy
        self.replica_id_in_sync_group = replica_id
        self.num_replicas_in_sync = 1

    @property
    def devices(self) -> tuple[str, ...]:
        """The replica's devices: its worker's CPU."""
        return ("/device:CPU:0",)

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any) -> Any:
        """Combine ``value`` over the replicas in sync (one here: itself)."""
        ReduceOp.parse(reduce_op)
        return value

    def merge_call(
        self, merge_fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Call ``merge_fn(strategy, *args, **kwargs)`` in cross-replica context; its result
        comes back to the replica. With one replica per worker, values pass as they are."""
        if not isinstance(args, (list, tuple)):
            raise InvalidArgumentError(
                f"merge_call: args must be a list or a tuple, got {type(args).__name__}"
            )
        token = _replica.set(None)
        try:
            with _strategy_scope(self.strategy):
                return merge_fn(self.strategy, *args, **(kwargs or {}))
        finally:
            _replica.reset(token)

    def __repr__(self) -> str:
        return f"ReplicaContext(replica_id_in_sync_group={self.replica_id_in_sync_group})"


class _DefaultStrategy:
    """TF's default strategy: what ``get_strategy()`` returns outside any scope."""

    num_replicas_in_sync = 1

    @contextlib.contextmanager
    def scope(self) -> Iterator[_DefaultStrategy]:
        yield self

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        options: Any = None,
    ) -> Any:
        with replica_scope(ReplicaContext(self)):
            return fn(*args, **(kwargs or {}))

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        return reduce_structure(ReduceOp.parse(reduce_op), value, axis)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        return value.values if isinstance(value, DistributedValues) else (value,)

    def experimental_distribute_values_from_function(
        self, value_fn: Callable[[ValueContext], Any]
    ) -> PerReplica:
        return PerReplica([value_fn(ValueContext(0, 1))])

    def __repr__(self) -> str:
        return "<default strategy>"


_DEFAULT = _DefaultStrategy()


def reduce_structure(op: ReduceOp, value: Any, axis: int | None) -> Any:
    """TF's ``strategy.reduce``: each leaf of ``value`` (a nested tuple, list, namedtuple or
    dict; a ``DistributedValues`` leaf is its replicas' values, or holds such a structure
    in each) combined over the replicas, and along ``axis`` within each when given."""
    return map_replicas(value, lambda replicas: _combine(op, replicas, axis))


def map_replicas(value: Any, combine: Callable[[list[Any]], Any]) -> Any:
    """``combine(replicas)`` for each leaf of ``value`` (a nested structure whose leaves are
    values or ``DistributedValues``, or a ``DistributedValues`` of such structures): the
    list of that leaf's values on the replicas (one, for a plain value)."""
    if isinstance(value, DistributedValues):
        replicas = list(value.values)
        first = replicas[0]
        if isinstance(first, (tuple, list, dict)):  # a structure per replica: leaf by leaf
            return _map_structure(first, lambda path: combine([_at(r, path) for r in replicas]))
        return combine(replicas)
    if isinstance(value, (tuple, list, dict)):
        return _map_structure(value, lambda path: map_replicas(_at(value, path), combine))
    return combine([value])


def _map_structure(template: Any, leaf: Callable[[tuple[Any, ...]], Any], path: tuple[Any, ...] = ()) -> Any:
    """``template``'s structure with each leaf (by its path of keys) replaced by ``leaf(path)``."""
    if isinstance(template, dict):
        return {k: _map_structure(v, leaf, (*path, k)) for k, v in template.items()}
    if isinstance(template, (tuple, list)):
        items = [_map_structure(v, leaf, (*path, i)) for i, v in enumerate(template)]
        if isinstance(template, tuple) and hasattr(template, "_fields"):  # a namedtuple
            return type(template)(*items)
        return type(template)(items)
    return leaf(path)


def _at(value: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        value = value[key]
    return value


def _combine(op: ReduceOp, parts: list[Any], axis: int | None) -> Any:
    """One leaf's values on the replicas combined (and summed or averaged along ``axis``)."""
    arrays = [np.asarray(p) for p in parts]
    if axis is not None:
        for a in arrays:
            if not -a.ndim <= axis < a.ndim:
                raise InvalidArgumentError(
                    f"strategy.reduce: axis {axis} is out of range for a value of rank {a.ndim}"
                )
        count = sum(a.shape[axis] for a in arrays)
        total = sum(a.sum(axis=axis) for a in arrays)
        return total / count if op is ReduceOp.MEAN else total
    if len(parts) == 1:
        return parts[0]  # (as it was given: one replica's value is the result)
    total = sum(arrays[1:], arrays[0])
    return total / len(arrays) if op is ReduceOp.MEAN else total


_strategy: contextvars.ContextVar[Any] = contextvars.ContextVar("pstrain_strategy", default=None)
_replica: contextvars.ContextVar[ReplicaContext | None] = contextvars.ContextVar(
    "pstrain_replica_context", default=None
)


@contextlib.contextmanager
def _strategy_scope(strategy: Any) -> Iterator[None]:
    token = _strategy.set(strategy)
    try:
        yield
    finally:
        _strategy.reset(token)


def enter_strategy(strategy: Any) -> contextvars.Token[Any]:
    """Make ``strategy`` current (``strategy.scope()``); TF refuses mixing two strategies."""
    current = _strategy.get()
    if current is not None and current is not strategy:
        raise InvalidArgumentError(
            f"Mixing different strategies is not allowed: {strategy!r} entered inside the scope "
            f"of {current!r}"
        )
    return _strategy.set(strategy)


def exit_strategy(token: contextvars.Token[Any]) -> None:
    _strategy.reset(token)


@contextlib.contextmanager
def replica_scope(context: ReplicaContext) -> Iterator[None]:
    """Run as ``context``'s replica (``strategy.run``), inside its strategy."""
    token = _replica.set(context)
    try:
        with _strategy_scope(context.strategy):
            yield
    finally:
        _replica.reset(token)


def current_replica() -> ReplicaContext | None:
    """The ReplicaContext of the enclosing ``strategy.run``, else None (no default)."""
    return _replica.get()


def get_strategy() -> Any:
    """The strategy of the current scope (or ``run``); the default strategy outside any."""
    current = _strategy.get()
    return _DEFAULT if current is None else current


def has_strategy() -> bool:
    """True inside a (non-default) strategy's scope or ``run``."""
    return _strategy.get() is not None


def get_replica_context() -> ReplicaContext | None:
    """Inside ``strategy.run``: its ReplicaContext. In a strategy's scope (cross-replica
    context): None. Outside any scope: the default strategy's replica context."""
    replica = _replica.get()
    if replica is not None:
        return replica
    return None if _strategy.get() is not None else ReplicaContext(_DEFAULT)


def in_cross_replica_context() -> bool:
    """True in a strategy's scope outside ``run`` (TF's cross-replica context)."""
    return _strategy.get() is not None and _replica.get() is None


expose(
    globals(),
    "pstrain",
    [
        "ReduceOp",
        "ReplicaContext",
        "get_replica_context",
        "get_strategy",
        "has_strategy",
        "in_cross_replica_context",
    ],
)
