"""What variables are made of, short of the variables themselves: their enums, sparse
rows (:class:`IndexedSlices`), the creator a strategy scope installs, and the conversions
of values into arrays of a variable's dtype (refusing those that lose information)."""

from __future__ import annotations

import contextlib
import contextvars
import enum
from collections.abc import Coroutine, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .._base.checks import shape as checked_shape
from .._base.context import must_await
from .._base.errors import InvalidArgumentError
from .._base.exports import expose
from .._formats.numerics.casting import cast_value
from .._formats.numerics.initializers import Initializer
from .indexing import rows_for

__all__ = [
    "IndexedSlices",
    "VariableAggregation",
    "VariableBase",
    "VariableCreator",
    "VariableSynchronization",
    "as_enum",
    "check_range",
    "creator_scope",
    "current_creator",
    "initial_value_array",
    "to_array",
]


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
                f"{self.indices.shape} and values {self.values.shape}"
            )
        self.dense_shape = tuple(dense_shape) if dense_shape is not None else None

    def __repr__(self) -> str:
        return (
            f"IndexedSlices(values=<{self.values.shape} {self.values.dtype}>, "
            f"indices=<{self.indices.shape}>, dense_shape={self.dense_shape})"
        )


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
    "pstrain_variable_creator", default=None
)


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
    """What every variable (whole or sharded) is: ``isinstance(x, VariableBase)``; and
    ``await v[index]``, numpy's indexing of its value, reading only the rows it needs
    (``indexing.py``)."""

    __slots__ = ()

    if TYPE_CHECKING:  # what each kind of variable has

        @property
        def shape(self) -> tuple[int, ...]: ...

        def read_value(self) -> Coroutine[Any, Any, np.ndarray]: ...

        def sparse_read(self, indices: Any) -> Coroutine[Any, Any, np.ndarray]: ...

    def __getitem__(self, index: Any) -> Coroutine[Any, Any, Any]:
        """``await v[index]``: numpy's ``value[index]``, reading only the rows it needs (a
        sharded variable's from the parts that hold them)."""
        return self._indexed(index)

    def __iter__(self) -> Any:
        # (without it, Python would iterate by __getitem__ with 0, 1, ... for ever)
        raise TypeError(
            f"a {type(self).__name__} is not iterable: read it with await v.numpy(), or rows with await v[i]"
        )

    @must_await
    async def _indexed(self, index: Any) -> Any:
        rows, rest = rows_for(index, self.shape)
        values = await (self.read_value() if rows is None else self.sparse_read(rows))
        return values[rest]


def as_dtype(dtype: Any, what: str) -> np.dtype:
    """``dtype`` as numpy's, or an error naming ``what``."""
    try:
        return np.dtype(dtype)
    except TypeError:
        raise InvalidArgumentError(f"{what}: {dtype!r} is not a dtype (np.float32, 'float32' ...)") from None


def as_array(value: Any, what: str) -> np.ndarray:
    """``value`` as an array, or an error naming ``what`` (rows of unequal length ...)."""
    try:
        return np.asarray(value)
    except ValueError as exc:
        raise InvalidArgumentError(f"{what} is not an array: {exc}") from None


def infer_dtype(value: Any, dtype: Any) -> np.dtype:
    """TF's defaults: Python floats -> float32, ints -> int32; arrays keep theirs."""
    if dtype is not None:
        return as_dtype(dtype, "dtype")
    if isinstance(value, (np.ndarray, np.generic)):
        return value.dtype
    arr = as_array(value, "initial_value")
    if arr.dtype == np.float64:
        return np.dtype(np.float32)
    if arr.dtype == np.int64:
        return np.dtype(np.int32)
    return arr.dtype


def to_array(value: Any, dtype: np.dtype, what: str) -> np.ndarray:
    """``value`` as an array of ``dtype``; refuses conversions that lose information
    (``casting.py``: float -> int, overflow, out-of-range integers)."""
    if isinstance(value, VariableBase):
        raise InvalidArgumentError(
            f"{what}: pass an array, not a variable handle (read it first: await v.read_value())"
        )
    arr = value if isinstance(value, np.ndarray) else as_array(value, what)
    if arr.dtype == dtype:
        return arr
    return cast_value(arr, dtype, what)


def check_range(idx: np.ndarray, n: int, name: str) -> None:
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
        bad = idx[(idx < 0) | (idx >= n)].reshape(-1)[0]
        raise InvalidArgumentError(f"variable {name!r}: row id {int(bad)} out of range [0, {n})")


def as_enum(cls: Any, value: Any, what: str) -> Any:
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
        return initial_value(
            checked_shape(shape), as_dtype(dtype, "dtype") if dtype is not None else np.float32
        )
    if callable(initial_value) and not isinstance(initial_value, VariableBase):
        initial_value = initial_value()
    value = to_array(initial_value, infer_dtype(initial_value, dtype), "initial_value")
    if shape is not None and checked_shape(shape) != value.shape:
        raise InvalidArgumentError(f"initial_value has shape {value.shape}, shape= says {tuple(shape)}")
    return value


expose(globals(), "pstrain", ["IndexedSlices", "VariableAggregation", "VariableSynchronization"])
