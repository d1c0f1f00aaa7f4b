"""Initializers: values a variable starts from, generated where it lives.

Each initializer is a small, seeded description. Given to
``pstrain.Variable(init, shape=..., dtype=...)`` inside a strategy scope, only
the description travels; the ps generates the array, so a 64 MB embedding
table never crosses the wire. Calling one locally gives the same numbers the
ps would: ``init(shape, dtype)``. A seeded initializer is reproducible; an
unseeded one draws its seed once, when the variable is created.

For a part of a sharded variable, the initializer is called with the part's
shape, its offset in the full variable and the full shape (fans of
:class:`GlorotUniform` use the full shape); random parts draw from a stream
derived from ``(seed, offset)``.

>>> import numpy as np
>>> RandomNormal(stddev=1.0, seed=3)((2,), np.float32).shape
(2,)
"""

from __future__ import annotations

import abc
import math
import operator
import secrets
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..._base.checks import number, one_of
from ..._base.errors import InvalidArgumentError
from ..._base.exports import expose

__all__ = [
    "Constant",
    "GlorotNormal",
    "GlorotUniform",
    "HeNormal",
    "HeUniform",
    "Identity",
    "Initializer",
    "LecunNormal",
    "LecunUniform",
    "Ones",
    "Orthogonal",
    "RandomNormal",
    "RandomUniform",
    "TruncatedNormal",
    "VarianceScaling",
    "Zeros",
    "from_spec",
]


class Initializer(abc.ABC):
    """Base class: ``spec()`` describes it, ``__call__`` builds an array (or, given Keras'
    ``partition_shape``/``partition_offset``, one shard of it)."""

    kind = ""

    def config(self) -> dict[str, Any]:
        """The initializer's settings (what a ps needs to make the same values)."""
        return {}

    def spec(self) -> dict[str, Any]:
        """A plain dict that travels to the ps (unseeded ones get a seed here)."""
        cfg = self.config()
        if "seed" in cfg and cfg["seed"] is None:
            cfg["seed"] = secrets.randbits(63)
        return {"kind": self.kind, **cfg}

    def __call__(
        self,
        shape: Sequence[int],
        dtype: Any = np.float32,
        *,
        offset: Sequence[int] | None = None,
        full_shape: Sequence[int] | None = None,
        partition_shape: Sequence[int] | None = None,
        partition_offset: Sequence[int] | None = None,
    ) -> np.ndarray:
        if partition_shape is not None:  # Keras' names: ``shape`` is the whole variable's
            full_shape, shape = shape, partition_shape
            offset = partition_offset or (0,) * len(shape)
        shape = _shape(shape, "shape")
        if full_shape is not None:
            full_shape = _shape(full_shape, "full_shape")
        dtype = np.dtype(dtype)
        return np.asarray(
            self._generate(shape, dtype, tuple(offset or ()), tuple(full_shape or shape))
        ).astype(dtype, copy=False)

    @abc.abstractmethod
    def _generate(
        self, shape: tuple[int, ...], dtype: np.dtype, offset: tuple[int, ...], full_shape: tuple[int, ...]
    ) -> np.ndarray:
        """Rows ``offset...`` of a ``full_shape`` value, ``shape`` of them."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({args})"


def _filled(shape: tuple[int, ...], dtype: np.dtype, draw: Callable[[int], np.ndarray]) -> np.ndarray:
    """An array of ``dtype`` filled from ``draw(n)`` a million values at a time: the same
    values as one draw of the whole shape, without a float64 copy of a large variable.

    >>> rng = np.random.default_rng(1)
    >>> a = _filled((3, 2), np.dtype("float32"), lambda n: rng.uniform(0, 1, n))
    >>> bool(np.array_equal(a, np.random.default_rng(1).uniform(0, 1, (3, 2)).astype(np.float32)))
    True
    """
    out = np.empty(shape, dtype)
    flat = out.reshape(-1)
    step = 1 << 20
    for lo in range(0, flat.size, step):
        hi = min(flat.size, lo + step)
        flat[lo:hi] = draw(hi - lo)
    return out


def _rng(seed: int | None, offset: tuple[int, ...]) -> np.random.Generator:
    if seed is None:
        seed = secrets.randbits(63)
    if any(offset):
        return np.random.default_rng([seed, *offset])
    return np.random.default_rng(seed)


def _shape(shape: Any, what: str) -> tuple[int, ...]:
    try:
        dims = tuple(operator.index(d) for d in shape)
    except TypeError:
        dims = None
    if dims is None or any(d < 0 for d in dims):
        raise InvalidArgumentError(
            f"an initializer's {what} must be whole numbers of 0 or more, got {shape!r}"
        )
    return dims


def _float_dtype(dtype: np.dtype, name: str) -> None:
    if dtype.kind not in "fc":
        raise InvalidArgumentError(f"{name} needs a floating dtype, got {dtype}")


class Zeros(Initializer):
    """All zeros."""

    kind = "zeros"

    def _generate(self, shape, dtype, offset, full_shape):  # type: ignore[no-untyped-def]
        return np.zeros(shape, dtype)


class Ones(Initializer):
    """All ones."""

    kind = "ones"

    def _generate(self, shape, dtype, offset, full_shape):  # type: ignore[no-untyped-def]
        return np.ones(shape, dtype)


class Constant(Initializer):
    """Every element equal to ``value`` (a scalar)."""

    kind = "constant"

    def __init__(self, value: float = 0.0) -> None:
        if np.ndim(value) != 0:
            raise InvalidArgumentError(
                "Constant takes a scalar value; pass an array as the initial value of the variable instead"
            )
        value = value.item() if isinstance(value, np.generic) else value
        if isinstance(value, bool) or not isinstance(value, (int, float, complex)):
            raise InvalidArgumentError(f"Constant takes a number, got {value!r}")
        self.value = value

    def config(self) -> dict[str, Any]:
        """The initializer's settings (what a ps needs to make the same values)."""
        return {"value": self.value}

    def _generate(self, shape, dtype, offset, full_shape):  # type: ignore[no-untyped-def]
        return np.full(shape, self.value, dtype)


