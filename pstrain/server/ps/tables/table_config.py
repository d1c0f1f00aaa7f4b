"""What a dynamic table's shard is, fixed when it is created (a second creation must say
the same): its width, dtype, initializer, capacity and its eviction and admission rules."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...._base.errors import InvalidArgumentError
from ...._kernels import FLOAT_DTYPES

__all__ = ["TableConfig"]


@dataclass(frozen=True)
class TableConfig:
    """What a table is: fixed when it is created (a second creation must say the same)."""

    dim: int
    dtype: str = "float32"
    seed: int = 0
    init_low: float = -0.05
    init_high: float = 0.05
    default_value: float = 0.0
    capacity: int | None = None  # rows on this shard
    evict: str = "lru"
    max_age: int | None = None
    admit_after: int | None = None
    admit_probability: float | None = None
    max_candidates: int = 1 << 20

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or self.dim < 1:
            raise InvalidArgumentError(f"a dynamic table's dim must be a positive integer, got {self.dim!r}")
        try:
            dtype = np.dtype(self.dtype)
        except (TypeError, ValueError):  # (numpy's parser refuses most strings with TypeError)
            raise InvalidArgumentError(
                f"a dynamic table's dtype must be float32 or float64, got {self.dtype!r}"
            ) from None
        if dtype not in FLOAT_DTYPES:  # what the table kernels take
            raise InvalidArgumentError(f"a dynamic table's dtype must be float32 or float64, got {dtype}")
        if self.capacity is not None and self.capacity < 1:
            raise InvalidArgumentError(f"capacity must be at least 1, got {self.capacity}")
        if self.evict not in ("lru", "lfu"):
            raise InvalidArgumentError(f"evict must be 'lru' or 'lfu', got {self.evict!r}")
        if self.max_age is not None and self.max_age < 1:
            raise InvalidArgumentError(f"max_age must be at least 1, got {self.max_age}")
        if self.admit_after is not None and self.admit_after < 1:
            raise InvalidArgumentError(f"admit_after must be at least 1, got {self.admit_after}")
        if self.admit_probability is not None and not 0.0 < self.admit_probability <= 1.0:
            raise InvalidArgumentError(f"admit_probability must be in (0, 1], got {self.admit_probability}")
        if self.admit_after is not None and self.admit_probability is not None:
            raise InvalidArgumentError("give admit_after or admit_probability, not both")
        if not (math.isfinite(self.init_low) and math.isfinite(self.init_high)):
            raise InvalidArgumentError(
                "the initializer's bounds must be finite numbers, "
                f"got {self.init_low!r} and {self.init_high!r}"
            )
        if not self.init_low <= self.init_high:
            raise InvalidArgumentError("the initializer's low bound is above its high bound")
        if self.max_candidates < 1:
            raise InvalidArgumentError("max_candidates must be at least 1")

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}
