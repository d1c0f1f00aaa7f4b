"""Gradient clipping as Keras' optimizers do it (``clipnorm``, ``clipvalue``,
``global_clipnorm``), on the worker, before the gradients are sent.

Keras clips what ``apply_gradients`` is given: a sparse gradient's values as they come,
repeated rows and all (its norm is that of the values; ``clipvalue`` bounds each value
before repeated rows are summed), a dense gradient as a whole, and ``global_clipnorm``
scales every gradient of one call by the norm of them all. So does this module; a
sharded variable's gradient is one gradient, each part's given on its own is one each.

>>> c = Clipping(clipnorm=5.0)
>>> c.clip([np.array([3.0, 4.0]), np.array([6.0, 8.0])])[1].tolist()
[3.0, 4.0]
>>> Clipping(global_clipnorm=2.5).clip([np.array([3.0, 0.0]), np.array([0.0, 4.0])])[1].tolist()
[0.0, 2.0]
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._base.errors import InvalidArgumentError
from .._variables.arrays import IndexedSlices


class Clipping:
    """One optimizer's clipping settings (at most one of the three is set)."""

    __slots__ = ("clipnorm", "clipvalue", "global_clipnorm")

    def __init__(
        self,
        clipnorm: float | None = None,
        clipvalue: float | None = None,
        global_clipnorm: float | None = None,
    ) -> None:
        given = {"clipnorm": clipnorm, "clipvalue": clipvalue, "global_clipnorm": global_clipnorm}
        if sum(v is not None for v in given.values()) > 1:
            raise InvalidArgumentError(
                "Only one of `clipnorm`, `clipvalue` and `global_clipnorm` can be set. Received: "
                + ", ".join(f"{k}={v}" for k, v in given.items())
            )
        for what, value in given.items():
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf
            ):  # Keras ignores 0 and below silently; a clip that clips nothing is a mistake
                raise InvalidArgumentError(
                    f"{what} must be a positive number (None: no clipping), got {value!r}"
                )
        self.clipnorm = None if clipnorm is None else float(clipnorm)
        self.clipvalue = None if clipvalue is None else float(clipvalue)
        self.global_clipnorm = None if global_clipnorm is None else float(global_clipnorm)

    def config(self) -> dict[str, float]:
        """The settings given (for ``get_config``)."""
        return {
            k: v
            for k, v in (
                ("clipnorm", self.clipnorm),
                ("clipvalue", self.clipvalue),
                ("global_clipnorm", self.global_clipnorm),
            )
            if v is not None
        }

    def __bool__(self) -> bool:
        return bool(self.config())

    def clip(self, grads: list[Any]) -> list[Any]:
        """``grads`` (arrays or :class:`IndexedSlices`) clipped; unchanged when none is set."""
        if self.clipnorm is not None:
            limit = self.clipnorm
            return [_scaled(g, limit / max(_norm(_values(g)), limit)) for g in grads]
        if self.global_clipnorm is not None:
            total = math.sqrt(sum(_norm(_values(g)) ** 2 for g in grads))
            if not math.isfinite(total):  # Keras: every gradient becomes NaN
                return [_scaled(g, math.nan) for g in grads]
            return [_scaled(g, self.global_clipnorm / max(total, self.global_clipnorm)) for g in grads]
        if self.clipvalue is not None:
            v = self.clipvalue
            return [_with_values(g, np.clip(_values(g), -v, v)) for g in grads]
        return grads


def _values(grad: Any) -> np.ndarray:
    values = np.asarray(grad.values if isinstance(grad, IndexedSlices) else grad)
    if values.dtype.kind not in "fc":
        raise InvalidArgumentError(f"a gradient to clip must be floating point, got {values.dtype}")
    return values


def _norm(values: np.ndarray) -> float:
    """The L2 norm, without overflow where the squares of float32 values would overflow."""
    flat = values.reshape(-1)
    with np.errstate(over="ignore"):
        total = float(np.vdot(flat, flat).real)
    if math.isinf(total) and bool(np.isfinite(flat).all()):
        big = flat.astype(np.float64)
        scale = float(np.abs(big).max())
        big /= scale
        return scale * math.sqrt(float(np.dot(big, big)))
    return math.sqrt(total)


def _scaled(grad: Any, scale: float) -> Any:
    if scale == 1.0:
        return grad
    values = _values(grad)
    return _with_values(grad, values * values.dtype.type(scale))


def _with_values(grad: Any, values: np.ndarray) -> Any:
    if isinstance(grad, IndexedSlices):
        return IndexedSlices(values, grad.indices, grad.dense_shape)
    return values