class RandomNormal(Initializer):
    """Normal with ``mean`` and ``stddev`` (Keras defaults 0 and 0.05)."""

    kind = "random_normal"

    def __init__(self, mean: float = 0.0, stddev: float = 0.05, seed: int | None = None) -> None:
        self.mean, self.stddev = number(mean, "mean", None), number(stddev, "stddev")
        self.seed = seed

    def config(self) -> dict[str, Any]:
        """The initializer's settings (what a ps needs to make the same values)."""
        return {"mean": self.mean, "stddev": self.stddev, "seed": self.seed}

    def _generate(self, shape, dtype, offset, full_shape):  # type: ignore[no-untyped-def]
        _float_dtype(dtype, "RandomNormal")
        rng = _rng(self.seed, offset)
        draw = np.float32 if dtype == np.float32 else np.float64
        return _filled(shape, dtype, lambda n: rng.standard_normal(n, dtype=draw) * self.stddev + self.mean)


class RandomUniform(Initializer):
    """Uniform in ``[minval, maxval)`` (Keras defaults -0.05, 0.05)."""

    kind = "random_uniform"

    def __init__(self, minval: float = -0.05, maxval: float = 0.05, seed: int | None = None) -> None:
        self.minval, self.maxval = number(minval, "minval", None), number(maxval, "maxval", None)
        if self.minval > self.maxval:
            raise InvalidArgumentError(f"RandomUniform: minval {minval!r} is above maxval {maxval!r}")
        self.seed = seed

    def config(self) -> dict[str, Any]:
        """The initializer's settings (what a ps needs to make the same values)."""
        return {"minval": self.minval, "maxval": self.maxval, "seed": self.seed}

    def _generate(self, shape, dtype, offset, full_shape):  # type: ignore[no-untyped-def]
        rng = _rng(self.seed, offset)
        if dtype.kind in "iu":
            if int(self.minval) >= int(self.maxval):  # as TF: integers in [minval, maxval)
                raise InvalidArgumentError(
                    f"RandomUniform of {dtype}: needs minval < maxval, "
                    f"got {self.minval:g} and {self.maxval:g}"
                )
            return rng.integers(int(self.minval), int(self.maxval), size=shape, dtype=dtype)
        _float_dtype(dtype, "RandomUniform")
        return _filled(shape, dtype, lambda n: rng.uniform(self.minval, self.maxval, n))


class TruncatedNormal(Initializer):
    """Normal, redrawn beyond two standard deviations (Keras' rule)."""

    kind = "truncated_normal"

    def __init__(self, mean: float = 0.0, stddev: float = 0.05, seed: int | None = None) -> None:
        self.mean, self.stddev = number(mean, "mean", None), number(stddev, "stddev")
        self.seed = seed

    def config(self) -> dict[str, Any]:
        """The initializer's settings (what a ps needs to make the same values)."""
        return {"mean": self.mean, "stddev": self.stddev, "seed": self.seed}

    def _generate(self, shape, dtype, offset, full_shape):  # type: ignore[no-untyped-def]
        _float_dtype(dtype, "TruncatedNormal")
        return _truncated(_rng(self.seed, offset), shape) * self.stddev + self.mean


