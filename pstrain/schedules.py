"""Public façade: :mod:`pstrain._formats.numerics.schedules` holds the implementation."""

from ._formats.numerics.schedules import *  # noqa: F403
from ._formats.numerics.schedules import __all__ as __all__
