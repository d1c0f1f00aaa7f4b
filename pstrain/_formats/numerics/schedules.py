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
    "CosineDecayRestarts",
    "ExponentialDecay",
    "InverseTimeDecay",
    "LearningRateSchedule",
    "PiecewiseConstantDecay",
    "PolynomialDecay",
    "evaluate",
    "from_spec",
]


def _positive(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise InvalidArgumentError(f"{what} must be a positive number, got {value!r}")
    return float(value)


def _at_least_zero(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise InvalidArgumentError(f"{what} must be a number of 0 or more, got {value!r}")
    return float(value)


def _fraction(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise InvalidArgumentError(f"{what} must be in [0, 1], got {value!r}")
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


class _StepDecay(LearningRateSchedule):
    """A decay by ``decay_rate`` per ``decay_steps`` (the steps' count floored when
    ``staircase``): Keras' ``ExponentialDecay`` and ``InverseTimeDecay``."""

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
        self.decay_rate = self._checked_rate(decay_rate)
        self.staircase = bool(staircase)
        self.name = name

    def _checked_rate(self, rate: Any) -> float:
        return _positive(rate, "decay_rate")

    def _periods(self, step: float) -> float:
        p = step / self.decay_steps
        return math.floor(p) if self.staircase else p

    def get_config(self) -> dict[str, Any]:
        """The schedule's settings, as Keras' ``get_config``."""
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "decay_steps": self.decay_steps,
            "decay_rate": self.decay_rate,
            "staircase": self.staircase,
        }


class ExponentialDecay(_StepDecay):
    """``initial_learning_rate * decay_rate ** (step / decay_steps)`` (the exponent floored
    when ``staircase``)."""

    kind = "exponential_decay"

    def __call__(self, step: float) -> float:
        return self.initial_learning_rate * self.decay_rate ** self._periods(step)


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
    """Cosine from ``initial_learning_rate`` to ``alpha`` times it over ``decay_steps``, then
    flat. With ``warmup_target``, first a straight line from ``initial_learning_rate`` to
    ``warmup_target`` over ``warmup_steps``, then the cosine from ``warmup_target``."""

    kind = "cosine_decay"

    def __init__(
        self,
        initial_learning_rate: float,
        decay_steps: float,
        alpha: float = 0.0,
        name: str | None = None,
        warmup_target: float | None = None,
        warmup_steps: float = 0,
    ) -> None:
        self.initial_learning_rate = _positive(initial_learning_rate, "initial_learning_rate")
        self.decay_steps = _positive(decay_steps, "decay_steps")
        self.alpha = _fraction(alpha, "alpha")
        self.warmup_target = None if warmup_target is None else _positive(warmup_target, "warmup_target")
        self.warmup_steps = _at_least_zero(warmup_steps, "warmup_steps")
        self.name = name

    def _decayed(self, step: float, start: float) -> float:
        cosine = 0.5 * (1.0 + math.cos(math.pi * step / self.decay_steps))
        return start * ((1.0 - self.alpha) * cosine + self.alpha)

    def __call__(self, step: float) -> float:
        if self.warmup_target is None:
            return self._decayed(min(step, self.decay_steps), self.initial_learning_rate)
        step = min(step, self.decay_steps + self.warmup_steps)
        if step < self.warmup_steps:
            rise = self.warmup_target - self.initial_learning_rate
            return rise * step / self.warmup_steps + self.initial_learning_rate
        return self._decayed(step - self.warmup_steps, self.warmup_target)

    def get_config(self) -> dict[str, Any]:
        """The schedule's settings, as Keras' ``get_config``."""
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "decay_steps": self.decay_steps,
            "alpha": self.alpha,
            "warmup_target": self.warmup_target,
            "warmup_steps": self.warmup_steps,
        }


class CosineDecayRestarts(LearningRateSchedule):
    """Cosine from ``initial_learning_rate`` to ``alpha`` times it over
    ``first_decay_steps``, then again from the start: each period ``t_mul`` times as long
    as the one before, starting ``m_mul`` times as high (SGDR; Keras' formula)."""

    kind = "cosine_decay_restarts"

    def __init__(
        self,
        initial_learning_rate: float,
        first_decay_steps: float,
        t_mul: float = 2.0,
        m_mul: float = 1.0,
        alpha: float = 0.0,
        name: str | None = None,
    ) -> None:
        self.initial_learning_rate = _positive(initial_learning_rate, "initial_learning_rate")
        self.first_decay_steps = _positive(first_decay_steps, "first_decay_steps")
        self.t_mul = _positive(t_mul, "t_mul")
        self.m_mul = _at_least_zero(m_mul, "m_mul")
        self.alpha = _fraction(alpha, "alpha")
        self.name = name

    def __call__(self, step: float) -> float:
        done = step / self.first_decay_steps
        if self.t_mul == 1.0:
            restarts = math.floor(done)
            done -= restarts
        else:
            restarts = math.floor(math.log(1.0 - done * (1.0 - self.t_mul)) / math.log(self.t_mul))
            before = (1.0 - self.t_mul**restarts) / (1.0 - self.t_mul)  # the periods done, in firsts
            done = (done - before) / self.t_mul**restarts
        cosine = 0.5 * self.m_mul**restarts * (1.0 + math.cos(math.pi * done))
        return self.initial_learning_rate * ((1.0 - self.alpha) * cosine + self.alpha)

    def get_config(self) -> dict[str, Any]:
        """The schedule's settings, as Keras' ``get_config``."""
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "first_decay_steps": self.first_decay_steps,
            "t_mul": self.t_mul,
            "m_mul": self.m_mul,
            "alpha": self.alpha,
        }