def _truncated(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Standard normal values, each beyond two redrawn (Keras' truncation)."""
    out = rng.standard_normal(shape)
    bad = np.abs(out) > 2.0
    while bad.any():
        out[bad] = rng.standard_normal(int(bad.sum()))
        bad = np.abs(out) > 2.0
    return out


class VarianceScaling(Initializer):
    """Keras' ``VarianceScaling``: values of variance ``scale / n``, ``n`` the fan in,
    the fan out or their mean (``mode``; fans from the whole variable's shape), drawn
    from a normal truncated at two standard deviations (``"truncated_normal"``, also
    ``"normal"``), an untruncated one or a uniform."""

    kind = "variance_scaling"
    MODES = ("fan_in", "fan_out", "fan_avg")
    DISTRIBUTIONS = ("truncated_normal", "untruncated_normal", "uniform")

    def __init__(
        self,
        scale: float = 1.0,
        mode: str = "fan_in",
        distribution: str = "truncated_normal",
        seed: int | None = None,
    ) -> None:
        self.scale = number(scale, "scale", None)
        if self.scale <= 0:
            raise InvalidArgumentError(f"VarianceScaling: scale must be positive, got {scale!r}")
        self.mode = one_of(mode, self.MODES, "VarianceScaling: mode")
        self.distribution = one_of(  # ("normal": Keras' old name for the truncated one)
            distribution,
            self.DISTRIBUTIONS,
            "VarianceScaling: distribution",
            aliases={"normal": "truncated_normal"},
        )
        self.seed = seed

    def config(self) -> dict[str, Any]:
        """The initializer's settings (what a ps needs to make the same values)."""
        return {"scale": self.scale, "mode": self.mode, "distribution": self.distribution, "seed": self.seed}

    def _generate(self, shape, dtype, offset, full_shape):  # type: ignore[no-untyped-def]
        _float_dtype(dtype, type(self).__name__)
        fan_in, fan_out = _fans(full_shape)
        fan = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2.0}[self.mode]
        fan = max(1.0, fan)
        variance = self.scale / fan
        rng = _rng(self.seed, offset)
        if self.distribution == "uniform":
            limit = math.sqrt(3.0 * self.scale / fan)  # (one rounding: GlorotUniform's limit as before)
            return rng.uniform(-limit, limit, size=shape)
        if self.distribution == "untruncated_normal":
            return rng.standard_normal(shape) * math.sqrt(variance)
        # the standard deviation of a standard normal truncated at ±2 is 0.8796...
        return _truncated(rng, shape) * (math.sqrt(variance) / 0.87962566103423978)


class _Preset(VarianceScaling):
    """A ``VarianceScaling`` of fixed settings (Keras' named ones): only a seed is given."""

    SETTINGS: tuple[float, str, str] = (1.0, "fan_in", "truncated_normal")

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(*self.SETTINGS, seed=seed)

    def config(self) -> dict[str, Any]:
        """The initializer's settings (what a ps needs to make the same values)."""
        return {"seed": self.seed}


class GlorotUniform(_Preset):
    """Uniform in ``±sqrt(6 / (fan_in + fan_out))``, fans from the full shape."""

    kind = "glorot_uniform"
    SETTINGS = (1.0, "fan_avg", "uniform")


class GlorotNormal(_Preset):
    """Truncated normal of standard deviation ``sqrt(2 / (fan_in + fan_out))`` (before the
    truncation; Keras' ``GlorotNormal``)."""

    kind = "glorot_normal"
    SETTINGS = (1.0, "fan_avg", "truncated_normal")


class HeNormal(_Preset):
    """Truncated normal of standard deviation ``sqrt(2 / fan_in)`` (Keras' ``HeNormal``)."""

    kind = "he_normal"
    SETTINGS = (2.0, "fan_in", "truncated_normal")


class HeUniform(_Preset):
    """Uniform in ``±sqrt(6 / fan_in)`` (Keras' ``HeUniform``)."""

    kind = "he_uniform"
    SETTINGS = (2.0, "fan_in", "uniform")


class LecunNormal(_Preset):
    """Truncated normal of standard deviation ``sqrt(1 / fan_in)`` (Keras' ``LecunNormal``)."""

    kind = "lecun_normal"
    SETTINGS = (1.0, "fan_in", "truncated_normal")


class LecunUniform(_Preset):
    """Uniform in ``±sqrt(3 / fan_in)`` (Keras' ``LecunUniform``)."""

    kind = "lecun_uniform"
    SETTINGS = (1.0, "fan_in", "uniform")


class Orthogonal(Initializer):
    """Keras' ``Orthogonal``: the Q of a normal matrix's QR decomposition (signs fixed by
    R's diagonal), times ``gain``; the variable's last axis is the matrix's columns. A part
    of a sharded variable makes the whole matrix from the seed and keeps its rows (the
    decomposition is of the whole), so each ps of a large one does the whole QR."""

    kind = "orthogonal"

    def __init__(self, gain: float = 1.0, seed: int | None = None) -> None:
        self.gain, self.seed = number(gain, "gain", None), seed

    def config(self) -> dict[str, Any]:
        """The initializer's settings (what a ps needs to make the same values)."""
        return {"gain": self.gain, "seed": self.seed}

    def _generate(self, shape, dtype, offset, full_shape):  # type: ignore[no-untyped-def]
        _float_dtype(dtype, "Orthogonal")
        if len(full_shape) < 2:
            raise InvalidArgumentError(
                f"Orthogonal needs a variable of 2 or more dimensions, got shape {full_shape}"
            )
        rows, cols = math.prod(full_shape[:-1]), full_shape[-1]
        a = _rng(self.seed, ()).standard_normal((max(rows, cols), min(rows, cols)))
        q, r = np.linalg.qr(a)
        q *= np.sign(np.diag(r))
        if rows < cols:
            q = q.T
        whole = (self.gain * q).reshape(full_shape)
        return whole[_rows_of(shape, offset)]


class Identity(Initializer):
    """Keras' ``Identity``: ``gain`` on the diagonal of a 2-D variable, 0 elsewhere."""

    kind = "identity"

    def __init__(self, gain: float = 1.0) -> None:
        self.gain = number(gain, "gain", None)

    def config(self) -> dict[str, Any]:
        """The initializer's settings (what a ps needs to make the same values)."""
        return {"gain": self.gain}

    def _generate(self, shape, dtype, offset, full_shape):  # type: ignore[no-untyped-def]
        if len(full_shape) != 2:
            raise InvalidArgumentError(f"Identity needs a 2-D variable, got shape {full_shape}")
        first = offset[0] if offset else 0
        return self.gain * np.eye(shape[0], full_shape[1], k=first, dtype=dtype)


def _rows_of(shape: tuple[int, ...], offset: tuple[int, ...]) -> tuple[slice, ...]:
    """The index of a part of ``shape`` at ``offset`` in the whole."""
    offset = offset or (0,) * len(shape)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _fans(shape: tuple[int, ...]) -> tuple[float, float]:
    """Keras' fan computation: receptive field times the last two dims."""
    if len(shape) < 1:
        return 1.0, 1.0
    if len(shape) == 1:
        return float(shape[0]), float(shape[0])
    if len(shape) == 2:
        return float(shape[0]), float(shape[1])
    receptive = math.prod(shape[:-2])
    return float(shape[-2] * receptive), float(shape[-1] * receptive)


_KINDS: dict[str, type[Initializer]] = {
    cls.kind: cls
    for cls in (
        Zeros,
        Ones,
        Constant,
        RandomNormal,
        RandomUniform,
        TruncatedNormal,
        VarianceScaling,
        GlorotUniform,
        GlorotNormal,
        HeNormal,
        HeUniform,
        LecunNormal,
        LecunUniform,
        Orthogonal,
        Identity,
    )
}


def from_spec(spec: dict[str, Any]) -> Initializer:
    """Rebuild an initializer from :meth:`Initializer.spec` (on the ps)."""
    if not isinstance(spec, dict):
        raise InvalidArgumentError(f"initializer spec must be a mapping, got {type(spec).__name__}")
    args = dict(spec)
    cls = _KINDS.get(args.pop("kind", None))
    if cls is None:
        raise InvalidArgumentError(f"unknown initializer {spec.get('kind')!r}; known: {sorted(_KINDS)}")
    try:
        return cls(**args)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"bad arguments for initializer {spec.get('kind')!r}: {exc}") from exc


expose(globals(), "pstrain.initializers")
