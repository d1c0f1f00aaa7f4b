"""Learning-rate schedules, evaluated on the ps from the optimizer's ``iterations``.

Keras' formulas (``tf.keras.optimizers.schedules``): a schedule maps the step
(``iterations`` *before* the update, as Keras reads it) to a learning rate.
An optimizer given a schedule sends its description (:meth:`spec`) with every
update; each ps evaluates it at the step the update increments, so every ps
uses the same rate without a round trip per step.

>>> s = ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
>>> round(float(s(10)), 6), round(float(s(5)), 6)
(0.05, 0.070711)
>>> PiecewiseConstantDecay([10, 20], [1.0, 0.5, 0.1])(15)
0.5
>>> round(float(CosineDecay(1.0, decay_steps=100, alpha=0.1)(50)), 6)
0.55
"""

from __future__ import annotations

import abc
import math
from typing import Any

from ..._base.errors import InvalidArgumentError
from ..._base.exports import expose

__all__ = [
    "CosineDecay",
    "ExponentialDecay",
    "LearningRateSchedule",
    "PiecewiseConstantDecay",
    "evaluate",
    "from_spec",
]


def _positive(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidArgumentError(f"{what} must be a positive number, got {value!r}")
    return float(value)


class LearningRateSchedule(abc.ABC):
    """Base class: ``schedule(step) -> learning rate``; ``spec()`` is what travels."""

    kind = ""

    @abc.abstractmethod
    def __call__(self, step: float) -> float:
        """The learning rate at ``step``."""

    @abc.abstractmethod
    def get_config(self) -> dict[str, Any]:
        """The parameters, as the constructor takes them."""

    def spec(self) -> dict[str, Any]:
        """The schedule as the ps evaluates it (its kind and settings)."""
        return {"type": self.kind, **self.get_config()}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"{type(self).__name__}({args})"


class ExponentialDecay(LearningRateSchedule):
    """``initial_learning_rate * decay_rate ** (step / decay_steps)`` (the exponent floored
    when ``staircase``)."""

    kind = "exponential_decay"

    def __init__(
        self,
        initial_learning_rate: float,
        decay_steps: float,
        decay_rate: float,
        staircase: bool = False,
        name: str | None = None,
    ) -> None:
        self.initial_learning_rate = _positive(initial_learning_rate, "initial_learning_rate")
        self.decay_steps = _positive(decay_steps, "decay_steps")
        self.decay_rate = _positive(decay_rate, "decay_rate")
        self.staircase = bool(staircase)
        self.name = name

    def __call__(self, step: float) -> float:
        p = step / self.decay_steps
        if self.staircase:
            p = math.floor(p)
        return self.initial_learning_rate * self.decay_rate**p

    def get_config(self) -> dict[str, Any]:
        """The schedule's settings, as Keras' ``get_config``."""
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "decay_steps": self.decay_steps,
            "decay_rate": self.decay_rate,
            "staircase": self.staircase,
        }


class PiecewiseConstantDecay(LearningRateSchedule):
    """``values[0]`` up to ``boundaries[0]`` (inclusive), ``values[1]`` up to
    ``boundaries[1]``, ..., ``values[-1]`` after the last boundary."""

    kind = "piecewise_constant"

    def __init__(self, boundaries: list[float], values: list[float], name: str | None = None) -> None:
        if len(values) != len(boundaries) + 1:
            raise InvalidArgumentError(
                "The length of boundaries should be 1 less than the length "
                f"of values (got {len(boundaries)} and {len(values)})"
            )
        if any(b2 <= b1 for b1, b2 in zip(boundaries, boundaries[1:])):
            raise InvalidArgumentError(f"boundaries must increase, got {boundaries}")
        self.boundaries = [float(b) for b in boundaries]
        self.values = [_positive(v, "each value") for v in values]
        self.name = name

    def __call__(self, step: float) -> float:
        for boundary, value in zip(self.boundaries, self.values):
            if step <= boundary:
                return value
        return self.values[-1]

    def get_config(self) -> dict[str, Any]:
        """The schedule's settings, as Keras' ``get_config``."""
        return {"boundaries": self.boundaries, "values": self.values}


class CosineDecay(LearningRateSchedule):
    """Cosine from ``initial_learning_rate`` to ``alpha * initial_learning_rate`` over
    ``decay_steps``, then flat."""

    kind = "cosine_decay"

    def __init__(
        self, initial_learning_rate: float, decay_steps: float, alpha: float = 0.0, name: str | None = None
    ) -> None:
        self.initial_learning_rate = _positive(initial_learning_rate, "initial_learning_rate")
        self.decay_steps = _positive(decay_steps, "decay_steps")
        if not 0.0 <= alpha <= 1.0:
            raise InvalidArgumentError(f"alpha must be in [0, 1], got {alpha!r}")
        self.alpha = float(alpha)
        self.name = name

    def __call__(self, step: float) -> float:
        done = min(step, self.decay_steps) / self.decay_steps
        cosine = 0.5 * (1.0 + math.cos(math.pi * done))
        return self.initial_learning_rate * ((1.0 - self.alpha) * cosine + self.alpha)

    def get_config(self) -> dict[str, Any]:
        """The schedule's settings, as Keras' ``get_config``."""
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "decay_steps": self.decay_steps,
            "alpha": self.alpha,
        }


_KINDS: dict[str, type[LearningRateSchedule]] = {
    c.kind: c for c in (ExponentialDecay, PiecewiseConstantDecay, CosineDecay)
}


def from_spec(spec: dict[str, Any]) -> LearningRateSchedule:
    """The schedule a :meth:`LearningRateSchedule.spec` describes (checked by its constructor)."""
    params = dict(spec)
    cls = _KINDS.get(params.pop("type", None))
    if cls is None:
        raise InvalidArgumentError(
            f"unknown learning-rate schedule {spec.get('type')!r}; known: {sorted(_KINDS)}"
        )
    return cls(**params)


def evaluate(learning_rate: float | dict[str, Any], step: int) -> float:
    """The rate at ``step``: a number as it is, a schedule's spec evaluated."""
    if isinstance(learning_rate, dict):
        return from_spec(learning_rate)(step)
    return float(learning_rate)


expose(globals(), "pstrain.schedules")
