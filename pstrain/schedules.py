"""Learning-rate schedules, evaluated on the ps at the optimizer's step (Keras'
``ExponentialDecay``, ``PiecewiseConstantDecay``, ``CosineDecay`` with its warm-up,
``CosineDecayRestarts``, ``InverseTimeDecay``, ``PolynomialDecay``)."""

from ._formats.numerics.schedules import *  # noqa: F403
from ._formats.numerics.schedules import __all__ as __all__
