"""What a dataset's elements are: ``TensorSpec`` (TF's), the spec read from an element,
and a generator's elements checked against a declared signature (``from_generator``'s
``output_signature``, or its older ``output_types`` and ``output_shapes``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._base.errors import InvalidArgumentError
from .._base.exports import expose
from .elements import is_jagged

__all__ = ["TensorSpec", "conforming", "signature", "spec_of"]


class TensorSpec:
    """The shape and dtype of one component of a dataset's elements (TF's ``TensorSpec``);
    ``None`` in ``shape`` is a dimension that varies (a last, smaller batch).

    >>> TensorSpec((None, 3), np.float32)
    TensorSpec(shape=(None, 3), dtype=float32, name=None)
    """

    __slots__ = ("shape", "dtype", "name")

    def __init__(self, shape: Any, dtype: Any = np.float32, name: str | None = None) -> None:
        self.shape = tuple(None if d is None else int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.name = name

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorSpec) and (self.shape, self.dtype, self.name) == (
            other.shape,
            other.dtype,
            other.name,
        )

    def __hash__(self) -> int:
        return hash((self.shape, self.dtype, self.name))

    def is_compatible_with(self, value: Any) -> bool:
        """Does ``value`` (an array) fit this spec?"""
        arr = np.asarray(value)
        return (
            arr.dtype == self.dtype
            and arr.ndim == len(self.shape)
            and all(d is None or d == n for d, n in zip(self.shape, arr.shape))
        )

    def __repr__(self) -> str:
        return f"TensorSpec(shape={self.shape}, dtype={self.dtype}, name={self.name!r})"


def spec_of(element: Any, partial_batch: bool) -> Any:
    if is_jagged(element):
        values = getattr(element, "values", None)
        dtype = values.dtype if isinstance(values, np.ndarray) else np.int64
        return TensorSpec((None if partial_batch else len(element), None), dtype, name=type(element).__name__)
    if isinstance(element, dict):
        return {k: spec_of(v, partial_batch) for k, v in element.items()}
    if isinstance(element, tuple):
        return tuple(spec_of(v, partial_batch) for v in element)
    arr = np.asarray(element)
    shape: list[int | None] = list(arr.shape)
    if partial_batch and shape:
        shape[0] = None
    return TensorSpec(shape, arr.dtype)


def signature(types: Any, shapes: Any) -> Any:
    """TF's older ``output_types`` and ``output_shapes`` as ``TensorSpec``s."""
    if isinstance(types, dict):
        return {k: signature(t, None if shapes is None else shapes[k]) for k, t in types.items()}
    if isinstance(types, tuple):
        return tuple(signature(t, None if shapes is None else shapes[i]) for i, t in enumerate(types))
    return _AnyShape(types) if shapes is None else TensorSpec(shapes, types)


class _AnyShape(TensorSpec):
    """An ``output_types`` dtype without a shape: any shape of that dtype."""

    def __init__(self, dtype: Any) -> None:
        super().__init__((), dtype)

    def is_compatible_with(self, value: Any) -> bool:
        return bool(np.asarray(value).dtype == self.dtype)


def conforming(element: Any, spec: Any) -> Any:
    """``element`` checked against ``spec`` (its structure, each array's dtype and shape), as
    arrays; or InvalidArgumentError saying what differs, in TF's words."""
    if isinstance(spec, dict):
        if not isinstance(element, dict) or set(element) != set(spec):
            raise InvalidArgumentError(
                f"from_generator: `generator` yielded a {type(element).__name__}, "
                f"not a dict of {sorted(spec)}"
            )
        return {k: conforming(element[k], s) for k, s in spec.items()}
    if isinstance(spec, tuple):
        if not isinstance(element, (tuple, list)) or len(element) != len(spec):
            raise InvalidArgumentError(
                f"from_generator: `generator` yielded a {type(element).__name__} where a tuple of "
                f"{len(spec)} was expected"
            )
        return tuple(conforming(e, s) for e, s in zip(element, spec))
    if not isinstance(spec, TensorSpec):
        raise InvalidArgumentError(
            f"from_generator: output_signature holds a {type(spec).__name__}, not TensorSpecs"
        )
    arr = np.asarray(element)
    if arr.dtype != spec.dtype and np.can_cast(arr.dtype, spec.dtype, "same_kind"):
        arr = arr.astype(spec.dtype)  # (TF converts a Python number to the declared dtype too)
    if not spec.is_compatible_with(arr):
        raise InvalidArgumentError(
            f"from_generator: `generator` yielded an element of shape {arr.shape} and dtype "
            f"{arr.dtype} where an element of shape {spec.shape} and dtype {spec.dtype} was expected"
        )
    return arr[()] if arr.ndim == 0 else arr  # (a scalar stays a numpy scalar)


expose(globals(), "pstrain.data", ["TensorSpec"])
