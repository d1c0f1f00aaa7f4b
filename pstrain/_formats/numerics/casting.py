"""Which dtype conversions pstrain makes, and which it refuses because they lose information.

A value sent for a variable is converted to the variable's dtype only when
nothing is lost but precision a float of the target type would round anyway:

* same dtype: as it is;
* any *safe* cast in numpy's sense (int32 -> int64, float32 -> float64,
  bool -> any number, int8 -> float32);
* a narrower integer or a signed/unsigned change, when every value fits
  (uint64 300 into int8 is refused: it would become 44);
* a narrower float (float64 -> float32), when no finite value overflows to
  infinity (1e300 is refused); values round to the nearest float32, as any
  float32 arithmetic does;
* an integer into a float, when every value survives the round trip
  (2**53 + 1 into float64 is refused).

Never: floats into integers, complex into real, anything into bool, and
non-numeric dtypes. Each refusal is an :class:`~pstrain.errors.InvalidArgumentError`
naming the value, the two dtypes and the reason.
"""

from __future__ import annotations

import numpy as np

from ..._base.errors import InvalidArgumentError

__all__ = ["NUMERIC_KINDS", "cast_value"]

#: dtype kinds a variable may have.
NUMERIC_KINDS = frozenset("biufc")


def cast_value(arr: np.ndarray, dtype: np.dtype, what: str) -> np.ndarray:
    """``arr`` as ``dtype``, or InvalidArgumentError if the conversion would lose information.

    >>> cast_value(np.array([1, 2], np.int64), np.dtype(np.int8), "x").dtype
    dtype('int8')
    >>> cast_value(np.array([300], np.uint64), np.dtype(np.int8), "x")
    Traceback (most recent call last):
    ...
    pstrain.errors.InvalidArgumentError: x: values of dtype uint64 do not fit in int8 (300 is out of range)
    """
    src = arr.dtype
    if src == dtype:
        return arr
    if src.kind not in NUMERIC_KINDS or dtype.kind not in NUMERIC_KINDS:
        raise InvalidArgumentError(
            f"{what}: a value of dtype {src} cannot be used for a variable of dtype {dtype}"
        )
    if np.can_cast(src, dtype, "safe"):
        return arr.astype(dtype)
    if src.kind in "iu" and dtype.kind in "iu":
        info = np.iinfo(dtype)
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < info.min or hi > info.max:
                bad = lo if lo < info.min else hi
                raise InvalidArgumentError(
                    f"{what}: values of dtype {src} do not fit in {dtype} ({bad} is out of range)"
                )
        return arr.astype(dtype)
    if src.kind == "f" and dtype.kind == "f":
        with np.errstate(over="ignore"):
            out = arr.astype(dtype)
        if arr.size and bool(np.any(np.isinf(out) & np.isfinite(arr))):
            raise InvalidArgumentError(
                f"{what}: values of dtype {src} overflow {dtype} (they would become infinite)"
            )
        return out
    if src.kind in "iub" and dtype.kind in "fc":
        out = arr.astype(dtype)
        with np.errstate(invalid="ignore", over="ignore"):  # 2**64 - 2 rounds past uint64's range
            back = out.astype(src)
        if arr.size and not bool(np.array_equal(back, arr)):
            raise InvalidArgumentError(f"{what}: values of dtype {src} are not exact in {dtype}")
        return out
    if src.kind == "c" and dtype.kind == "c":
        with np.errstate(over="ignore"):
            out = arr.astype(dtype)
        if arr.size and bool(np.any(np.isinf(out) & np.isfinite(arr))):
            raise InvalidArgumentError(f"{what}: values of dtype {src} overflow {dtype}")
        return out
    raise InvalidArgumentError(
        f"{what}: a value of dtype {src} cannot be used for a variable of "
        f"dtype {dtype} (it would lose information)"
    )
