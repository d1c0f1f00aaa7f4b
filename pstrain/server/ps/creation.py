"""What ``vars/create`` builds: each variable's array from its spec, checked before any
is made (dtype, shape, size against the ps's limit, a value or an initializer)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ..._base.errors import InvalidArgumentError
from ..._formats.messages.operations import VariableSpec
from ..._formats.numerics import initializers
from ..._formats.numerics.casting import NUMERIC_KINDS, cast_value

__all__ = ["itemsize", "plan_create"]


def plan_create(
    spec: VariableSpec, max_variable_bytes: int
) -> tuple[np.ndarray | None, Callable[[], np.ndarray] | None]:
    """The array of the variable ``spec`` asks for (checked: dtype, shape, size, value or
    initializer), or None and a function that builds it off the serving loop."""
    where = f"vars/create {spec.name!r}"
    try:
        dtype = np.dtype(spec.dtype)
    except TypeError as exc:
        raise InvalidArgumentError(f"{where}: bad dtype {spec.dtype!r}") from exc
    if dtype.kind not in NUMERIC_KINDS or dtype.hasobject:
        raise InvalidArgumentError(f"{where}: dtype {dtype} is not numeric")
    shape = tuple(spec.shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > max_variable_bytes:
        raise InvalidArgumentError(
            f"{where}: {nbytes} bytes is more than this ps's limit of {max_variable_bytes} "
            "bytes per variable (pstrain serve --max-variable-bytes); shard it "
            "(variable_partitioner) or raise the limit"
        )
    if (spec.value is None) == (spec.init is None):
        raise InvalidArgumentError(f"{where}: give exactly one of 'value' and 'init'")
    if spec.init is not None:
        init = initializers.from_spec(spec.init)
        try:  # a one-element probe of the same rank: bad parameters are the caller's error, found now
            init((1,) * len(shape), dtype)
        except InvalidArgumentError:
            raise
        except Exception as exc:
            raise InvalidArgumentError(f"{where}: bad initializer {spec.init!r}: {exc}") from None
        offset, full_shape = spec.offset, spec.full_shape
        if offset is not None and len(offset) != len(shape):
            raise InvalidArgumentError(f"{where}: offset {offset} does not match shape {shape}")
        if full_shape is not None and (
            len(full_shape) != len(shape)
            or any((o or 0) + s > f for o, s, f in zip(offset or [0] * len(shape), shape, full_shape))
        ):
            raise InvalidArgumentError(f"{where}: part {shape} at {offset} is not inside {full_shape}")
        return None, lambda: init(shape, dtype, offset=offset, full_shape=full_shape)
    value = spec.value
    assert value is not None
    if value.shape != shape:
        raise InvalidArgumentError(f"{where}: value has shape {value.shape}, declared {shape}")
    arr = cast_value(value, dtype, where)
    if arr is value and (not arr.flags.writeable or arr.ctypes.data % 64):
        arr = arr.copy()  # its own (the message's bytes go), on a cache line
    return arr, None


def itemsize(dtype: str) -> int:
    """Bytes of one element of ``dtype``; 0 for a bad one (refused, with its name, when the
    variable is planned)."""
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        return 0
