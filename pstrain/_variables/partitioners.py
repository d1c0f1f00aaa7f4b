"""Partitioners: how many parts a variable is split into along an axis.

Given to ``ParameterServerStrategy(variable_partitioner=...)``, a partitioner
is called with a variable's shape and dtype and returns one count per axis
(only the first may be above 1). The three here reproduce TensorFlow's
counts exactly.

>>> FixedShardsPartitioner(2)((10, 3), np.float32)
[2, 1]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._base.errors import InvalidArgumentError
from .._base.exports import expose

__all__ = ["FixedShardsPartitioner", "MaxSizePartitioner", "MinSizePartitioner"]


def _bytes_per_element(dtype: Any, bytes_per_string: int) -> int:
    dtype = np.dtype(dtype)
    return bytes_per_string if dtype.kind in "SUO" else dtype.itemsize


def _check_axis(shape: Sequence[int], axis: int) -> None:
    if not 0 <= axis < len(shape):
        raise InvalidArgumentError(f"axis {axis} out of range for a variable of shape {tuple(shape)}")


class FixedShardsPartitioner:
    """Always ``num_shards`` parts (fewer if the axis is shorter).

    >>> FixedShardsPartitioner(2)((10, 3), np.float32)
    [2, 1]
    """

    def __init__(self, num_shards: int) -> None:
        if num_shards < 1:
            raise InvalidArgumentError(f"num_shards must be >= 1, got {num_shards}")
        self.num_shards = num_shards

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        _check_axis(shape, axis)
        result = [1] * len(shape)
        result[axis] = min(self.num_shards, shape[axis])
        return result


class MinSizePartitioner:
    """As many parts as possible with each at least ``min_shard_bytes``, at most ``max_shards``.

    >>> MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), np.float32)
    [2, 1]
    """

    def __init__(
        self, min_shard_bytes: int = 256 << 10, max_shards: int = 1, bytes_per_string: int = 16
    ) -> None:
        if min_shard_bytes < 1:
            raise InvalidArgumentError(f"min_shard_bytes must be positive, got {min_shard_bytes}")
        if max_shards < 1:
            raise InvalidArgumentError(f"max_shards must be positive, got {max_shards}")
        if bytes_per_string < 1:
            raise InvalidArgumentError(f"bytes_per_string must be positive, got {bytes_per_string}")
        self.min_shard_bytes = min_shard_bytes
        self.max_shards = max_shards
        self.bytes_per_string = bytes_per_string

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        _check_axis(shape, axis)
        total = math.prod(shape) * _bytes_per_element(dtype, self.bytes_per_string)
        parts = math.ceil(total / self.min_shard_bytes)
        result = [1] * len(shape)
        result[axis] = max(1, min(shape[axis], self.max_shards, parts))
        return result


class MaxSizePartitioner:
    """As few parts as possible with each at most ``max_shard_bytes`` (and at most ``max_shards``).

    >>> MaxSizePartitioner(max_shard_bytes=4)((6, 1), np.float32)
    [6, 1]
    """

    def __init__(
        self, max_shard_bytes: int, max_shards: int | None = None, bytes_per_string: int = 16
    ) -> None:
        if max_shard_bytes < 1:
            raise InvalidArgumentError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        if max_shards is not None and max_shards < 1:
            raise InvalidArgumentError(f"max_shards must be positive, got {max_shards}")
        if bytes_per_string < 1:
            raise InvalidArgumentError(f"bytes_per_string must be positive, got {bytes_per_string}")
        self.max_shard_bytes = max_shard_bytes
        self.max_shards = max_shards
        self.bytes_per_string = bytes_per_string

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        _check_axis(shape, axis)
        n = shape[axis]
        result = [1] * len(shape)
        if n == 0:
            return result
        bytes_per_slice = math.prod(shape) // n * _bytes_per_element(dtype, self.bytes_per_string)
        slices_per_shard = max(1, self.max_shard_bytes // max(1, bytes_per_slice))
        shards = math.ceil(n / slices_per_shard)
        if self.max_shards is not None:
            shards = min(self.max_shards, shards)
        result[axis] = shards
        return result


expose(globals(), "pstrain.partitioners")
