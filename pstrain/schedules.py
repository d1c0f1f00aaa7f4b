"""Public façade: :mod:`pstrain._formats.schedules` holds the implementation."""

from ._formats.schedules import *  # noqa: F403
from ._formats.schedules import __all__ as __all__