class InverseTimeDecay(_StepDecay):
    """``initial_learning_rate / (1 + decay_rate * step / decay_steps)`` (the quotient
    floored when ``staircase``)."""

    kind = "inverse_time_decay"

    def _checked_rate(self, rate: Any) -> float:
        return _at_least_zero(rate, "decay_rate")

    def __call__(self, step: float) -> float:
        return self.initial_learning_rate / (1.0 + self.decay_rate * self._periods(step))


class PolynomialDecay(LearningRateSchedule):
    """From ``initial_learning_rate`` to ``end_learning_rate`` over ``decay_steps`` along
    ``(1 - step / decay_steps) ** power``, then flat; with ``cycle``, each time the steps
    pass ``decay_steps`` it is stretched to the next multiple of itself (Keras' rule)."""

    kind = "polynomial_decay"

    def __init__(
        self,
        initial_learning_rate: float,
        decay_steps: float,
        end_learning_rate: float = 0.0001,
        power: float = 1.0,
        cycle: bool = False,
        name: str | None = None,
    ) -> None:
        self.initial_learning_rate = _positive(initial_learning_rate, "initial_learning_rate")
        self.decay_steps = _positive(decay_steps, "decay_steps")
        self.end_learning_rate = _at_least_zero(end_learning_rate, "end_learning_rate")
        self.power = _positive(power, "power")
        self.cycle = bool(cycle)
        self.name = name

    def __call__(self, step: float) -> float:
        steps = self.decay_steps
        if self.cycle:
            steps *= 1.0 if step == 0 else math.ceil(step / self.decay_steps)
        else:
            step = min(step, steps)
        p = step / steps
        return (self.initial_learning_rate - self.end_learning_rate) * (
            1.0 - p
        ) ** self.power + self.end_learning_rate

    def get_config(self) -> dict[str, Any]:
        """The schedule's settings, as Keras' ``get_config``."""
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "decay_steps": self.decay_steps,
            "end_learning_rate": self.end_learning_rate,
            "power": self.power,
            "cycle": self.cycle,
        }


_KINDS: dict[str, type[LearningRateSchedule]] = {
    c.kind: c
    for c in (
        ExponentialDecay,
        PiecewiseConstantDecay,
        CosineDecay,
        CosineDecayRestarts,
        InverseTimeDecay,
        PolynomialDecay,
    )
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
